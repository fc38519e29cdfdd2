"""This replica's pinned adapter versions (docs/dataplane.md, "Pinned adapters").

In catalog mode each pressure answer names the versions the control plane assigned to this
replica (`pins`: tenant, adapter, version, digest, store path); `PinSync.apply` registers the
new ones, pins them in the engine (which loads them at once and keeps them on the device) and
unpins those no longer named. A pin the engine refuses (`PinRefused`: past half the adapter
memory or slots) is logged and left out; so is one the engine let go of later (unpinned once
its size was known, or its version unregistered). Either is tried again with the next change
of the assignment, or with an unchanged one every RETRY_S while some assigned version is not
held here (`retry_due`), since other pins leaving may have made room.
`PinSync.states` tells the control plane, in each pressure report (`pin_states`), what became
of every assigned version here: `resident`, `host`, `loading`, `failed: <why>` or
`refused: <why>` (refused at pin time, or unpinned by the engine once its size was known), so
`GET /v1/pins` shows which replicas hold a pin and which refused it, and why.
Standalone, the admin pins a --lora-modules adapter by name (`/v1/pin_lora_adapter`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from loraplane.dataplane.lora.errors import PinRefused
from loraplane.dataplane.sequence import LoRARef

log = logging.getLogger(__name__)
MAX_STATE = 1000  # characters of a state sent (the control plane's PinState.state bound)
RETRY_S = 30.0  # an unchanged assignment with versions not held here is applied again after
_NOT_HELD = ("refused", "unpinned")  # engine pin states that mean this replica let it go
Command = Callable[..., Awaitable[Any]]


def assigned(answer: object) -> list[tuple[LoRARef, str]] | None:
    """The (version, store path) pairs a pressure answer assigns; None when it names none
    (a control plane from before pins): nothing changes then."""
    if not isinstance(answer, dict) or not isinstance(answer.get("pins"), list):
        return None
    out = []
    for item in answer["pins"]:
        try:
            ref = LoRARef(str(item["adapter"]), str(item["tenant"]), str(item["digest"]))
            out.append((ref, str(item["path"])))
        except (KeyError, TypeError):
            continue
    return out


class PinSync:
    """Keeps the engine's pins equal to the last assignment (`command` runs engine commands)."""

    def __init__(self, command: Command) -> None:
        self._command = command
        self.pinned: set[LoRARef] = set()  # what this replica pinned on the assignment's word
        self.refused: dict[str, str] = {}  # ref.key -> why the engine refused its pin
        self.assigned: list[LoRARef] = []  # the last assignment, in its order
        self.unheld = False  # the last states() found an assigned version not held here
        self.retry_s = RETRY_S
        self._applied_at = float("-inf")

    def retry_due(self) -> bool:
        """Whether an unchanged assignment should be applied again: some assigned version is
        not held here (refused, or let go by the engine) and RETRY_S passed since the last
        try."""
        return self.unheld and time.monotonic() - self._applied_at >= self.retry_s

    async def apply(self, pins: list[tuple[LoRARef, str]]) -> None:
        """Pin the versions of `pins` (registering those the engine does not know) and unpin
        those pinned before that it no longer names."""
        self._applied_at = time.monotonic()
        wanted = {ref for ref, _ in pins}
        self.assigned = [ref for ref, _ in pins]
        keys = {ref.key for ref in wanted}
        self.refused = {k: why for k, why in self.refused.items() if k in keys}
        for ref in sorted(self.pinned - wanted, key=lambda r: r.key):
            await self._command("unpin", ref)
            self.pinned.discard(ref)
        kept = [ref for ref, _ in pins if ref in self.pinned]
        if kept:  # pinned here before: those the engine let go of since are pinned again
            states = await self._command("pin_states", kept)
            for ref, state in zip(kept, states, strict=True):
                if str(state).startswith(_NOT_HELD):
                    self.pinned.discard(ref)
        for ref, path in pins:
            if ref in self.pinned:
                continue
            await self._command("register_stored", ref, path)
            try:
                state = await self._command("pin", ref)
            except PinRefused as e:
                self.refused[ref.key] = str(e)
                log.warning("pin of %s refused on this replica: %s", ref.key, e)
                continue
            self.refused.pop(ref.key, None)
            self.pinned.add(ref)
            log.info("pinned %s (%s)", ref.key, state)

    async def states(self) -> list[dict[str, str]]:
        """Each assigned version's pin state here, for the pressure report (`pin_states`):
        the engine's word (`pin_state`) for those it took, `refused: <why>` for the others."""
        taken = [ref for ref in self.assigned if ref in self.pinned]
        engine: list[str] = list(await self._command("pin_states", taken)) if taken else []
        said = dict(zip((ref.key for ref in taken), engine, strict=True))
        out = []
        for ref in self.assigned:
            state = said.get(ref.key)
            if state is None:
                why = self.refused.get(ref.key)
                state = f"refused: {why}" if why is not None else "pending"
            out.append({"tenant": ref.tenant, "adapter": ref.name, "digest": ref.digest,
                        "state": state[:MAX_STATE]})  # fmt: skip
        self.unheld = any(s["state"].startswith(_NOT_HELD) for s in out)
        return out
