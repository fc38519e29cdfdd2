"""Pins on a replica: the admin's pin routes (standalone), and the assignment each pressure
answer carries applied to the engine (catalog mode): new versions pinned, old ones unpinned,
refusals kept apart, nothing done again while the assignment stays the same."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from loraplane.dataplane.lora.errors import PinRefused
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.pins import PinSync, assigned
from loraplane.dataplane.server.pressure import PressureReporter, UsageLog
from loraplane.dataplane.snapshot import EngineSnapshot
from tests.dataplane.server.conftest import ADMIN_TOKEN, API_KEY, Running

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TENANT = {"Authorization": f"Bearer {API_KEY}"}


def post(server: Running, path: str, name: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(server.v1 + path, json={"lora_name": name}, headers=headers, timeout=60)


def test_the_admin_pins_static_adapters_up_to_half_the_slots_and_unpins_them(
    server: Running,
) -> None:
    assert post(server, "/pin_lora_adapter", "ad01", TENANT).status_code == 403
    assert post(server, "/pin_lora_adapter", "nope", ADMIN).status_code == 404
    names = [f"ad0{i}" for i in range(5)]
    try:
        for name in names[:4]:  # max_loras 8: four pins at most
            r = post(server, "/pin_lora_adapter", name, ADMIN)
            assert r.status_code == 200, r.text
            assert r.json()["pinned"] and r.json()["state"] in ("host", "loading", "resident")
        r = post(server, "/pin_lora_adapter", names[4], ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "PinsDoNotFit"
        assert "5 adapters on this replica, more than its cap of 4" in r.json()["error"]["message"]
        assert post(server, "/unpin_lora_adapter", names[0], ADMIN).json()["pinned"] is False
        assert post(server, "/pin_lora_adapter", names[4], ADMIN).status_code == 200
    finally:
        for name in names:
            assert post(server, "/unpin_lora_adapter", name, ADMIN).status_code == 200


def test_an_assignment_pins_new_versions_unpins_old_ones_and_keeps_refusals_apart() -> None:
    calls: list[tuple[str, str]] = []

    async def command(name: str, *args: Any) -> Any:
        ref: LoRARef = args[0]
        calls.append((name, ref.name))
        if name == "pin" and ref.name == "big":
            raise PinRefused("pinning big needs 9 bytes")
        return "loading" if name == "pin" else None

    a, b, big = (LoRARef(n, "acme", f"{n:0>64}") for n in ("a", "b", "big"))
    sync = PinSync(command)
    asyncio.run(sync.apply([(a, "p/a"), (big, "p/big")]))
    assert calls == [("register_stored", "a"), ("pin", "a"), ("register_stored", "big"),
                     ("pin", "big")]  # fmt: skip
    assert sync.pinned == {a} and "needs 9 bytes" in sync.refused[big.key]
    calls.clear()
    asyncio.run(sync.apply([(b, "p/b")]))
    assert calls == [("unpin", "a"), ("register_stored", "b"), ("pin", "b")]
    assert sync.pinned == {b}


def test_a_pressure_answer_s_pins_reach_the_replica_once_per_change() -> None:
    answers = [[], [{"tenant": "acme", "adapter": "a", "version": 1, "digest": "d" * 64,
                     "path": "adapters/acme/a/v1"}]]  # fmt: skip
    sent = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        pins = answers[min(sent["n"], 1)]
        sent["n"] += 1
        body = {"usage_rows": 0, "usage_skipped": 0, "base_model_config_known": True,
                "replicas": 2, "pins": pins}  # fmt: skip
        return httpx.Response(200, content=json.dumps(body))

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot()

    applied: list[list[str]] = []

    async def on_pins(pins: list[tuple[LoRARef, str]]) -> None:
        applied.append([f"{ref.key} {path}" for ref, path in pins])

    async def run(retry: bool) -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, UsageLog(),
                                    client=client)  # fmt: skip
        reporter.on_pins = on_pins
        reporter.pins_retry = lambda: retry
        for _ in range(4):
            assert await reporter.report_once()
        await client.aclose()

    asyncio.run(run(retry=False))
    one = [f"acme/a@{'d' * 64} adapters/acme/a/v1"]
    assert applied == [[], one]
    applied.clear()
    asyncio.run(run(retry=True))  # a version not held here: the same assignment goes again
    assert applied == [one] * 4
    assert assigned({"replicas": 1}) is None  # a control plane from before pins: no change


def test_the_pin_states_say_held_or_refused_per_assigned_version_and_forget_old_refusals() -> None:
    async def command(name: str, *args: Any) -> Any:
        if name == "pin" and args[0].name == "big":
            raise PinRefused("pinning big needs 9 bytes")
        if name == "pin_states":
            return ["resident" if ref.name == "a" else "loading" for ref in args[0]]
        return "loading" if name == "pin" else None

    a, b, big = (LoRARef(n, "acme", f"{n:0>64}") for n in ("a", "b", "big"))
    sync = PinSync(command)
    asyncio.run(sync.apply([(a, "p/a"), (big, "p/big")]))
    states = asyncio.run(sync.states())
    assert states == [
        {"tenant": "acme", "adapter": "a", "digest": a.digest, "state": "resident"},
        {"tenant": "acme", "adapter": "big", "digest": big.digest,
         "state": "refused: pinning big needs 9 bytes"},
    ]  # fmt: skip
    asyncio.run(sync.apply([(b, "p/b")]))
    assert [s["state"] for s in asyncio.run(sync.states())] == ["loading"]
    assert sync.refused == {}  # no longer assigned: its refusal is not reported again


def test_an_unchanged_assignment_is_applied_again_while_a_version_is_not_held_here(
    tiny_llama_dir: Any, peft_adapters: dict[str, Any]
) -> None:
    """A real manager drops a pin when its version is unregistered (an unload) and refuses one
    past its cap; the replica's reporter applies the same assignment again after RETRY_S, so
    both come back once they can (before, only a change of the assignment tried again)."""
    from tests.dataplane.test_lora_manager import manager

    m = manager(tiny_llama_dir, None, slots=4)  # pins: half the slots, 2
    names = ["r4", "r8-qv", "r16"]
    refs = {n: m.register(n, peft_adapters[n], "acme") for n in names}

    async def command(name: str, *args: Any) -> Any:  # the engine commands, on the real manager
        if name == "register_stored":
            ref = args[0]
            return m.register(ref.name, peft_adapters[ref.name], ref.tenant)
        if name == "pin_states":
            return [m.pin_state(ref) for ref in args[0]]
        return getattr(m, name)(*args)

    sync = PinSync(command)
    sync.retry_s = 0.0
    assignment = [(refs[n], f"p/{n}") for n in names]

    def states() -> dict[str, str]:
        return {s["adapter"]: s["state"] for s in asyncio.run(sync.states())}

    asyncio.run(sync.apply(assignment))
    first = states()
    assert first["r16"].startswith("refused:") and "cap of 2" in first["r16"]
    assert sync.retry_due()
    m.unregister("r4", "acme")  # an unload: the engine lets go of r4's pin
    assert states()["r4"] == "unpinned" and sync.retry_due()
    asyncio.run(sync.apply(assignment))  # the same again: r4 back, r16 still past the cap
    again = states()
    assert again["r4"] in ("host", "loading", "resident") and again["r16"].startswith("refused:")
    asyncio.run(sync.apply(assignment[1:]))  # r4 no longer assigned: room for r16
    assert set(states().values()) <= {"host", "loading", "resident"}
    assert not sync.retry_due()
    m.close()
