"""What an inference gateway's scrape costs: the gateway-metrics port's `/metrics` with many
adapters.

The llm-d endpoint picker scrapes every replica's gateway-metrics port every 50 ms, and each
reading of the engine's state runs on the engine thread, between steps. With 2,000 registered
adapters and 256 requests in flight (base model and eight adapters, some running, the rest
waiting), this times the gateway's reading (`EngineSnapshot.gateway`) plus its rendering
(`render_gateway`), and, for comparison, the metrics port's full reading and rendering
(Prometheus, every 15-30 s).
Goal (issue 14): the gateway's scrape <= 5 ms.
Run: .venv/bin/python benchmarks/metrics_render.py [--adapters 2000] [--requests 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import add_smoke_flag, goal, report

from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.metrics import ServerMetrics
from loraplane.dataplane.snapshot import EngineSnapshot
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.demo.build import build_adapter, build_llama


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.adapters, args.requests, args.repeats = 50, 16, 5
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_llama(root / "model", hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128)  # fmt: skip
        config = EngineConfig(model=str(model), device="cpu", dtype="float32",
                              max_num_seqs=args.requests // 2, num_kv_blocks=4096)  # fmt: skip
        engine = Engine(config, disk=DiskTier(LocalStore(root / "store")))
        for i in range(args.adapters):  # registered, as catalog mode registers what it served
            ref = LoRARef(f"tenant{i % 100}-adapter{i}", f"tenant{i % 100}", f"{i:064x}")
            engine.loras.register_stored(ref, f"adapters/t/a{i}/v1-{i:012x}")
        live = [engine.register_lora(f"a{i}", build_adapter(model, root / f"a{i}", r=8,
                                     lora_alpha=16, seed=i)) for i in range(8)]  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for i in range(args.requests):
            lora = None if i % 3 == 0 else live[i % len(live)]
            engine.add_request(f"r{i}", [5 + i % 50, 9, 13], params, lora)
        for _ in range(3):  # half the requests run (their adapters resident), half wait
            engine.step()
        metrics = ServerMetrics()

        def gateway() -> bytes:
            metrics.gateway_snapshot = EngineSnapshot.gateway(engine)
            return metrics.render_gateway()

        def full() -> bytes:
            metrics.snapshot = EngineSnapshot.of(engine)
            return metrics.render()

        gateway()  # warm up
        full()
        figures = {
            "registered_adapters": float(len(engine.loras.registered)),
            "requests_in_flight": float(
                len(engine.scheduler.running) + len(engine.scheduler.waiting)
            ),
            "gateway_scrape_ms": median_ms(gateway, args.repeats),
            "gateway_snapshot_ms": median_ms(lambda: EngineSnapshot.gateway(engine), args.repeats),
            "full_scrape_ms": median_ms(full, max(5, args.repeats // 10)),
            "gateway_bytes": float(len(gateway())),
        }
    return report("metrics_render", figures, [goal(figures, "gateway_scrape_ms", "<=", 5.0)],
                  smoke=args.smoke)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
