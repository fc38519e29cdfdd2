"""HTTP serving overhead on CPU: the engine benchmark's workload streamed through the server vs
run on the engine directly, in one run.

Workload (benchmarks/engine_cpu.py's model and helpers): Llama-shaped, hidden 1024, 8 layers,
fp32; 64 requests of 32 prompt tokens over 8 rank-16 adapters, greedy, `--gen-tokens` tokens
each (default 32, EOS ignored). The server runs as its own process (`python -m
loraplane.dataplane.server serve`); 64 concurrent streaming /v1/completions requests are sent
by a minimal client and their server-sent events counted as they arrive. The model's random
tokens mostly decode to no text (its vocabulary is padded past the tokenizer's), and the server
sends no chunk for a token without text, so requests ask for `logprobs: 0`: then every token
gets its chunk (for the inter-token latency) and the usage chunk counts the tokens.
Figures: tokens/s of each, their ratio (goal: HTTP at least 0.9 of the engine), and time to
first token and inter-token latency p50/p99 as the client sees them. The server runs its engine
in a process of its own (its default); `--engine-process off` runs it on a thread of the
server's process instead (the former default), for comparison.
The client runs on the same machine. The server's torch threads default to every core with its
engine in a process of its own (the engine's threads then share no interpreter with the event
loop: on 2 cores, 2 threads give ~1.07x of the engine, 1 thread ~0.67x, the thread count
capping it), and to cores - 1 with `--engine-process off`, so that the client and the event
loop keep a core (there, 2 threads ~0.94x, 1 thread ~0.66x).
Rounds (5, `--rounds`) alternate engine and HTTP runs; tokens/s and latencies are the best
round's (the machine may be shared), `http_over_engine` the median over rounds of each round's
HTTP over its engine run, printed with their spread (one run read 0.67, a neighbour's load
falling on one side: a ratio of bests moved with it).
Run: .venv/bin/python benchmarks/server_http.py [--gen-tokens N] [--rounds R]
(--smoke: engine_cpu.py's smoke model, 4 generated tokens, one round)
Another server (a container, say): `--workdir DIR --print-serve` builds the model and adapters
in DIR and prints the command and environment this script serves them with; start that server
(on 127.0.0.1), then `--workdir DIR --url http://127.0.0.1:PORT` measures it: HTTP rounds only,
no engine (its figures replace results/server_http.json; no goal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import add_smoke_flag, goal, median_of_rounds, report
from engine_cpu import NUM_SEQS, RANK, engine_tokens_per_s, make_engine, prompts, shape

from loraplane.demo.build import build_adapter, build_llama
from loraplane.readiness import NotReady, wait_ok

NUM_ADAPTERS = 8
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(
    model: Path, adapters: list[Path], port: int, threads: int | None, engine_process: str = "on"
) -> tuple[list[str], dict[str, str]]:
    """The `serve` arguments and the environment this benchmark serves with."""
    modules = [f"a{i}={path}" for i, path in enumerate(adapters)]
    env = {
        "LORAPLANE_NUM_KV_BLOCKS": str(NUM_SEQS * 16),
        "LORAPLANE_ENGINE_PROCESS": engine_process,
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    args = ["serve", "--model", str(model), "--port", str(port), "--max-loras", str(NUM_ADAPTERS),
            "--max-num-seqs", str(NUM_SEQS), "--lora-modules", *modules]  # fmt: skip
    return args, env


def start_server(
    model: Path, adapters: list[Path], port: int, threads: int | None, engine_process: str
) -> subprocess.Popen[bytes]:
    args, extra = serve_command(model, adapters, port, threads, engine_process)
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    cmd = [sys.executable, "-m", "loraplane.dataplane.server", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 300) -> None:
    try:
        wait_ok(url + "/ready", timeout, alive=proc, interval=0.2)
    except NotReady as e:
        if e.stopped:
            raise RuntimeError(f"server exited with {proc and proc.returncode}") from None
        raise TimeoutError("server not ready") from None


async def one_stream(port: int, body: dict[str, object]) -> tuple[int, float, list[float]]:
    """(tokens, time to first token, inter-token gaps) of one streaming request.

    A minimal HTTP/1.1 client on a raw connection: on a 2-core machine the client shares the
    CPU with the server, and httpx's line parsing would cost more than the server's work.
    """
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + payload)
    stamps: list[float] = []
    received = bytearray()
    while data := await reader.read(1 << 16):
        now = time.perf_counter()
        stamps.extend([now] * data.count(b'"choices": [{'))
        received += data
    writer.close()
    if not received.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(received[:300].decode(errors="replace"))
    usage = received.rsplit(b'"completion_tokens": ', 1)[1]
    tokens = int(usage[: usage.index(b",")])
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return tokens, stamps[0] - start, gaps


async def http_run(port: int, gen: int) -> tuple[float, list[float], list[float]]:
    """tokens/s, TTFTs and inter-token gaps of the 64 requests, all sent at once."""
    bodies = [
        {"model": f"a{i % NUM_ADAPTERS}", "prompt": p, "max_tokens": gen, "temperature": 0,
         "stream": True, "ignore_eos": True, "logprobs": 0,
         "stream_options": {"include_usage": True}}
        for i, p in enumerate(prompts(NUM_SEQS, 2))
    ]  # fmt: skip
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(port, b) for b in bodies))
    elapsed = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    return tokens / elapsed, [r[1] for r in results], [g for r in results for g in r[2]]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def build_models(root: Path, smoke: bool) -> tuple[Path, list[Path]]:
    """The benchmark model and its adapters in `root` (built unless there already)."""
    model, adapters = root / "model", [root / f"a{i}" for i in range(NUM_ADAPTERS)]
    marker = root / "built"
    if marker.is_file() and marker.read_text() == f"smoke={smoke}\n":
        return model, adapters
    print("building the benchmark model and 8 rank-16 adapters ...", flush=True)
    build_llama(model, **shape(smoke))
    for i, path in enumerate(adapters):
        build_adapter(model, path, r=RANK, lora_alpha=32, seed=i)
    marker.write_text(f"smoke={smoke}\n")
    return model, adapters


def measure_external(url: str, gen_tokens: int, rounds: int) -> dict[str, float]:
    """HTTP rounds against a server already running at `url`; their figures."""
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    wait_ready(url, None)
    asyncio.run(http_run(port, 4))  # warm up
    best: tuple[float, list[float], list[float]] | None = None
    for _ in range(rounds):
        result = asyncio.run(http_run(port, gen_tokens))
        print(f"  round: http {result[0]:.1f} tok/s", flush=True)
        if best is None or result[0] > best[0]:
            best = result
    if best is None:
        raise SystemExit("--rounds must be at least 1")
    tps, ttft, itl = best
    figures = {
        "tokens_per_s_http_streaming": tps,
        **_latencies(ttft, itl, gen_tokens, rounds),
    }
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--server-threads",
        type=int,
        help="torch threads of the server's engine (default: every core with --engine-process"
        " on, cores - 1 with off: a core left to the client and the event loop)",
    )
    parser.add_argument(
        "--engine-process",
        choices=["on", "off"],
        default="on",
        help="the server's engine in a process of its own (on, its default) or on a thread of"
        " its process (off)",
    )
    parser.add_argument("--workdir", type=Path,
                        help="build the model and adapters here (kept, reused) instead of a "
                        "temporary folder")  # fmt: skip
    parser.add_argument("--print-serve", action="store_true",
                        help="print how this script serves --workdir's model; exit")  # fmt: skip
    parser.add_argument("--url", help="measure the server already running at this "
                        "http://127.0.0.1:PORT (serving --workdir's model as --print-serve "
                        "says) instead of starting one: HTTP rounds only")  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.server_threads is None:
        cores = os.cpu_count() or 2
        args.server_threads = cores if args.engine_process == "on" else max(1, cores - 1)
    gen_tokens, rounds = (4, 1) if args.smoke else (args.gen_tokens, args.rounds)
    torch.manual_seed(0)
    if (args.url or args.print_serve) and args.workdir is None:
        parser.error("--url and --print-serve need --workdir (the model the server serves)")
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(dir=Path.cwd()))
        )
        model, adapters = build_models(root, args.smoke)
        if args.print_serve:
            serve, env = serve_command(
                model, adapters, 8000, args.server_threads, args.engine_process
            )
            print(" ".join(f"{k}={v}" for k, v in env.items()), "loraplane", *serve)
            return 0
        if args.url:
            figures = measure_external(args.url, gen_tokens, rounds)
        else:
            figures = engine_and_http(
                model, adapters, gen_tokens, rounds, args.server_threads, args.engine_process
            )
    # another server's run has no engine to compare with: figures only
    goals = [] if args.url else [goal(figures, "http_over_engine", ">=", 0.9)]
    return report("server_http", figures, goals, smoke=args.smoke)


def engine_and_http(
    model: Path,
    adapters: list[Path],
    gen_tokens: int,
    rounds: int,
    threads: int,
    engine_process: str = "on",
) -> dict[str, float]:
    """Interleaved rounds on the engine directly and through the server it starts."""
    engine, refs = make_engine(model, adapters, max_loras=NUM_ADAPTERS)
    mixed = [[refs[i % NUM_ADAPTERS] for i in range(NUM_SEQS)]]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model, adapters, port, threads, engine_process)
    direct: list[float] = []
    http: list[float] = []
    try:
        wait_ready(url, proc)
        engine_tokens_per_s(engine, mixed, 4)  # warm up both
        asyncio.run(http_run(port, 4))
        # interleaved rounds, best of each: other load on a shared machine hits both alike
        for _ in range(rounds):
            direct.append(engine_tokens_per_s(engine, mixed, gen_tokens))
            tps, ttft, itl = asyncio.run(http_run(port, gen_tokens))
            if not http or tps > max(http):
                best_ttft, best_itl = ttft, itl
            http.append(tps)
            print(f"  round: engine {direct[-1]:.1f} tok/s, http {tps:.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    ttft, itl = best_ttft, best_itl
    figures = {
        "tokens_per_s_engine": max(direct),
        "tokens_per_s_http_streaming": max(http),
        **_latencies(ttft, itl, gen_tokens, rounds),
    }
    # each round's HTTP run over the engine run beside it: the median of those, with spread
    ratios = [h / d for h, d in zip(http, direct, strict=True)]
    median_of_rounds(figures, "http_over_engine", ratios)
    return figures


def _latencies(
    ttft: list[float], itl: list[float], gen_tokens: int, rounds: int
) -> dict[str, float]:
    """The best round's latency figures (ms) and the run's size, as every mode reports them."""
    return {
        "ttft_ms_p50": pct(ttft, 50) * 1e3,
        "ttft_ms_p99": pct(ttft, 99) * 1e3,
        "itl_ms_p50": pct(itl, 50) * 1e3,
        "itl_ms_p99": pct(itl, 99) * 1e3,
        "gen_tokens": float(gen_tokens),
        "rounds": float(rounds),
    }


if __name__ == "__main__":
    sys.exit(main())
