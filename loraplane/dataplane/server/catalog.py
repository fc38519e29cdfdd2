"""Who may call, and what a request's `model` means: the catalog interface.

The routes ask a `Catalog` two things: `resolve(api_key, model)` (the caller's tenant and the
adapter version, or the base model) and `list_models(api_key)` (for /v1/models). Two
implementations: `StaticCatalog` for standalone mode (one tenant, "default"; adapters from
`--lora-modules`; an optional single API key) and `HttpCatalog` (catalog_http.py) that asks the
control plane's `/internal/v1/resolve`. Both raise the server's own errors (Unauthorized,
ModelNotFound, Unavailable), never HTTP client errors.

Versions in standalone mode: an adapter has one version, its content; `name@1` and
`name@<digest prefix>` (at least 8 hex digits of the adapter's sha256 digest) both pin it.
"""

from __future__ import annotations

import hmac
import logging
import math
from dataclasses import dataclass
from typing import Protocol

from loraplane.dataplane.server.errors import ModelNotFound, Unauthorized
from loraplane.dataplane.server.rollout import SplitVersion

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
DEFAULT_WEIGHT = 1.0  # every tenant alike: standalone mode, and a control plane without weights
MIN_DIGEST_PIN = 8


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a request's model name means for its caller.

    `adapter` is None for the base model. `path` is a catalog store path: it is used to load the
    adapter and never shown to a client. Limits of 0 mean unlimited. `weight` is the tenant's
    share of a contended replica's seats and served tokens, relative to other tenants' weights.
    """

    tenant: str
    adapter: str | None = None
    version: str | None = None
    digest: str | None = None
    path: str | None = None
    rank: int | None = None
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    weight: float = DEFAULT_WEIGHT
    # a weighted rollout's versions (catalog mode, an unpinned name): the catalog narrows the
    # answer to one of them per request (rollout.py); empty for everything a route sees
    rollout: tuple[SplitVersion, ...] = ()


def weight_of(value: object, tenant: str) -> float:
    """The tenant's weight from a resolve answer's `weight` field.

    Missing (a control plane from before weights) is DEFAULT_WEIGHT. So is anything but a
    positive finite number, with a warning: a request is never refused over its tenant's share.
    """
    if value is None:
        return DEFAULT_WEIGHT
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            weight = float(value)
        except OverflowError:  # an integer past any float
            weight = math.inf
        if math.isfinite(weight) and weight > 0:
            return weight
    log.warning(
        "the catalog answered weight %.40r for tenant %s, not a positive number: using %g",
        value,
        tenant,
        DEFAULT_WEIGHT,
    )
    return DEFAULT_WEIGHT


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One row of /v1/models: the base model (parent None) or an adapter of the caller."""

    id: str
    parent: str | None


class Catalog(Protocol):
    """Tenants and their adapters, as the data plane sees them."""

    async def resolve(
        self, api_key: str | None, model: str, *, rollout_key: str | None = None
    ) -> Resolved:
        """The caller's tenant and what `model` (`name`, `name@version`, the base model) is;
        under a weighted rollout, one version picked by weight (by `rollout_key`'s bucket
        when given: rollout.py).

        Raises Unauthorized (bad key), ModelNotFound, or Unavailable (catalog unreachable).
        """
        ...

    async def list_models(self, api_key: str | None) -> list[ModelEntry]:
        """The base model and the caller's adapters (Unauthorized for a bad key)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def split_model(model: str) -> tuple[str, str | None]:
    """`name@pin` -> (name, pin); `name` -> (name, None)."""
    name, sep, pin = model.rpartition("@")
    return (name, pin) if sep else (model, None)


@dataclass(frozen=True, slots=True)
class StaticAdapter:
    """An adapter served in standalone mode: its name and content digest."""

    name: str
    digest: str


class StaticCatalog:
    """Standalone mode: tenant "default", the base model and the registered static adapters.

    Adapters are added once the engine registered them and removed when unloaded (or while
    they are being unloaded: new requests no longer find them).
    """

    def __init__(
        self,
        base_model: str,
        api_key: str | None = None,
        requests_per_minute: int = 0,
        tokens_per_minute: int = 0,
    ) -> None:
        self.base_model = base_model
        self._api_key = api_key
        self._rpm = requests_per_minute
        self._tpm = tokens_per_minute
        self._adapters: dict[str, StaticAdapter] = {}

    def add(self, name: str, digest: str) -> None:
        """Serve `name` (its registered content has `digest`)."""
        self._adapters[name] = StaticAdapter(name, digest)

    def remove(self, name: str) -> StaticAdapter | None:
        """Stop serving `name`; the adapter it was, or None."""
        return self._adapters.pop(name, None)

    def get(self, name: str) -> StaticAdapter | None:
        """The served adapter called `name`, or None."""
        return self._adapters.get(name)

    def _authenticate(self, api_key: str | None) -> str:
        if self._api_key is None:
            return DEFAULT_TENANT
        if not check_api_key(self._api_key, api_key):
            raise Unauthorized("Incorrect API key provided: send Authorization: Bearer <key>.")
        return DEFAULT_TENANT

    async def resolve(
        self, api_key: str | None, model: str, *, rollout_key: str | None = None
    ) -> Resolved:
        """See Catalog.resolve (no rollouts here: `rollout_key` changes nothing)."""
        tenant = self._authenticate(api_key)
        rpm, tpm = self._rpm, self._tpm
        if model == self.base_model:
            return Resolved(tenant, requests_per_minute=rpm, tokens_per_minute=tpm)
        name, pin = split_model(model)
        found = self._adapters.get(name)
        if found is None or not _pin_matches(pin, found.digest):
            raise ModelNotFound(model)
        return Resolved(
            tenant, name, "1", found.digest, requests_per_minute=rpm, tokens_per_minute=tpm
        )

    async def list_models(self, api_key: str | None) -> list[ModelEntry]:
        """See Catalog.list_models."""
        self._authenticate(api_key)
        rows = [ModelEntry(self.base_model, None)]
        rows += [ModelEntry(name, self.base_model) for name in sorted(self._adapters)]
        return rows

    async def aclose(self) -> None:
        """Nothing to release."""


def _pin_matches(pin: str | None, digest: str) -> bool:
    if pin is None or pin == "1":
        return True
    pin = pin.lower()
    return len(pin) >= MIN_DIGEST_PIN and digest.lower().startswith(pin)


def check_api_key(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison of bearer tokens; False when either is missing."""
    if expected is None or given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())
