"""This replica's pinned adapter versions (docs/dataplane.md, "Pinned adapters").

In catalog mode each pressure answer names the versions the control plane assigned to this
replica (`pins`: tenant, adapter, version, digest, store path); `PinSync.apply` registers the
new ones, pins them in the engine (which loads them at once and keeps them on the device) and
unpins those no longer named. A pin the engine refuses (`PinRefused`: past half the adapter
memory or slots) is logged and left out; the next change of the assignment tries again.
Standalone, the admin pins a --lora-modules adapter by name (`/v1/pin_lora_adapter`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from loraplane.dataplane.lora.manager import PinRefused
from loraplane.dataplane.sequence import LoRARef

log = logging.getLogger(__name__)
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

    async def apply(self, pins: list[tuple[LoRARef, str]]) -> None:
        """Pin the versions of `pins` (registering those the engine does not know) and unpin
        those pinned before that it no longer names."""
        wanted = {ref for ref, _ in pins}
        for ref in sorted(self.pinned - wanted, key=lambda r: r.key):
            await self._command("unpin", ref)
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
