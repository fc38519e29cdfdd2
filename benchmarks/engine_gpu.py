"""The engine end to end on a GPU: an 8B-shaped Llama in bf16 loaded from a sharded checkpoint,
64 rank-16 adapters, decode steps against the HBM roofline, CUDA graphs on and off, and
transformers + PEFT on the same model and adapters, in one run (issue 16, point 5).

Model: a seeded random Llama with Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads over 8
KV heads, MLP 14336, vocab 128256), written by this script as a bf16 safetensors checkpoint in
~2 GiB shards with model.safetensors.index.json (weights drawn on the GPU, std 0.02); 64 PEFT
adapters, rank 16 (alpha 32) on q, k, v, o, gate, up and down, bf16 (std 0.05, as
demo/build.py's). Workload: 64 sequences of 128 random prompt tokens, greedy.
Figures:
- load_s: building the engine from the checkpoint (just written, so read from the page
  cache). load_peak_host_anon_gib / load_peak_host_rss_gib: this process's peak anonymous /
  resident host memory meanwhile, above what it held before (/proc/self/status every 5 ms);
  load_peak_host_over_checkpoint = the anonymous peak / checkpoint bytes (goal <= 0.25: the
  loader streams tensors to the device and the host never holds the model; resident memory
  also counts the page-cache pages of the shard being read, which are not the process's).
- decode_step_ms_{0,8,64}_adapters: median time of engine.step() in a decode step of the 64
  sequences (after their prefill): without adapters, over 8 (sequence i uses adapter i % 8),
  and with one adapter each; decode_tokens_per_s_* = 64 / that time.
- roofline_ms_*: the bytes such a step must read from HBM divided by --hbm-tbps (4.8, the
  H200's): every weight but the embedding table (a step gathers 64 of its rows), the A and B
  of each distinct adapter of the step, and each sequence's KV cache (2 x layers x KV heads x
  head dim x 2 bytes per token of context, at the timed steps' mean context); activations and
  logits are left out. decode_step_over_roofline_* = step time / roofline (goal at 8
  adapters: <= 1.5).
- lora_cost_over_traffic_bound = (step with 8 adapters - step without) / (the 8 adapters'
  bytes / HBM bandwidth): the time 8 adapters add to a step over the least their reads take
  (goal <= 1.1); lora_cost_over_traffic_bound_64: the same for 64 adapters.
- engine_tokens_per_s / hf_peft_tokens_per_s: the 64 prompts over 8 adapters, 32 greedy
  tokens each, prefill included, on the engine and on transformers' LlamaForCausalLM with a
  PeftModel holding the 8 adapters (a mixed batch: generate(adapter_names=...));
  engine_over_hf_peft_tokens_per_s = their ratio (goal >= 5).
- the engine's tokens against HF + PEFT's: greedy_match_fraction (sequences whose tokens are
  all the same), first_token_match_fraction, and, as bf16 near-ties can flip a greedy pick
  without anything being wrong, greedy_within_tol_fraction: the share of the engine's tokens
  that HF + PEFT, fed the engine's own sequences, scores within --logit-tol (0.5) of its best
  logit (goal >= 0.95; a wrong adapter or kernel puts tokens logits below the best);
  max_logit_gap: the largest such distance.
- CUDA graphs: a second engine with cuda_graphs=True; decode_step_ms_8_adapters_graphs,
  graphs_over_eager_8_adapters (its step time / the eager one), graph_replays,
  graph_fallbacks, graph_batch_sizes (how many sizes were captured; all 0 when none were)
  read from the runner's graphs (goal: graph_replays >= 1, so a capture that failed and left
  the engine eager shows), graphs_greedy_match_fraction (sequences whose tokens equal the
  eager engine's: in bf16 on random weights near-ties flip picks, 0.016 on the first H200 run,
  so it is no verdict) and graphs_greedy_within_tol_fraction / graphs_max_logit_gap (the
  graphs' tokens judged by HF + PEFT as the eager ones are; goal >= 0.95).
- also: checkpoint_gib, checkpoint_shards, build_s (writing the model and the adapters),
  host_anon_before_load_gib, register_adapters_s, the roofline's parts (weight_bytes_read_gib,
  adapter_mib, kv_bytes_read_gib), load_s_graphs, hf_peft_load_s.
- the decode matrix (_decode_matrix.py, whose docstring defines each figure): on the eager
  engine and again on the one with graphs, decode steps of 64 and 256 rows over 8 and 64
  adapters, greedy and temperature 0.8 / top-p 0.9: decode_step_ms_<case>, device_ms_<case>,
  host_ms_<case>, host_fraction_<case>, roofline_ms_<case> (logits included) and
  decode_over_roofline_<case>, <case> = <rows>r_<adapters>a_<greedy|sampled>_<eager|graphs>;
  graph_replays_matrix. Goals (the issue's, at 256 rows and 64 adapters with graphs):
  decode_over_roofline <= 1.5, host_fraction <= 0.10. Both engines hold 256 rows
  (max_num_seqs), so the graphs are captured up to 256.
- FP8 weights (issue 31): the same checkpoint loaded with `--quantization fp8` (the W8A16
  kernel on a GPU with FP8), graphs off: decode_step_ms_8_adapters_fp8,
  fp8_over_bf16_decode_8_adapters (over the bf16 engine's eager step; goal <= 0.65, the bytes
  roofline's 0.5 plus the KV cache and adapters it does not halve), load_s_fp8 and
  fp8_first_token_match_fraction (against bf16's tokens: FP8 moves logits, no verdict).
- DoRA (issue 33), on the eager engine after its matrix: `few` DoRA adapters and as many plain
  ones of the same rank, new to the engine (magnitudes near the base rows' norms, so g is
  near 1). first_load_ms_plain / first_load_ms_dora: the median `register_lora` of each
  (read, validate, hash, host form; a DoRA adapter's g computed from the base weights on the
  device, nothing cached; the slot fill on the first step that uses it is the same copy for
  both, plus g's bytes), dora_over_plain_first_load (goal <= 2); decode_step_ms_8_adapters_dora
  and _plain_new: decode steps over them (the better of two runs each), and
  dora_over_plain_decode_8_adapters (goal <= 1.15).
- failed_phases: phases that raised (engine, dora, graphs, hf+peft; each prints its traceback, and
  the ones after a failed engine phase are skipped) or were interrupted: the figures measured
  so far are still written, and the exit status is 1 (124 after a SIGTERM, which gpu_check.sh's
  time limit sends).
Needs only torch, transformers, peft, safetensors, numpy and the source tree (the lent GPU
has no package registry). Estimated at about 3 minutes on an H200 (not measured yet;
gpu_check.sh gives it 200 s), most of it writing the 16 GB checkpoint and loading it four
times (eager engine, engine with graphs, HF, FP8: in that order, so that a time limit cuts
the last), then the decode matrix's 256-row prefills and the graphs' capture up to 256 rows;
progress lines carry the elapsed time.
Run: python benchmarks/engine_gpu.py [--hbm-tbps 4.8] [--workdir DIR] (exits 0 with a message
when there is no CUDA device)
(--smoke: the same path on a hidden-64, 2-layer, vocab-512 model in several shards, 4 rank-8
adapters (graphs replay ranks that are multiples of 8), 4 sequences (the "8 adapters" case
over 2) of 8 prompt tokens, 2 timed steps and 2 tokens, the decode matrix at 1 and 2 rows over
1 and 2 adapters; without CUDA it runs on CPU in fp32,
where the engine's greedy tokens must equal HF + PEFT's exactly, and runs the graph phase with
Triton's interpreter and an emulated capture: that checks the script's graph path, not graphs)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from _common import add_smoke_flag, gpu_goal, report
from _decode_matrix import MATRIX_GOALS, Matrix, matrix_phase
from _gpu_model import (
    HostMemoryPeak,
    adapter_bytes,
    checkpoint_layout,
    host_memory,
    trim_host_heap,
    write_adapter,
    write_llama,
)
from engine_cpu import decode_step_seconds

from loraplane.dataplane.config import Device, Dtype, EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef

SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 8192, "rope_theta": 500000.0,
         "rms_norm_eps": 1e-5}  # fmt: skip
SMOKE_SHAPE = {**SHAPE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
               "max_position_embeddings": 512}  # fmt: skip
BLOCK_SIZE = 16  # EngineConfig's default
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sizes:
    """One run's sizes: the benchmark's, or --smoke's."""

    shape: dict[str, Any]
    adapters: int  # registered; the "64 adapters" case gives each sequence its own
    few: int  # the mixed case's adapters ("8 adapters"), the ones HF + PEFT loads
    rank: int
    batch: int  # sequences per decode step and per generate
    prompt_len: int
    steps: int  # timed decode steps per case
    gen_tokens: int
    shard_bytes: int  # checkpoint shards of about this size
    matrix: Matrix  # the decode matrix's cases (_decode_matrix.py)

    @property
    def max_rows(self) -> int:
        """The most sequences one step holds (the engines' max_num_seqs)."""
        return max(self.batch, *self.matrix.rows)


FULL = Sizes(SHAPE, adapters=64, few=8, rank=16, batch=64, prompt_len=128, steps=8,
             gen_tokens=32, shard_bytes=2 << 30,
             matrix=Matrix(rows=(64, 256), adapters=(8, 64), steps=6, prompt_len=128))  # fmt: skip
SMOKE = Sizes(SMOKE_SHAPE, adapters=4, few=2, rank=8, batch=4, prompt_len=8, steps=2,
              gen_tokens=2, shard_bytes=64 << 10,
              matrix=Matrix(rows=(1, 2), adapters=(1, 2), steps=2, prompt_len=8))  # fmt: skip


class Clock:
    """Elapsed time since the start, in front of each progress line."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)


# -- the engine ----------------------------------------------------------------------------


def prompts(sizes: Sizes, vocab: int, seed: int = 0, count: int | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    count = sizes.batch if count is None else count
    return [[rng.randrange(3, vocab) for _ in range(sizes.prompt_len)] for _ in range(count)]


def make_engine(
    model: Path, sizes: Sizes, device: Device, dtype: Dtype, graphs: bool,
    quantization: str | None = None,
) -> Engine:  # fmt: skip
    # every sequence's longest run (decode_step_seconds, generate, or a decode matrix case
    # behind its prefill steps), a spare block each, and one the CUDA graphs keep for their
    # padding rows
    prefill_steps = -(-sizes.max_rows * sizes.prompt_len // 4096) + 1  # max_num_batched_tokens
    longest = max(sizes.steps + 4, sizes.gen_tokens, sizes.matrix.steps + prefill_steps + 2)
    per_seq = -(-(sizes.prompt_len + longest) // BLOCK_SIZE) + 1
    config = EngineConfig(model=str(model), device=device, dtype=dtype, max_loras=sizes.adapters,
                          max_num_seqs=sizes.max_rows, block_size=BLOCK_SIZE,
                          num_kv_blocks=sizes.max_rows * per_seq + 1,
                          enable_prefix_caching=False, cuda_graphs=graphs,
                          quantization=quantization)  # fmt: skip
    # as `loraplane serve` runs it: its engine process leaves the text to the server's process
    return Engine(config, detokenize=False)


def free_engine(engine: Engine) -> None:
    """Stop an engine's loader threads and drop its graphs, so that once the caller lets go of
    it its device memory returns (see release)."""
    graphs = getattr(engine.runner, "cuda_graphs", None)
    close = getattr(graphs, "close", None)
    if callable(close):
        close()
    engine.loras.close()


def release(device: torch.device) -> None:
    """Give the memory of dropped models back (before the next one is built)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_generate(
    engine: Engine, prompt_ids: Sequence[list[int]], loras: Sequence[LoRARef | None], gen: int
) -> tuple[float, list[list[int]]]:
    """(tokens/s, each request's tokens) generating `gen` greedy tokens for every prompt."""
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    device = engine.runner.device
    synchronize(device)
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params, loras)
    synchronize(device)
    elapsed = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs]


def engine_phase(
    figures: dict[str, float], model: Path, adapters: list[Path], sizes: Sizes,
    prompt_ids: list[list[int]], checkpoint: int, device: Device, dtype: Dtype, clock: Clock,
    hbm_tbps: float, fresh: dict[str, list[Path]], failed: list[str],
) -> list[list[int]]:  # fmt: skip
    """Load (timed, host memory watched), register, decode steps per case, generate, the
    decode matrix, then `dora_phase` on the adapters of `fresh` (its failure in `failed`,
    the others' figures kept); each figure goes into `figures` as it is measured. Returns
    each sequence's tokens over the `few` adapters."""
    clock.log("engine: loading the checkpoint (graphs off)")
    trim_host_heap()
    figures["host_anon_before_load_gib"] = host_memory()[0] / 2**30
    with HostMemoryPeak() as peak:
        start = time.perf_counter()
        engine = make_engine(model, sizes, device, dtype, graphs=False)
        figures["load_s"] = time.perf_counter() - start
    figures["load_peak_host_anon_gib"] = peak.anon / 2**30
    figures["load_peak_host_rss_gib"] = peak.rss / 2**30
    figures["load_peak_host_over_checkpoint"] = peak.anon / checkpoint
    clock.log(f"engine: registering {len(adapters)} adapters")
    start = time.perf_counter()
    refs = [engine.register_lora(f"a{i}", path, "bench") for i, path in enumerate(adapters)]
    figures["register_adapters_s"] = time.perf_counter() - start
    cases: dict[str, list[LoRARef | None]] = {
        "0": [None] * sizes.batch,
        "8": [refs[i % sizes.few] for i in range(sizes.batch)],
        "64": [refs[i % len(refs)] for i in range(sizes.batch)],
    }
    clock.log("engine: warm-up (kernels compiled, every adapter into its slot)")
    engine_generate(engine, prompt_ids, cases["64"], 2)
    for name, loras in cases.items():
        clock.log(f"engine: decode steps with {name} adapters")
        step = decode_step_seconds(engine, loras, sizes.steps, prompt_ids)
        figures[f"decode_step_ms_{name}_adapters"] = step * 1e3
        figures[f"decode_tokens_per_s_{name}_adapters"] = sizes.batch / step
    clock.log(f"engine: generate {sizes.gen_tokens} tokens over {sizes.few} adapters")
    tps, tokens = engine_generate(engine, prompt_ids, cases["8"], sizes.gen_tokens)
    figures["engine_tokens_per_s"] = tps
    run_matrix(figures, engine, refs, sizes, False, hbm_tbps, clock)
    guarded("dora", lambda: dora_phase(
        figures, engine, fresh["plain"], fresh["dora"], sizes, prompt_ids, clock,
    ), failed, clock)  # fmt: skip
    free_engine(engine)
    return tokens


def run_matrix(
    figures: dict[str, float], engine: Engine, refs: list[LoRARef], sizes: Sizes, graphs: bool,
    hbm_tbps: float, clock: Clock,
) -> None:  # fmt: skip
    """The decode matrix (_decode_matrix.py) on `engine`."""
    config = json.loads((Path(engine.config.model) / "config.json").read_text())
    item = torch.empty(0, dtype=engine.runner.dtype).element_size()
    vocab = config["vocab_size"]
    matrix_phase(figures, engine, refs, sizes.matrix,
                 lambda rows: prompts(sizes, vocab, seed=5, count=rows), config, sizes.rank,
                 item, hbm_tbps, graphs, clock.log)  # fmt: skip


def roofline_figures(
    figures: dict[str, float], config: dict[str, Any], sizes: Sizes, item: int, hbm_tbps: float
) -> dict[str, float]:
    """The HBM roofline of each decode case and the measured steps against it (docstring)."""
    layout = checkpoint_layout(config)
    weights = sum(math.prod(d) for n, d in layout if n != "model.embed_tokens.weight") * item
    one = adapter_bytes(config, sizes.rank, item)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * item
    context = sizes.prompt_len + 1 + (sizes.steps - 1) / 2  # mean over the timed steps
    kv = per_token * context * sizes.batch
    bandwidth = hbm_tbps * 1e12
    out = {"weight_bytes_read_gib": weights / 2**30, "adapter_mib": one / 2**20,
           "kv_bytes_read_gib": kv / 2**30}  # fmt: skip
    distinct = {"0": 0, "8": sizes.few, "64": min(sizes.adapters, sizes.batch)}
    for name, count in distinct.items():
        roofline = (weights + count * one + kv) / bandwidth
        out[f"roofline_ms_{name}_adapters"] = roofline * 1e3
        step = figures[f"decode_step_ms_{name}_adapters"] / 1e3
        out[f"decode_step_over_roofline_{name}_adapters"] = step / roofline
    base = figures["decode_step_ms_0_adapters"] / 1e3
    for name, suffix in (("8", ""), ("64", "_64")):
        added = figures[f"decode_step_ms_{name}_adapters"] / 1e3 - base
        out[f"lora_cost_over_traffic_bound{suffix}"] = added / (distinct[name] * one / bandwidth)
    return out


def fp8_phase(
    figures: dict[str, float], model: Path, adapters: list[Path], sizes: Sizes,
    prompt_ids: list[list[int]], tokens: list[list[int]], device: Device, dtype: Dtype,
    clock: Clock,
) -> None:  # fmt: skip
    """The same checkpoint with its projections quantized to FP8 at load (`--quantization
    fp8`: on a GPU with FP8 the W8A16 kernel, kernels/w8a16_triton.py), graphs off like the
    engine phase: its decode step over 8 adapters against the bf16 one (issue 31's goal:
    <= 0.65x at 64 rows; the bytes roofline says about 0.5x), and how many sequences' first
    tokens equal the bf16 engine's (FP8 weights move logits: no verdict)."""
    clock.log("fp8: loading the checkpoint quantized at load")
    start = time.perf_counter()
    engine = make_engine(model, sizes, device, dtype, graphs=False, quantization="fp8")
    figures["load_s_fp8"] = time.perf_counter() - start
    refs = [engine.register_lora(f"a{i}", path, "bench") for i, path in enumerate(adapters)]
    loras = [refs[i % sizes.few] for i in range(sizes.batch)]
    engine_generate(engine, prompt_ids, loras, 2)  # warm-up: kernels compiled, slots filled
    clock.log("fp8: decode steps with 8 adapters")
    step = decode_step_seconds(engine, loras, sizes.steps, prompt_ids)
    figures["decode_step_ms_8_adapters_fp8"] = step * 1e3
    figures["fp8_over_bf16_decode_8_adapters"] = step * 1e3 / figures["decode_step_ms_8_adapters"]
    _, fp8_tokens = engine_generate(engine, prompt_ids, loras, 1)
    same = sum(a[:1] == b[:1] for a, b in zip(fp8_tokens, tokens, strict=True))
    figures["fp8_first_token_match_fraction"] = same / len(tokens)
    free_engine(engine)


def dora_phase(
    figures: dict[str, float], engine: Engine, plain: list[Path], dora: list[Path],
    sizes: Sizes, prompt_ids: list[list[int]], clock: Clock,
) -> None:  # fmt: skip
    """DoRA on the device (issue 33), on the eager engine: `plain` and `dora` are adapters of
    the same rank this engine has never seen. First-ever loads, in turn one of each:
    `register_lora` reads, validates and hashes the folder and makes the pool's host form,
    where a DoRA adapter's g = m / ||W + s B A||_row is computed from the base weights on the
    device (lora/dora_cache.py; nothing cached, the digests are new); each kind's median.
    Then decode steps over the `few` DoRA adapters against the `few` plain ones (the Triton
    kernels' DoRA epilogue against the plain store), the better of two runs each."""
    device = engine.runner.device
    loads: dict[str, list[float]] = {"plain": [], "dora": []}
    refs: dict[str, list[LoRARef]] = {"plain": [], "dora": []}
    clock.log(f"dora: first-ever loads of {len(dora)} DoRA and {len(plain)} plain adapters")
    for i, pair in enumerate(zip(plain, dora, strict=True)):
        for kind, path in zip(("plain", "dora"), pair, strict=True):
            synchronize(device)
            start = time.perf_counter()
            refs[kind].append(engine.register_lora(f"{kind}-new{i}", path, "bench"))
            synchronize(device)
            loads[kind].append(time.perf_counter() - start)
    for kind, times in loads.items():
        figures[f"first_load_ms_{kind}"] = statistics.median(times) * 1e3
    figures["dora_over_plain_first_load"] = (
        figures["first_load_ms_dora"] / figures["first_load_ms_plain"]
    )
    loras = {k: [r[i % len(r)] for i in range(sizes.batch)] for k, r in refs.items()}
    for kind in loras:  # warm-up: the DoRA kernels compiled, every adapter in its slot
        engine_generate(engine, prompt_ids, loras[kind], 2)
    clock.log(f"dora: decode steps over {len(dora)} DoRA adapters against {len(plain)} plain")
    steps: dict[str, float] = {}
    for kind in ("plain", "dora") * 2:
        step = decode_step_seconds(engine, loras[kind], sizes.steps, prompt_ids)
        steps[kind] = min(steps.get(kind, math.inf), step)
    figures["decode_step_ms_8_adapters_dora"] = steps["dora"] * 1e3
    figures["decode_step_ms_8_adapters_plain_new"] = steps["plain"] * 1e3
    figures["dora_over_plain_decode_8_adapters"] = steps["dora"] / steps["plain"]


def graphs_phase(
    figures: dict[str, float], model: Path, adapters: list[Path], sizes: Sizes,
    prompt_ids: list[list[int]], eager_tokens: list[list[int]], dtype: Dtype, clock: Clock,
    hbm_tbps: float,
) -> list[list[int]]:  # fmt: skip
    """The mixed case again on an engine with cuda_graphs=True; what its graphs did. Returns
    each sequence's tokens (HF + PEFT scores them as it scores the eager engine's).

    Without CUDA (the --smoke run on CPU) the same phase runs with the Triton kernels in the
    interpreter and `replay_eagerly` for capture (as tests/dataplane/test_cuda_graphs.py does):
    it checks this script's graph path, not the speed of graphs."""
    cuda = torch.cuda.is_available()
    clock.log(f"graphs: loading the checkpoint ({'cuda_graphs=True' if cuda else 'CPU emulation'})")
    start = time.perf_counter()
    if cuda:
        engine = make_engine(model, sizes, "cuda", dtype, graphs=True)
    else:
        from loraplane.dataplane.cuda_graphs import replay_eagerly

        engine = make_engine(model, sizes, "cpu", dtype, graphs=False)
        engine.enable_cuda_graphs(capture=replay_eagerly)
    figures["load_s_graphs"] = time.perf_counter() - start
    refs = [engine.register_lora(f"a{i}", p, "bench") for i, p in enumerate(adapters)]
    mixed: list[LoRARef | None] = [refs[i % sizes.few] for i in range(sizes.batch)]
    engine_generate(engine, prompt_ids, mixed, 2)  # warm-up
    clock.log(f"graphs: decode steps with {len(refs)} adapters")
    step = decode_step_seconds(engine, mixed, sizes.steps, prompt_ids)
    figures["decode_step_ms_8_adapters_graphs"] = step * 1e3
    eager_ms = figures["decode_step_ms_8_adapters"]
    figures["graphs_over_eager_8_adapters"] = step * 1e3 / eager_ms
    _, tokens = engine_generate(engine, prompt_ids, mixed, sizes.gen_tokens)
    same = sum(a == b for a, b in zip(tokens, eager_tokens, strict=True))
    figures["graphs_greedy_match_fraction"] = same / len(tokens)
    # read defensively: the graphs' attributes may change (0 when there are none)
    graphs = getattr(engine.runner, "cuda_graphs", None)
    replays = getattr(graphs, "replays", 0)
    fallbacks = getattr(graphs, "fallbacks", 0)
    captured = getattr(graphs, "batch_sizes", None) or ()
    print(f"  graphs: {type(graphs).__name__}, replays {replays}, fallbacks {fallbacks}, "
          f"batch sizes {list(captured)}", flush=True)  # fmt: skip
    figures["graph_replays"] = float(replays) if isinstance(replays, int) else 0.0
    figures["graph_fallbacks"] = float(fallbacks) if isinstance(fallbacks, int) else 0.0
    figures["graph_batch_sizes"] = float(len(captured))
    run_matrix(figures, engine, refs, sizes, True, hbm_tbps, clock)
    free_engine(engine)
    return tokens


# -- transformers + PEFT -------------------------------------------------------------------


def hf_peft_phase(
    figures: dict[str, float], model: Path, adapters: list[Path], sizes: Sizes,
    prompt_ids: list[list[int]], ours: list[list[int]], graphs: list[list[int]] | None,
    device: Device, dtype: torch.dtype, logit_tol: float, clock: Clock,
) -> None:  # fmt: skip
    """The mixed case on LlamaForCausalLM + PeftModel: tokens/s, and the engine's tokens (the
    eager engine's, and the graphs' when they ran) against its greedy ones and its logits."""
    import peft
    import transformers

    clock.log(f"hf+peft: loading the checkpoint and {len(adapters)} adapters")
    start = time.perf_counter()
    base = transformers.LlamaForCausalLM.from_pretrained(model, dtype=dtype, device_map=device)
    lora = peft.PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        lora.load_adapter(path, adapter_name=f"a{i}")
    lora.eval()
    figures["hf_peft_load_s"] = time.perf_counter() - start
    names = [f"a{i % len(adapters)}" for i in range(sizes.batch)]
    ids = torch.tensor(prompt_ids, device=device)
    gen = sizes.gen_tokens
    clock.log(f"hf+peft: generate {gen} tokens over {len(adapters)} adapters")
    with torch.inference_mode():
        synchronize(ids.device)
        start = time.perf_counter()
        out = lora.generate(input_ids=ids, attention_mask=torch.ones_like(ids),  # type: ignore[no-untyped-call]
                            adapter_names=names, max_new_tokens=gen, do_sample=False,
                            pad_token_id=0)  # fmt: skip
        synchronize(ids.device)
        elapsed = time.perf_counter() - start
        theirs = out[:, ids.shape[1] :].tolist()

        def gaps(tokens: list[list[int]]) -> torch.Tensor:
            """The engine's own sequences, teacher-forced: how far below HF's best logit each
            of its tokens is, [batch, gen]."""
            fed = torch.tensor([p + t[:-1] for p, t in zip(prompt_ids, tokens, strict=True)],
                               device=device)  # fmt: skip
            logits = lora(input_ids=fed, adapter_names=names, logits_to_keep=gen).logits.float()
            picked = torch.tensor(tokens, device=device).unsqueeze(-1)  # [batch, gen, 1]
            return logits.max(-1).values - logits.gather(-1, picked).squeeze(-1)

        gap = gaps(ours)
        if graphs is not None:  # bf16 near-ties flip greedy picks: judged as the eager ones
            graph_gap = gaps(graphs)
            figures["graphs_greedy_within_tol_fraction"] = float(
                (graph_gap <= logit_tol).float().mean()
            )
            figures["graphs_max_logit_gap"] = float(graph_gap.max())
    figures["hf_peft_tokens_per_s"] = sum(len(t) for t in theirs) / elapsed
    figures["engine_over_hf_peft_tokens_per_s"] = (
        figures["engine_tokens_per_s"] / figures["hf_peft_tokens_per_s"]
    )
    pairs = list(zip(ours, theirs, strict=True))
    figures["greedy_match_fraction"] = sum(a == b for a, b in pairs) / len(pairs)
    figures["first_token_match_fraction"] = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    figures["greedy_within_tol_fraction"] = float((gap <= logit_tol).float().mean())
    figures["max_logit_gap"] = float(gap.max())


class Interrupted(BaseException):
    """SIGTERM, as gpu_check.sh's time limit sends: stop, and report what was measured."""


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted


def guarded(name: str, run: Callable[[], T], failed: list[str], clock: Clock) -> T | None:
    """run(), or None with its traceback printed and `name` added to `failed`."""
    try:
        return run()
    except Exception:
        traceback.print_exc()
        clock.log(f"{name}: FAILED (traceback above)")
        failed.append(name)
        return None


def run_phases(
    args: argparse.Namespace, sizes: Sizes, figures: dict[str, float], failed: list[str],
    clock: Clock,
) -> None:  # fmt: skip
    """Every phase in turn, each figure into `figures` as it is measured."""
    cuda = torch.cuda.is_available()
    device: Device = "cuda" if cuda else "cpu"
    dtype_name: Dtype = "bfloat16" if cuda else "float32"
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="engine_gpu-", dir=args.workdir) as tmp:
        root = Path(tmp)
        model = root / "model"
        clock.log(f"writing the model ({sizes.shape['num_hidden_layers']} layers, {dtype_name})")
        config, checkpoint, shards = write_llama(model, sizes.shape, sizes.shard_bytes, dtype, dev)
        figures["checkpoint_gib"] = checkpoint / 2**30
        figures["checkpoint_shards"] = shards
        clock.log(f"writing {sizes.adapters} rank-{sizes.rank} adapters")
        adapters = [root / f"a{i}" for i in range(sizes.adapters)]
        for i, path in enumerate(adapters):
            write_adapter(path, config, sizes.rank, seed=1000 + i, dtype=dtype, device=dev)
        # dora_phase's: never registered before it loads them, DoRA and plain alike
        fresh = {kind: [root / f"{kind}-new{i}" for i in range(sizes.few)]
                 for kind in ("plain", "dora")}  # fmt: skip
        for seed, (kind, paths) in enumerate(fresh.items(), start=2):
            for i, path in enumerate(paths):
                write_adapter(path, config, sizes.rank, seed=seed * 1000 + i, dtype=dtype,
                              device=dev, dora=kind == "dora")  # fmt: skip
        figures["build_s"] = time.perf_counter() - clock.start
        release(dev)
        prompt_ids = prompts(sizes, config["vocab_size"])
        tokens = guarded("engine", lambda: engine_phase(
            figures, model, adapters, sizes, prompt_ids, checkpoint, device, dtype_name, clock,
            args.hbm_tbps, fresh, failed,
        ), failed, clock)  # fmt: skip
        release(dev)
        if tokens is None:
            clock.log("graphs, hf+peft: skipped (they compare with the engine's run)")
            return
        figures.update(roofline_figures(figures, config, sizes, dtype.itemsize, args.hbm_tbps))
        few = adapters[: sizes.few]
        with _graph_kernels(cuda):
            graph_tokens = guarded("graphs", lambda: graphs_phase(
                figures, model, adapters, sizes, prompt_ids, tokens, dtype_name, clock,
                args.hbm_tbps,
            ), failed, clock)  # fmt: skip
        release(dev)
        guarded("hf+peft", lambda: hf_peft_phase(
            figures, model, few, sizes, prompt_ids, tokens, graph_tokens, device, dtype,
            args.logit_tol, clock,
        ), failed, clock)  # fmt: skip
        release(dev)
        # last: issue 31's figure, after the graphs' decode matrix (issue 30's goals) and HF +
        # PEFT's verdict, should the step's time limit cut the run short
        guarded("fp8", lambda: fp8_phase(
            figures, model, adapters, sizes, prompt_ids, tokens, device, dtype_name, clock,
        ), failed, clock)  # fmt: skip
        release(dev)


@contextlib.contextmanager
def _graph_kernels(cuda: bool) -> Iterator[None]:
    """On CPU, the graph phase's kernels: Triton's, in the interpreter (main sets
    TRITON_INTERPRET before anything can import Triton)."""
    if cuda:
        yield
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the CPU graph phase needs TRITON_INTERPRET=1 (set by main)")
    saved = {k: os.environ.get(k) for k in _CPU_GRAPH_ENV}
    os.environ.update(_CPU_GRAPH_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_CPU_GRAPH_ENV = {"LORAPLANE_ATTENTION": "triton", "LORAPLANE_SGMV": "triton"}

GOALS = (("load_peak_host_over_checkpoint", "<=", 0.25),
         ("decode_step_over_roofline_8_adapters", "<=", 1.5),
         ("lora_cost_over_traffic_bound", "<=", 1.1),
         ("engine_over_hf_peft_tokens_per_s", ">=", 5.0),
         ("greedy_within_tol_fraction", ">=", 0.95),
         ("graphs_greedy_within_tol_fraction", ">=", 0.95),
         ("graph_replays", ">=", 1), ("fp8_over_bf16_decode_8_adapters", "<=", 0.65),
         ("dora_over_plain_decode_8_adapters", "<=", 1.15),
         ("dora_over_plain_first_load", "<=", 2.0),
         *MATRIX_GOALS)  # fmt: skip
CORRECTNESS_GOALS = ("greedy_within_tol_fraction", "graphs_greedy_within_tol_fraction")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM TB/s (H200: 4.8)")
    parser.add_argument("--logit-tol", type=float, default=0.5,
                        help="greedy_within_tol_fraction's distance to the best logit")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the checkpoint and adapters go (~22 GB; default: the system"
                        " temp folder)")  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("engine_gpu: no CUDA device: skipped")
        return 0
    if not cuda:
        print("engine_gpu: no CUDA device: CPU smoke run, figures mean nothing", flush=True)
        # the graph phase runs Triton's interpreter on CPU: chosen before Triton first loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    clock = Clock()
    figures: dict[str, float] = {}
    failed: list[str] = []
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_phases(args, SMOKE if args.smoke else FULL, figures, failed, clock)
    except Interrupted:
        clock.log("interrupted (SIGTERM: a time limit?): reporting what was measured")
        failed.append("interrupted")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    figures["failed_phases"] = float(len(failed))
    clock.log("done")
    # on the CPU path (a smoke run without CUDA) only the tokens' agreement with HF + PEFT is a
    # goal it can meet; the rest are about a GPU's speed and memory, reported as skipped
    goals = [gpu_goal(figures, name, op, target, cuda or name in CORRECTNESS_GOALS)
             for name, op, target in GOALS if name in figures]  # fmt: skip
    status = report("engine_gpu", figures, goals, smoke=args.smoke)
    if failed:
        print(f"engine_gpu: did not finish: {', '.join(failed)}")
        return 124 if "interrupted" in failed else 1
    if args.smoke and not cuda and figures["greedy_match_fraction"] != 1.0:
        # fp32 on CPU: the engine must pick exactly HF + PEFT's tokens
        print("engine_gpu: the engine's greedy tokens differ from HF + PEFT's in fp32 on CPU")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
