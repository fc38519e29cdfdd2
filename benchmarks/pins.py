"""Pinned adapters under a flood: a pinned adapter's time to first token stays as it was.

One replica (a small CPU model: engine_cpu.py's vocabulary, 4 layers of 256) serves a closed
loop of background requests, `--in-flight` at a time, while two probe adapters are asked in
turn, one request in flight at a time, every PROBE_PERIOD steps: P, pinned
(`LoRAManager.pin`), and Q, not pinned (the control). Two loads, the same engine settings
(adapter memory for 24 adapters, a host tier of 32):
- unflooded: the background spread over 16 adapters, all of which stay resident;
- flood: the background drawn by Zipf(1.0) over `--adapters` stored adapters (2,000), so
  adapters are evicted from the device and host memory all the time.
The loads alternate over `--rounds` rounds (each figure: the median round).
Figures: each probe's TTFT p99 in each load and its flood / unflooded ratio (goal for P:
<= 1.2; Q's is the control, with no goal), the probes that found their adapter off the
device (goal for P in the flood: 0), and the flood's device evictions.
Run: .venv/bin/python benchmarks/pins.py [--adapters 2000] [--requests 160] [--rounds 3]
(--smoke: 24 adapters, 32 requests, one round on the smoke model)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

from _common import add_smoke_flag, goal, report
from engine_cpu import SHAPE, SMOKE_SHAPE
from tiers import qv_adapter

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.demo.build import build_llama

# a small model: what is measured is adapter residency, not compute, and the flood's 2,000
# adapters are ingested in well under a minute on two cores
SMALL_SHAPE = {**SHAPE, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 688}  # fmt: skip
PROBE_PERIOD = 8  # engine steps between two requests of one probe


def p99(xs: list[float]) -> float:
    """The 99th percentile of `xs` (its largest value under 100 samples)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def run_load(engine: Engine, background: list[LoRARef], weights: list[float],
             probes: dict[str, LoRARef], requests: int, in_flight: int,
             seed: int) -> dict[str, tuple[list[float], int]]:  # fmt: skip
    """Closed loop of `requests` background requests (4 to 12 tokens each, so that they do
    not end in waves); each probe asked every PROBE_PERIOD steps, the probes half a period
    apart (never in one step) and one request each at a time. Per probe label: the TTFTs,
    and how many of its requests found its adapter off the device."""
    rng = random.Random(seed)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(4, 13)]
    probe_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    arrived: dict[str, float] = {}
    label_of: dict[str, str] = {}
    ttft: dict[str, list[float]] = {label: [] for label in probes}
    cold = dict.fromkeys(probes, 0)
    answered: set[str] = set()
    sent = done = failed = 0
    phase = {label: i * PROBE_PERIOD // len(probes) for i, label in enumerate(probes)}
    idle = set(probes)  # probes with no request in flight

    def prompt() -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(16)]

    def send() -> None:
        nonlocal sent
        rid = f"b{sent}"
        arrived[rid] = time.perf_counter()
        params = rng.choice(lengths)
        engine.add_request(rid, prompt(), params, rng.choices(background, weights)[0])
        sent += 1

    def ask(label: str, n: int) -> None:
        rid = f"{label}{n}"
        label_of[rid] = label
        idle.discard(label)
        cold[label] += probes[label] not in engine.loras.resident
        arrived[rid] = time.perf_counter()
        engine.add_request(rid, prompt(), probe_params, probes[label])

    for _ in range(in_flight):
        send()
    asked = steps = 0
    while done < requests:
        steps += 1
        for label in sorted(idle):
            if steps % PROBE_PERIOD == phase[label]:
                asked += 1
                ask(label, asked)
        for out in engine.step():
            failed += bool(out.error)
            label = label_of.get(out.request_id)
            if label is not None:
                if out.token_ids and out.request_id not in answered:
                    answered.add(out.request_id)
                    ttft[label].append(time.perf_counter() - arrived[out.request_id])
                if out.finished:
                    idle.add(label)
                continue
            if out.finished:
                done += 1
                if sent < requests:
                    send()
    while not idle >= set(probes):  # the probes in flight end
        for out in engine.step():
            label = label_of.get(out.request_id)
            if label is not None and out.finished:
                idle.add(label)
    if failed:
        raise RuntimeError(f"{failed} requests failed")
    return {label: (ttft[label], cold[label]) for label in probes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    add_smoke_flag(parser)
    args = parser.parse_args()
    adapters, requests, rounds = args.adapters, args.requests, args.rounds
    if args.smoke:
        adapters, requests, rounds = 24, 32, 1
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        print("building the benchmark model ...", flush=True)
        model = root / "model"
        build_llama(model, **(SMOKE_SHAPE if args.smoke else SMALL_SHAPE))
        spec = BaseModelSpec.from_dir(model)
        store = LocalStore(root / "store")
        print(f"ingesting {adapters} adapters and the two probes ...", flush=True)

        def stored(i: int, tenant: str, name: str) -> AdapterVersion:
            src = qv_adapter(spec, root / "src" / str(i), seed=20_000 + i)
            version = ingest(src, tenant, name, spec, AdapterLimits(), store)
            for f in src.iterdir():
                f.unlink()
            return version

        versions = [stored(i, "flood", f"a{i}") for i in range(adapters)]
        probe_versions = {"pinned": stored(-1, "quiet", "p"), "unpinned": stored(-2, "quiet", "q")}

        def engine(memory: int) -> tuple[Engine, list[LoRARef], dict[str, LoRARef]]:
            gc.collect()
            config = EngineConfig(model=str(model), device="cpu", dtype="float32",
                                  max_num_seqs=32, num_kv_blocks=32 * 8,
                                  enable_prefix_caching=False, lora_memory=memory,
                                  max_cpu_loras=32)  # fmt: skip
            e = Engine(config, disk=DiskTier(store))
            refs = [e.loras.register_stored(LoRARef(v.name, v.tenant, v.digest), v.path)
                    for v in versions]  # fmt: skip
            probes = {k: e.loras.register_stored(LoRARef(v.name, v.tenant, v.digest), v.path)
                      for k, v in probe_versions.items()}  # fmt: skip
            return e, refs, probes

        # the adapter memory: 24 adapters of this size (pins may take half of it)
        sizer, _, probes = engine(1 << 30)
        sizer.loras.pin(probes["pinned"])
        sizer.loras.wait_for([probes["pinned"]], timeout=60)
        size = sizer.loras.device_bytes(probes["pinned"])
        sizer.close()
        memory = 24 * size
        zipf = [1.0 / (k + 1) for k in range(adapters)]
        runs: dict[str, dict[str, list[float]]] = {}
        evictions: list[float] = []
        print("warm-up load ...", flush=True)  # the first load of a process runs slow
        e, refs, probes = engine(memory)
        run_load(e, refs[:16], [1.0] * 16, probes, min(32, requests), args.in_flight, seed=0)
        e.close()
        for round_no in range(1, rounds + 1):
            for load in ("unflooded", "flood"):
                print(f"load: {load} (round {round_no}) ...", flush=True)
                e, refs, probes = engine(memory)
                e.loras.pin(probes["pinned"])
                e.loras.wait_for([probes["pinned"]], timeout=60)
                # the engine's first steps run slow (allocations): a short load first
                run_load(e, refs[:16], [1.0] * 16, probes, 16, args.in_flight, seed=100)
                start = time.perf_counter()
                evicted = e.loras.device_stats.evictions
                background, weights = (refs[:16], [1.0] * 16) if load == "unflooded" else (
                    refs, zipf)  # fmt: skip
                ttft = run_load(e, background, weights, probes, requests, args.in_flight,
                                seed=round_no)  # fmt: skip
                for label, (xs, cold) in ttft.items():
                    run = runs.setdefault(f"{label}_{load}", {})
                    run.setdefault("p99", []).append(p99(xs))
                    run.setdefault("n", []).append(float(len(xs)))
                    run.setdefault("cold", []).append(float(cold))
                print(f"  {time.perf_counter() - start:.1f} s", flush=True)
                if load == "flood":
                    evictions.append(float(e.loras.device_stats.evictions - evicted))
                e.close()
        for key, values in runs.items():
            figures[f"{key}_ttft_p99_s"] = statistics.median(values["p99"])
            figures[f"{key}_probes"] = min(values["n"])
            figures[f"{key}_cold_probes"] = max(values["cold"])
        for label in ("pinned", "unpinned"):
            figures[f"{label}_flood_over_unflooded"] = (
                figures[f"{label}_flood_ttft_p99_s"] / figures[f"{label}_unflooded_ttft_p99_s"]
            )
        figures["flood_device_evictions"] = statistics.median(evictions)
    goals = [
        goal(figures, "pinned_flood_over_unflooded", "<=", 1.2),
        goal(figures, "pinned_flood_cold_probes", "<=", 0),
    ]
    return report("pins", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
