"""Weighted rollouts on the data plane: 2,000 picks at 90/10 land within 2 points of the
split; a version takes requests only once it is in host memory here; and end to end, against
the real control plane, a canary set by PATCH is loaded before its first request and every
request is counted per version on the metrics port."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.catalog import Resolved
from loraplane.dataplane.server.catalog_http import _split_of
from loraplane.dataplane.server.rollout import Picker, SplitVersion, Warmer, bucket
from tests.dataplane.server.test_tenant_shares import replica

SPLIT = (SplitVersion("1", 90, "a" * 64, "adapters/t/bot/v1"),
         SplitVersion("2", 10, "b" * 64, "adapters/t/bot/v2"))  # fmt: skip
ANSWER = Resolved("acme", "bot", "1", "a" * 64, "adapters/t/bot/v1", rollout=SPLIT)


class Ready:
    """A readiness stand-in: the versions it names are in host memory; those in `failing`
    cannot load."""

    def __init__(self, versions: set[str], failing: set[str] | None = None) -> None:
        self.versions, self.failing = versions, failing or set()

    async def ready(self, tenant: str, adapter: str, split: tuple[SplitVersion, ...]) -> set[str]:
        return set(self.versions)

    def failed(self, tenant: str, adapter: str, version: SplitVersion) -> str | None:
        return "AdapterRejected: gone" if version.version in self.failing else None


def picks(picker: Picker, n: int) -> dict[str, int]:
    async def run() -> dict[str, int]:
        seen: dict[str, int] = {}
        for _ in range(n):
            one = await picker.pick(ANSWER)
            assert one.rollout == () and one.path and one.digest
            assert one.digest[0] == {"1": "a", "2": "b"}[one.version or ""]
            seen[one.version or ""] = seen.get(one.version or "", 0) + 1
        return seen

    return asyncio.run(run())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_2000_picks_at_90_10_land_within_2_points_of_the_split(seed: int) -> None:
    seen = picks(Picker(Ready({"1", "2"}), random.Random(seed)), 2000)
    assert abs(seen["2"] / 2000 - 0.10) <= 0.02, seen
    assert seen["1"] + seen["2"] == 2000


def test_a_sticky_key_gets_one_version_everywhere_and_2000_keys_split_within_2_points() -> None:
    async def run() -> dict[str, int]:
        # two replicas' pickers, their random generators apart: a key still gets one version
        here, there = (Picker(Ready({"1", "2"}), random.Random(seed)) for seed in (0, 1))
        seen: dict[str, int] = {}
        for i in range(2000):
            key = f"user-{i}"
            first = (await here.pick(ANSWER, key)).version or ""
            again = [(await p.pick(ANSWER, key)).version for p in (there, here, there)]
            assert again == [first] * 3, key
            seen[first] = seen.get(first, 0) + 1
        return seen

    seen = asyncio.run(run())
    assert abs(seen["2"] / 2000 - 0.10) <= 0.02, seen
    assert seen["1"] + seen["2"] == 2000


def test_raising_the_canary_s_weight_moves_sticky_keys_to_it_never_back() -> None:
    def split(canary: int) -> Resolved:
        versions = (SplitVersion("1", 100 - canary, "a" * 64, "p/v1"),
                    SplitVersion("2", canary, "b" * 64, "p/v2"))  # fmt: skip
        return Resolved("acme", "bot", "1", "a" * 64, "p/v1", rollout=versions)

    async def versions(canary: int) -> dict[str, str]:
        picker = Picker(Ready({"1", "2"}))
        return {
            k: (await picker.pick(split(canary), k)).version or "" for k in map(str, range(500))
        }

    at10, at30 = asyncio.run(versions(10)), asyncio.run(versions(30))
    assert {k for k, v in at10.items() if v == "2"} < {k for k, v in at30.items() if v == "2"}
    assert all(at30[k] == ("2" if bucket("acme", "bot", k) >= 0.7 else "1") for k in at30)


def test_without_a_key_the_same_caller_is_split_at_random() -> None:
    """The negative control: no key, no stickiness (200 picks at 90/10 from one caller)."""
    seen = picks(Picker(Ready({"1", "2"}), random.Random(3)), 200)
    assert seen["1"] and seen["2"]


def test_a_version_not_yet_in_host_memory_gets_no_request_its_share_goes_to_the_current() -> None:
    assert picks(Picker(Ready({"1"}), random.Random(0)), 500) == {"1": 500}
    # the canary alone warm (the current version evicted): the current still takes its share
    seen = picks(Picker(Ready({"2"}), random.Random(0)), 2000)
    assert abs(seen["2"] / 2000 - 0.10) <= 0.02


@pytest.mark.parametrize(("failing", "reason"), [(set(), "loading"), ({"2"}, "failed")])
def test_requests_meant_for_a_version_not_warm_here_are_counted_as_diverted(
    failing: set[str], reason: str
) -> None:
    """What the split meant for the cold canary runs on the current version and is counted,
    with the reason, so a canary whose loads keep failing shows (not a quiet 0% share)."""
    diverted: dict[tuple[str, ...], int] = {}

    def count(*labels: str) -> None:
        diverted[labels] = diverted.get(labels, 0) + 1

    picker = Picker(Ready({"1"}, failing), random.Random(0), diverted=count)
    assert picks(picker, 2000) == {"1": 2000}
    (labels, n), *rest = diverted.items()
    assert not rest and labels == ("acme", "bot", "2", reason)
    assert abs(n / 2000 - 0.10) <= 0.02, n
    # the same picks with the canary warm: exactly the diverted ones go to it
    assert picks(Picker(Ready({"1", "2"}), random.Random(0)), 2000)["2"] == n


def test_a_sticky_key_diverted_while_its_version_loads_comes_back_to_it() -> None:
    key = next(k for k in (f"user-{i}" for i in range(1000)) if bucket("acme", "bot", k) >= 0.9)
    ready = Ready({"1"})
    picker = Picker(ready)
    assert asyncio.run(picker.pick(ANSWER, key)).version == "1"
    ready.versions = {"1", "2"}
    assert asyncio.run(picker.pick(ANSWER, key)).version == "2"


def test_the_warmer_remembers_why_a_version_cannot_load_until_it_does() -> None:
    answers = iter(["AdapterRejected: files missing", "AdapterRejected: files missing", True])

    async def command(name: str, ref: LoRARef, path: str) -> bool | str:
        return True if ref.digest[0] == "a" else next(answers)

    async def run() -> list[tuple[set[str], str | None]]:
        warmer = Warmer(command)
        seen = []
        for _ in range(3):
            ready = await warmer.ready("acme", "bot", SPLIT)
            seen.append((ready, warmer.failed("acme", "bot", SPLIT[1])))
            await asyncio.sleep(0.06)
        return seen

    assert asyncio.run(run()) == [
        ({"1"}, "AdapterRejected: files missing"),
        ({"1"}, "AdapterRejected: files missing"),
        ({"1", "2"}, None),
    ]


def test_the_warmer_asks_the_engine_once_then_remembers_a_version_in_host_memory() -> None:
    calls: list[tuple[str, LoRARef, str]] = []
    answers = {"a": iter([False, True]), "b": iter([True])}  # v1 loads a while, v2 is there

    async def command(name: str, ref: LoRARef, path: str) -> bool:
        calls.append((name, ref, path))
        return next(answers[ref.digest[0]])

    async def run() -> list[set[str]]:
        warmer = Warmer(command)
        first = await warmer.ready("acme", "bot", SPLIT)
        again = await warmer.ready("acme", "bot", SPLIT)  # within RECHECK_S: not asked
        await asyncio.sleep(0.06)
        warm = await warmer.ready("acme", "bot", SPLIT)
        later = await warmer.ready("acme", "bot", SPLIT)
        return [first, again, warm, later]

    assert asyncio.run(run()) == [{"2"}, {"2"}, {"1", "2"}, {"1", "2"}]
    # each version asked about once, then only the one still loading, RECHECK_S later
    assert [(c[0], c[1].digest[0], c[2]) for c in calls] == [
        ("warm_stored", "a", "adapters/t/bot/v1"), ("warm_stored", "b", "adapters/t/bot/v2"),
        ("warm_stored", "a", "adapters/t/bot/v1"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "value",
    [None, "x", [1], [{"version": 1, "weight": 90}], [{"version": "1", "weight": 90,
     "digest": "a", "path": "p"}], [{"version": 1, "weight": -1, "digest": "a", "path": "p"}]],
)  # fmt: skip
def test_a_malformed_split_in_a_resolve_answer_is_no_split(value: Any) -> None:
    assert _split_of(value) == ()


def push_two_versions(cp: str, auth: dict[str, str], model: Path, tmp_path: Path) -> None:
    """Versions 1 and 2 of acme's `bot` (rank-4 PEFT adapters of seeds 1 and 2)."""
    from tests.factories import build_peft_adapter

    for seed in (1, 2):
        src = build_peft_adapter(model, tmp_path / f"v{seed}", seed=seed, r=4)
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        up = httpx.post(cp + "/v1/adapters", data={"name": "bot", "base_model": "tiny-base"},
                        files=files, headers=auth)  # fmt: skip
        assert up.status_code == 201, up.text


def versions_served(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "loraplane_adapter_version_requests":
            return {
                s.labels["version"]: s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels["adapter"] == "bot"
            }
    return {}


def test_a_canary_set_by_patch_is_in_host_memory_before_its_first_request(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with replica(
        tiny_llama_dir, tmp_path, {"acme": 1}, engine_process=False, resolve_ttl_s=0.2
    ) as r:
        key = r.keys["acme"]
        auth = {"Authorization": f"Bearer {key}"}
        push_two_versions(r.cp, auth, tiny_llama_dir, tmp_path)
        versions = httpx.get(r.cp + "/v1/adapters/bot/versions", headers=auth).json()
        digest = {str(v["version"]): v["digest"] for v in versions}
        assert httpx.patch(r.cp + "/v1/adapters/bot", json={"current_version": 1},
                           headers=auth).status_code == 200  # fmt: skip
        loras = r.runtime.engine.engine.loras  # type: ignore[union-attr]
        held: list[tuple[str, bool]] = []  # (digest, in host memory when its request came)
        hold = r.runtime._hold

        async def watched(resolved: Resolved, model: str) -> Any:
            if resolved.digest is not None:
                ref = LoRARef(resolved.adapter or "", resolved.tenant, resolved.digest)
                held.append((resolved.digest, loras.in_host_memory(ref)))
            return await hold(resolved, model)

        r.runtime._hold = watched  # type: ignore[method-assign]
        client = r.client("acme")

        def ask(n: int) -> None:
            for _ in range(n):
                client.completions.create(model="bot", prompt="hello", max_tokens=1)

        ask(3)
        assert {d for d, _ in held} == {digest["1"]}
        split = {"rollout": {"1": 50, "2": 50}}
        assert httpx.patch(r.cp + "/v1/adapters/bot", json=split, headers=auth).status_code == 200
        time.sleep(0.3)  # past the replica's resolve TTL: the next request learns the split
        ask(1)  # the split seen: the canary's load starts (until it ends, v1 takes its share)
        deadline = time.monotonic() + 60  # the loader threads are niced: slow on a busy machine
        while not any(ref.digest == digest["2"] for ref in loras.in_host):
            assert time.monotonic() < deadline, "the canary never reached host memory"
            time.sleep(0.05)
        ask(39)
        canary = [warm for d, warm in held if d == digest["2"]]
        assert canary, "no request ran on the canary"
        assert all(canary), "the canary met a request before it was in host memory"
        counted = versions_served(r.metrics_url)
        assert counted["1"] + counted["2"] == 43 and counted["2"] == len(canary)
        pinned = client.completions.create(model="bot@1", prompt="hello", max_tokens=1)
        assert pinned.choices
        assert versions_served(r.metrics_url)["1"] == counted["1"] + 1  # a pin is not split


def test_a_split_is_served_through_the_engine_process_and_counted_per_version(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The default layout (the engine in a process of its own): `warm_stored` crosses the
    process boundary, both versions serve, and the metrics port counts each."""
    with replica(tiny_llama_dir, tmp_path, {"acme": 1}, resolve_ttl_s=0.2) as r:
        auth = {"Authorization": f"Bearer {r.keys['acme']}"}
        push_two_versions(r.cp, auth, tiny_llama_dir, tmp_path)
        split = {"rollout": {"1": 50, "2": 50}}
        assert httpx.patch(r.cp + "/v1/adapters/bot", json=split, headers=auth).status_code == 200
        client = r.client("acme")
        # at least 30, and until both served: a version's share goes to the current one
        # until it is warm here, and a busy machine may take a while to load it
        sent, deadline = 0, time.monotonic() + 60
        while True:
            client.completions.create(model="bot", prompt="hello", max_tokens=1)
            sent += 1
            counted = versions_served(r.metrics_url)
            if sent >= 30 and counted.get("1", 0) > 0 and counted.get("2", 0) > 0:
                break
            assert time.monotonic() < deadline, f"a version never served: {counted}"
        assert counted.get("1", 0) + counted.get("2", 0) == sent


def test_a_5xx_answer_counts_as_an_error_of_the_version_the_request_ran_with() -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter

    from loraplane.dataplane.server.request_metrics import RequestCounter

    registry = CollectorRegistry()
    labels = ["tenant", "adapter", "version"]
    requests = PromCounter("r", "", ["tenant", "code"], registry=registry)
    versions = PromCounter("v", "", labels, registry=registry)
    errors = PromCounter("e", "", labels, registry=registry)

    def app_answering(status: int) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("state", {}).update(tenant="acme", adapter_version=("bot", "2"))
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return RequestCounter(app, requests, versions, errors)

    async def run() -> None:
        async def send(_: Any) -> None:
            return None

        for status in (200, 200, 503, 429):
            scope = {"type": "http", "path": "/v1/completions"}
            await app_answering(status)(scope, None, send)

    asyncio.run(run())
    got = {"tenant": "acme", "adapter": "bot", "version": "2"}
    assert registry.get_sample_value("v_total", got) == 4
    assert registry.get_sample_value("e_total", got) == 1  # the 503; a 429 is no server error


def version_series(metrics_url: str, family: str) -> dict[str, float]:
    """`family`'s samples for adapter bot, by version."""
    text = httpx.get(metrics_url + "/metrics", timeout=30).text
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {s.labels["version"]: s.value for s in f.samples
                    if s.name.endswith("_total") and s.labels["adapter"] == "bot"}  # fmt: skip
    return {}


def test_sticky_keys_over_http_and_a_stream_that_fails_mid_way_counts_as_its_version_s_error(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Through the replica's OpenAI API, against the real control plane, the engine in its
    own process: at 50/50 a request with `user` (or the X-LoRAplane-Rollout-Key header, which
    wins) gets the version its key's bucket says, every time; then a stream of version 1 whose
    engine is killed mid-way (its 200 long sent, its last event an error) is counted in
    loraplane_adapter_version_errors_total for version 1."""
    with replica(tiny_llama_dir, tmp_path, {"acme": 1}, resolve_ttl_s=0.2) as r:
        auth = {"Authorization": f"Bearer {r.keys['acme']}"}
        push_two_versions(r.cp, auth, tiny_llama_dir, tmp_path)
        split = {"rollout": {"1": 50, "2": 50}}
        assert httpx.patch(r.cp + "/v1/adapters/bot", json=split, headers=auth).status_code == 200
        client = r.client("acme")
        deadline = time.monotonic() + 60
        # until both are warm here (a cold version's share goes to the current one, v2)
        while min((counted := versions_served(r.metrics_url)).get(v, 0) for v in "12") == 0:
            assert time.monotonic() < deadline, f"a version never served: {counted}"
            client.completions.create(model="bot", prompt="hello", max_tokens=1)

        def served(**kw: Any) -> str:
            before = versions_served(r.metrics_url)
            client.completions.create(model="bot", prompt="hello", max_tokens=1, **kw)
            after = versions_served(r.metrics_url)
            (version,) = [v for v in after if after[v] != before.get(v, 0)]
            return version

        def expected(key: str) -> str:
            return "1" if bucket("acme", "bot", key) < 0.5 else "2"

        keys = [f"user-{i}" for i in range(8)]
        assert {expected(k) for k in keys} == {"1", "2"}  # both versions among them
        for key in keys:
            assert [served(user=key) for _ in range(3)] == [expected(key)] * 3, key
        header = next(k for k in keys if expected(k) != expected(keys[0]))
        by_header = served(user=keys[0], extra_headers={"X-LoRAplane-Rollout-Key": header})
        assert by_header == expected(header)

        assert version_series(r.metrics_url, "loraplane_adapter_version_errors") == {}
        pid = r.runtime.engine.pid  # type: ignore[union-attr]
        body = {"model": "bot@1", "prompt": "hello", "max_tokens": 240, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", r.url + "/v1/completions", json=body, headers=auth,
                          timeout=30) as s:  # fmt: skip
            assert s.status_code == 200, s.read()
            lines = s.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGKILL)  # as the OOM killer would
            rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line for line in rest), rest[-3:]
        errors = version_series(r.metrics_url, "loraplane_adapter_version_errors")
        assert errors == {"1": 1.0}


def test_a_canary_whose_files_are_gone_is_served_by_the_current_version_and_counted_failed(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A canary that cannot load on this replica never fails a request: its share runs on the
    current version, and the metrics port counts those requests as diverted, reason failed."""
    import shutil

    with replica(
        tiny_llama_dir, tmp_path, {"acme": 1}, engine_process=False, resolve_ttl_s=0.2
    ) as r:
        auth = {"Authorization": f"Bearer {r.keys['acme']}"}
        push_two_versions(r.cp, auth, tiny_llama_dir, tmp_path)
        versions = httpx.get(r.cp + "/v1/adapters/bot/versions", headers=auth).json()
        digest = {str(v["version"]): v["digest"] for v in versions}
        (gone,) = (tmp_path / "store").glob(f"adapters/*/bot/v2-{digest['2'][:12]}")
        shutil.rmtree(gone)
        for change in ({"current_version": 1}, {"rollout": {"1": 50, "2": 50}}):
            patched = httpx.patch(r.cp + "/v1/adapters/bot", json=change, headers=auth)
            assert patched.status_code == 200, patched.text
        client = r.client("acme")
        for _ in range(30):
            assert client.completions.create(model="bot", prompt="hi", max_tokens=1).choices
        served = versions_served(r.metrics_url)
        diverted = {
            (s.labels["version"], s.labels["reason"]): s.value
            for f in text_string_to_metric_families(httpx.get(r.metrics_url + "/metrics").text)
            if f.name == "loraplane_adapter_version_diverted"
            for s in f.samples
            if s.name.endswith("_total")
        }
    assert served == {"1": 30.0}
    assert set(diverted) <= {("2", "loading"), ("2", "failed")}
    assert diverted.get(("2", "failed"), 0) > 0, diverted
    assert sum(diverted.values()) >= 5  # about half of 30 meant for v2, all run on v1
