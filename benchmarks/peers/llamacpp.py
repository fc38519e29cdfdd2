"""loraplane's server side by side with llama.cpp's own `llama-server` on this CPU.

A peer benchmark, not part of `make bench` or CI: it needs a llama.cpp tree built here and
takes minutes. One way (about 7 min on 2 cores): `pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36`, unpack it, and in its `vendor/llama.cpp`: `cmake -S . -B BUILD
-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON` then
`cmake --build BUILD --target llama-server -j2`. The converters need `sentencepiece`: install it
into a folder of its own (`pip install --target DIR sentencepiece`) and set
`LLAMACPP_PYTHONPATH=DIR`.

Workload: one SmolLM-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536,
vocabulary 49152; seeded random weights, built here, fp32) and 8 rank-16 PEFT adapters on every
attention and MLP projection, converted to GGUF f32 with the tree's own `convert_hf_to_gguf.py`
and `convert_lora_to_gguf.py`. Both servers get the same token-id prompts (32 tokens), greedy,
EOS ignored, `--gen-tokens` tokens each, streamed; each scenario is (adapters, clients): every
client sends one request, client i asks for adapter i mod adapters, all at once.

- llama-server: `-t T -tb T -np CLIENTS -c CLIENTS*CTX -kvu --cont-batching --lora A,B,...
  --lora-init-without-apply`; a request picks its adapter with `"lora": [{"id": k, "scale": 1}]`
  (the others at scale 0). llama.cpp does not batch requests whose LoRA configurations differ.
- loraplane: `loraplane serve` with its defaults (`--max-num-seqs CLIENTS`, `--max-loras 8`).
Rounds alternate the two servers (both stay up, idle while the other runs); the median of each
is kept. Figures: tokens/s of each, their ratio, and the worst time to first token of each.
Goals (issue 30): one adapter, 8 clients: loraplane >= 0.8x llama.cpp's tokens/s; 8 adapters at
8 and 32 clients: >= 2x, worst time to first token at most a third of llama.cpp's.

The model's tokenizer is a small byte-level BPE (built here); its pre-tokenizer hash is unknown to
the GGUF converter, which is told it is GPT-2's (the prompts are token ids: no text is tokenized).

Run: .venv/bin/python benchmarks/peers/llamacpp.py --llama-cpp PATH/TO/llama.cpp
     [--workdir DIR] [--rounds 5] [--gen-tokens 64] [--scenarios 1x8,8x8,8x32] [--threads 2]
Writes results/peers_llamacpp.json (figures, goals, machine) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import goal, machine  # noqa: E402

from loraplane.demo.build import build_adapter, build_llama  # noqa: E402

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
             max_position_embeddings=2048)  # fmt: skip
NUM_ADAPTERS = 8
RANK = 16
PROMPT_LEN = 32
RESULTS = REPO / "benchmarks" / "results"

# run the converter with its BPE pre-tokenizer check answered: our tokenizer is not in its table
CONVERT_SHIM = """
import sys
sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import runpy
sys.argv = sys.argv[1:]  # the converter's own argv: its path, then its arguments
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(root: Path, tree: Path) -> tuple[Path, list[Path], Path, list[Path]]:
    """The HF model and adapters, and their GGUF conversions (kept in `root`, reused)."""
    model, adapters = root / "model", [root / f"a{i}" for i in range(NUM_ADAPTERS)]
    gguf, lora_ggufs = root / "model.gguf", [root / f"a{i}.gguf" for i in range(NUM_ADAPTERS)]
    if not (root / "built").is_file():
        print("building the model and 8 rank-16 adapters ...", flush=True)
        build_llama(model, seed=0, **SHAPE)
        for i, path in enumerate(adapters):
            build_adapter(model, path, r=RANK, lora_alpha=32, seed=i)
        (root / "built").write_text("ok\n")
    env = {**os.environ, "PYTHONPATH": os.environ.get("LLAMACPP_PYTHONPATH", "")}

    def convert(script: str, *args: str) -> None:
        cmd = [sys.executable, "-c", CONVERT_SHIM, str(tree), str(tree / "gguf-py"),
               str(tree / script), *args]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")

    if not gguf.is_file():
        print("converting the model to GGUF f32 ...", flush=True)
        convert("convert_hf_to_gguf.py", str(model), "--outtype", "f32", "--outfile", str(gguf))
    for path, out in zip(adapters, lora_ggufs, strict=True):
        if not out.is_file():
            print(f"converting {path.name} to GGUF f32 ...", flush=True)
            convert("convert_lora_to_gguf.py", "--base", str(model), "--outtype", "f32",
                    "--outfile", str(out), str(path))  # fmt: skip
    return model, adapters, gguf, lora_ggufs


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    ready_path: str

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}{self.ready_path}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_llamacpp(
    tree: Path, gguf: Path, loras: list[Path], clients: int, threads: int, ctx: int, log: Path
) -> Server:
    port = free_port()
    binary = tree / "BUILD" / "bin" / "llama-server"
    cmd = [str(binary), "-m", str(gguf), "--lora", ",".join(map(str, loras)),
           "--lora-init-without-apply", "-t", str(threads), "-tb", str(threads),
           "-np", str(clients), "-c", str(clients * ctx), "-kvu", "--cont-batching",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Server("llama-server", proc, port, "/health")


def start_loraplane(model: Path, adapters: list[Path], clients: int, log: Path) -> Server:
    port = free_port()
    modules = [f"a{i}={p}" for i, p in enumerate(adapters)]
    cmd = [sys.executable, "-m", "loraplane.dataplane.server", "serve", "--model", str(model),
           "--port", str(port), "--max-loras", str(NUM_ADAPTERS), "--max-num-seqs",
           str(clients), "--lora-modules", *modules]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = log.open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Server("loraplane", proc, port, "/ready")


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(PROMPT_LEN)] for _ in range(n)]


def llamacpp_body(prompt: list[int], adapter: int, gen: int) -> tuple[str, dict[str, Any]]:
    lora = [{"id": k, "scale": 1.0 if k == adapter else 0.0} for k in range(NUM_ADAPTERS)]
    body = {"prompt": prompt, "n_predict": gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False, "lora": lora}  # fmt: skip
    return "/completion", body


def loraplane_body(prompt: list[int], adapter: int, gen: int) -> tuple[str, dict[str, Any]]:
    # logprobs: 0 so every token gets a chunk (the random model's tokens often decode to no text)
    body = {"model": f"a{adapter}", "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "stream": True, "ignore_eos": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return "/v1/completions", body


def _tokens_of(event: dict[str, Any]) -> int | None:
    """Tokens a server-sent event reports in total (its last event), else None."""
    if "tokens_predicted" in event and event.get("stop"):  # llama-server's last event
        return int(event["tokens_predicted"])
    usage = event.get("usage")
    if usage:
        return int(usage["completion_tokens"])
    return None


def _is_token(event: dict[str, Any]) -> bool:
    if "choices" in event:
        return bool(event["choices"])
    return event.get("stop") is False


async def one(
    client: httpx.AsyncClient, port: int, path: str, body: dict[str, Any]
) -> tuple[int, float]:
    """(tokens, time to first token) of one streamed request."""
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"http://127.0.0.1:{port}{path}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter() - start
            if first is None and _is_token(event):
                first = now
            total = _tokens_of(event)
            if total is not None:
                tokens = total
            sampled = _first_sampled(event, now)
            if sampled is not None:
                first = sampled if first is None else min(first, sampled)
    if first is None:
        raise RuntimeError(f"{path}: no token came back")
    return tokens, first


def _first_sampled(event: dict[str, Any], now: float) -> float | None:
    """When llama-server sampled its first token, from its last event's own timings.

    llama-server holds a token back while the text so far ends in an incomplete UTF-8
    sequence, and the random model's byte tokens often leave it so for the rest of the
    request: its first streamed token can then be its last. Its `timings.predicted_ms` is the
    time from its first sampled token to the end, so the first token came at most that long
    before this event (an upper bound on its TTFT that is off by one token's time at most).
    """
    timings = event.get("timings") if event.get("stop") else None
    if not timings or "predicted_ms" not in timings:
        return None
    return max(0.0, now - float(timings["predicted_ms"]) / 1000)


async def run_round(
    server: Server, adapters: int, clients: int, gen: int, seed: int
) -> tuple[float, float]:
    """(tokens/s, worst time to first token) of `clients` requests sent at once."""
    make = llamacpp_body if server.name == "llama-server" else loraplane_body
    bodies = [make(p, i % adapters, gen) for i, p in enumerate(prompts(clients, seed))]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, server.port, p, b) for p, b in bodies))
        elapsed = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    if tokens < clients * gen:
        raise RuntimeError(f"{server.name}: {tokens} tokens, expected {clients * gen}")
    return tokens / elapsed, max(r[1] for r in results)


def scenario(
    tree: Path,
    built: tuple[Path, list[Path], Path, list[Path]],
    adapters: int,
    clients: int,
    args: argparse.Namespace,
    logs: Path,
) -> dict[str, float]:
    model, hf_adapters, gguf, loras = built
    ctx = PROMPT_LEN + args.gen_tokens + 16
    tag = f"{adapters}x{clients}"
    servers = [
        start_llamacpp(tree, gguf, loras, clients, args.threads, ctx, logs / f"llama-{tag}.log"),
        start_loraplane(model, hf_adapters, clients, logs / f"loraplane-{tag}.log"),
    ]
    figures: dict[str, list[float]] = {}
    try:
        for server in servers:
            server.wait()
            asyncio.run(run_round(server, adapters, clients, 4, seed=99))  # warm up
        for r in range(args.rounds):
            for server in servers if r % 2 == 0 else servers[::-1]:
                tps, ttft = asyncio.run(run_round(server, adapters, clients, args.gen_tokens, r))
                figures.setdefault(f"{server.name}_tps", []).append(tps)
                figures.setdefault(f"{server.name}_ttft", []).append(ttft)
                print(f"  {tag} round {r}: {server.name:12s} {tps:7.1f} tok/s, "
                      f"worst TTFT {ttft:.2f} s", flush=True)  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    med = {k: statistics.median(v) for k, v in figures.items()}
    return {
        f"{tag}_llamacpp_tokens_per_s": med["llama-server_tps"],
        f"{tag}_loraplane_tokens_per_s": med["loraplane_tps"],
        f"{tag}_loraplane_over_llamacpp": med["loraplane_tps"] / med["llama-server_tps"],
        f"{tag}_llamacpp_worst_ttft_s": med["llama-server_ttft"],
        f"{tag}_loraplane_worst_ttft_s": med["loraplane_ttft"],
        f"{tag}_ttft_loraplane_over_llamacpp": med["loraplane_ttft"] / med["llama-server_ttft"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument(
        "--llama-cpp", type=Path, required=True,
        help="the llama.cpp source tree, built (BUILD/bin/llama-server)",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="build and convert here (kept, reused)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t / -tb")
    parser.add_argument(
        "--scenarios", default="1x8,8x8,8x32",
        help="ADAPTERSxCLIENTS, comma-separated (default: %(default)s)",
    )  # fmt: skip
    args = parser.parse_args()
    tree = args.llama_cpp.resolve()
    if not (tree / "BUILD" / "bin" / "llama-server").is_file():
        parser.error(f"{tree}/BUILD/bin/llama-server is missing: build it (../shared/TESTING.md)")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="peers-llamacpp-"))
    root.mkdir(parents=True, exist_ok=True)
    built = build(root, tree)
    figures: dict[str, float] = {}
    for spec in args.scenarios.split(","):
        adapters, clients = (int(x) for x in spec.split("x"))
        figures |= scenario(tree, built, adapters, clients, args, root)
    goals = []
    if "1x8_loraplane_over_llamacpp" in figures:
        goals.append(goal(figures, "1x8_loraplane_over_llamacpp", ">=", 0.8))
    for tag in ("8x8", "8x32"):
        if f"{tag}_loraplane_over_llamacpp" in figures:
            goals.append(goal(figures, f"{tag}_loraplane_over_llamacpp", ">=", 2.0))
            goals.append(goal(figures, f"{tag}_ttft_loraplane_over_llamacpp", "<=", 1 / 3))
    RESULTS.mkdir(exist_ok=True)
    body = {"figures": figures, "goals": goals, "machine": machine(),
            "settings": {"rounds": args.rounds, "gen_tokens": args.gen_tokens,
                         "threads": args.threads}}  # fmt: skip
    (RESULTS / "peers_llamacpp.json").write_text(json.dumps(body, indent=2) + "\n")
    for name, value in figures.items():
        print(f"{name:40s} {value:10.3f}")
    for g in goals:
        print(f"goal {g['figure']} {g['op']} {g['target']:.3f}: {'met' if g['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
