"""Catalog mode: resolve tenants' keys and model names through the control plane.

`GET {url}/internal/v1/resolve?model=...` with the service token as bearer and the caller's key
in `X-Tenant-Key` (docs/controlplane.md, the internal API); answers are cached for `ttl` seconds
per (key, model), so a revoked key or a deleted adapter stops working within the TTL. Refusals
(401/404) are cached too, so a flood of bad keys does not become a flood of control plane calls,
but in a cache of their own (NEGATIVE_ENTRIES, for at most NEGATIVE_TTL_S): random keys can
evict only other refusals, never a tenant's good answer, which an outage may need. /v1/models
lists the tenant's adapters with `GET {url}/v1/adapters` under its own key. Both go through
`loraplane.internal_api.AsyncInternalAPIClient`; `_api_error` is the one place its errors become
OpenAI errors (401, 404, 429 busy, 503 `CatalogDown`, 502 otherwise).

Serving does not depend on the control plane being up for tenants it already knows: while the
control plane is unreachable (no connection, a timeout, or a 5xx answer), a (key, model) that
resolved within the last `stale` seconds keeps its last good resolution, and a key that listed
its models within that window gets that list again; anything else gets 503 with Retry-After.
After a failed call the control plane is left alone for a moment (`ttl`, at most RETRY_S), so
an outage does not cost every request a connection timeout. Whenever the control plane
answers, its answer wins at once: a key revoked during the outage stops working within the TTL
of its return.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import httpx

from loraplane.dataplane.server.catalog import ModelEntry, Resolved, weight_of
from loraplane.dataplane.server.errors import (
    APIError,
    ModelNotFound,
    Unauthorized,
    Unavailable,
    UpstreamError,
)
from loraplane.dataplane.server.rollout import Picker, SplitVersion
from loraplane.internal_api import (
    INVALID_RESPONSE,
    AsyncInternalAPIClient,
    InternalAPIError,
    json_of,
)

CACHE_ENTRIES = 10_000  # good resolutions (and last good /v1/models lists), least recent out
NEGATIVE_ENTRIES = 10_000  # refusals (unknown key, unknown model): a bound of their own
NEGATIVE_TTL_S = 2.0  # a refusal is cached this long at most (a new key works soon)
RETRY_S = 5.0  # after a failed call, the control plane is called again this much later at most
TIMEOUT_S = 5.0  # per call: a resolution is on a request's path


class _Entry(NamedTuple):
    expires: float  # fresh until then
    result: Resolved | APIError
    good_until: float  # a Resolved result may stand in for an unreachable control plane until


class _Models(NamedTuple):
    rows: tuple[ModelEntry, ...]  # a key's last good /v1/models answer
    good_until: float  # it may stand in for an unreachable control plane until then


K = TypeVar("K")
V = TypeVar("V")


class CatalogDown(Unavailable):
    """The control plane did not answer (transport error or 5xx): stale answers may serve."""


class HttpCatalog:
    """A `Catalog` backed by the control plane's internal API, with a short TTL cache."""

    def __init__(
        self,
        url: str,
        service_token: str | None,
        base_model: str,
        ttl: float = 5.0,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        stale: float = 300.0,
        *,
        entries: int = CACHE_ENTRIES,
        negative_entries: int = NEGATIVE_ENTRIES,
        negative_ttl: float = NEGATIVE_TTL_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.base_model = base_model
        self.ttl = ttl
        self.negative_ttl = min(ttl, negative_ttl)
        self.stale = stale
        self.entries, self.negative_entries = entries, negative_entries
        self.stale_answers = 0  # answers served from a last good one (an outage)
        self._down_until = 0.0  # no call before then: the last one failed
        self._api = AsyncInternalAPIClient(url, service_token, timeout=TIMEOUT_S, client=client)
        self._clock = clock
        # sha256(key) + model -> a good answer; refusals (the error to raise again) apart, so
        # that no number of bad keys can push a good answer out
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._models: OrderedDict[str, _Models] = OrderedDict()  # sha256(key) -> last list
        # a weighted rollout's answer is narrowed to one version per request (rollout.py); the
        # runtime gives it a Warmer so a version takes requests only once in host memory
        self.picker = Picker()

    async def resolve(
        self, api_key: str | None, model: str, *, rollout_key: str | None = None
    ) -> Resolved:
        """See Catalog.resolve."""
        if not api_key:
            raise Unauthorized("send Authorization: Bearer <your API key>")
        # the cache never holds a key in clear
        cache_key = (hashlib.sha256(api_key.encode()).hexdigest(), model)
        now = self._clock()
        hit = self._cache.get(cache_key)
        if hit is not None and hit.expires > now:
            self._cache.move_to_end(cache_key)
            return await self._one_version(_unwrap(hit.result), rollout_key)
        refused = self._refused.get(cache_key)
        if refused is not None and refused.expires > now:
            return _unwrap(refused.result)
        try:
            self._check_down(now)
            result = await self._fetch(api_key, model)
        except (Unauthorized, ModelNotFound) as e:
            # a revoked key or a deleted adapter: its old good answer must not stand in later
            self._cache.pop(cache_key, None)
            _put(self._refused, cache_key, _Entry(now + self.negative_ttl, e, 0.0),
                 self.negative_entries)  # fmt: skip
            return _unwrap(e)
        except CatalogDown:
            self._went_down(now)
            if hit is not None and hit.good_until > now:
                self.stale_answers += 1
                # a tenant it knows: served through the outage
                return await self._one_version(_unwrap(hit.result), rollout_key)
            raise
        self._refused.pop(cache_key, None)
        _put(self._cache, cache_key, _Entry(now + self.ttl, result, now + self.stale), self.entries)
        return await self._one_version(result, rollout_key)

    async def _one_version(self, result: Resolved, rollout_key: str | None) -> Resolved:
        """The answer for one request: a rollout's split narrowed to one version by weight
        (by the sticky key's bucket when there is one)."""
        return await self.picker.pick(result, rollout_key) if result.rollout else result

    def _check_down(self, now: float) -> None:
        """CatalogDown while the control plane is left alone after a failed call."""
        if now < self._down_until:
            raise CatalogDown("the catalog is unreachable", retry_after=RETRY_S)

    def _went_down(self, now: float) -> None:
        self._down_until = max(self._down_until, now + min(self.ttl, RETRY_S))

    async def _fetch(self, api_key: str, model: str) -> Resolved:
        data = await self._get(
            "/internal/v1/resolve", model, params={"model": model}, tenant_key=api_key
        )
        if not isinstance(data, dict) or not isinstance(data.get("tenant"), str):
            raise UpstreamError("the control plane answered an unexpected resolve body")
        version = data.get("version")
        return Resolved(
            tenant=data["tenant"],
            adapter=data.get("adapter"),
            version=None if version is None else str(version),
            digest=data.get("digest"),
            path=data.get("path"),
            rank=data.get("rank"),
            requests_per_minute=int(data.get("requests_per_minute") or 0),
            tokens_per_minute=int(data.get("tokens_per_minute") or 0),
            weight=weight_of(data.get("weight"), data["tenant"]),
            rollout=_split_of(data.get("rollout")),
        )

    async def _get(
        self,
        path: str,
        model: str,
        *,
        params: dict[str, str] | None = None,
        tenant_key: str | None = None,
        token: str | None = None,
    ) -> Any:
        try:
            response = await self._api.request(
                "GET", path, params=params, tenant_key=tenant_key, token=token
            )
            if response.status_code != 200:
                raise UpstreamError(f"the catalog answered HTTP {response.status_code}")
            return json_of(response)
        except InternalAPIError as e:
            raise _api_error(e, model) from e

    async def list_models(self, api_key: str | None) -> list[ModelEntry]:
        """The base model and the tenant's adapters of this base model (current versions)."""
        if not api_key:
            raise Unauthorized("send Authorization: Bearer <your API key>")
        cache_key = hashlib.sha256(api_key.encode()).hexdigest()
        now = self._clock()
        try:
            self._check_down(now)
            data = await self._get("/v1/adapters", "", token=api_key)
        except CatalogDown:
            self._went_down(now)
            last = self._models.get(cache_key)
            if last is not None and last.good_until > now:
                self.stale_answers += 1
                return list(last.rows)  # as resolve does: a key it knows lists its models
            raise
        except Unauthorized:
            self._models.pop(cache_key, None)  # revoked: never listed from an old answer
            raise
        rows = [ModelEntry(self.base_model, None)]
        for item in data if isinstance(data, list) else []:
            if (
                isinstance(item, dict)
                and item.get("base_model") == self.base_model
                and item.get("current_version") is not None
                and isinstance(item.get("name"), str)
            ):
                rows.append(ModelEntry(item["name"], self.base_model))
        _put(self._models, cache_key, _Models(tuple(rows), now + self.stale), self.entries)
        return rows

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._api.aclose()


def _api_error(err: InternalAPIError, model: str) -> APIError:
    """The OpenAI error a failed catalog call answers (a 5xx or no answer: CatalogDown)."""
    if err.status is None:
        name = type(err.__cause__).__name__  # never the error's text: it may name hosts
        return CatalogDown(f"the catalog is unreachable: {name}", retry_after=RETRY_S)
    if err.unavailable:
        return CatalogDown(f"the catalog answered HTTP {err.status}", retry_after=RETRY_S)
    if err.status == 401:
        return Unauthorized("Incorrect API key provided.")
    if err.status == 404:
        return ModelNotFound(model)
    if err.status == 429:
        return Unavailable("the catalog is busy", retry_after=RETRY_S)
    if err.code == INVALID_RESPONSE:
        return UpstreamError("the catalog answered invalid JSON")
    return UpstreamError(f"the catalog answered HTTP {err.status}")


def _split_of(value: object) -> tuple[SplitVersion, ...]:
    """A resolve answer's `rollout` (absent from a control plane without rollouts) as split
    versions; anything malformed is no split (the answer's current version serves)."""
    if not isinstance(value, list):
        return ()
    split: list[SplitVersion] = []
    for item in value:
        if not isinstance(item, dict):
            return ()
        version, weight = item.get("version"), item.get("weight")
        digest, path, rank = item.get("digest"), item.get("path"), item.get("rank")
        if not (
            isinstance(version, int) and isinstance(weight, int) and weight >= 0
            and isinstance(digest, str) and digest and isinstance(path, str) and path
        ):  # fmt: skip
            return ()
        split.append(
            SplitVersion(
                str(version), weight, digest, path, rank if isinstance(rank, int) else None
            )
        )
    return tuple(split)


def _put(cache: OrderedDict[K, V], key: K, value: V, limit: int) -> None:
    """Store `value` as the most recent entry; the least recent go past `limit`."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


def _unwrap(result: Resolved | APIError) -> Resolved:
    if isinstance(result, APIError):
        raise copy.copy(result)  # a fresh instance: tracebacks do not pile up on a cached one
    return result
