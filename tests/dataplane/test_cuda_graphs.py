"""Decode CUDA graphs (`cuda_graphs.py`), as far as a CPU can check them.

Capture is pluggable: here `replay_eagerly` "replays" by running the captured forward again on
the same static buffers and host objects, and the Triton kernels run in the interpreter
(`TRITON_INTERPRET=1`, set before Triton is imported). Whatever a CUDA graph would freeze at
capture (sizes, host numbers, launch grids, the slot tables' host fields) is frozen here too,
so these tests check the static buffers, the padding rows, the LoRA segments laid out for a
fixed launch, the slot tables kept current under adapter churn, and every fallback to eager,
against the eager engine on the torch paths (`_torch_eager`: the Triton kernels' own equality
to those paths is their tests', in fp32 to the same tolerance; the eager reference on the
interpreted kernels took as long as the graphs' run and checked less). What only a GPU shows
(a sync or an allocation inside the capture) is checked by `benchmarks/gpu_check.sh` (engine
step: graph replays).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from loraplane.dataplane import attention
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cuda_graphs import (
    Forward,
    batch_sizes,
    replay_eagerly,
)
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from tests.dataplane.conftest import Family

# fixtures: the Gemma models and their adapters, built once for this module
from tests.dataplane.test_models_gemma_parity import gemma_families  # noqa: F401
from tests.dataplane.triton_mode import INTERPRETED

pytest.importorskip("triton")


def test_the_ladder_of_batch_sizes_ends_at_the_largest_batch() -> None:
    assert batch_sizes(1) == (1,)
    assert batch_sizes(5) == (1, 2, 4, 5)
    assert batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_sizes(200) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200)
    with pytest.raises(ValueError, match="max_batch"):
        batch_sizes(0)


@pytest.fixture
def triton_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA defaults on CPU tensors: Triton attention and SGMV, in the interpreter."""
    if not INTERPRETED:
        pytest.skip("these tests run the tiny model on CPU through Triton's interpreter")
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton")


def _engine(model: Path, **overrides: object) -> Engine:
    config = dict(model=str(model), device="cpu", dtype="float32", block_size=4,
                  num_kv_blocks=96, max_num_seqs=8, enable_prefix_caching=False)  # fmt: skip
    config.update(overrides)
    return Engine(EngineConfig(**config))  # type: ignore[arg-type]


# prompts of several lengths, and how many tokens each request generates (the batch shrinks as
# they finish, so several graph sizes replay, most of them with padding rows)
PROMPTS = [[5, 9, 13], [7, 11, 2, 3, 19, 23, 29], [31, 37], [41, 43, 47, 53, 59], [61]]
MAX_TOKENS = [9, 5, 7, 3, 8]


def _generate(
    engine: Engine, adapters: dict[str, Path], names: Sequence[str | None]
) -> list[tuple[list[int], list[float]]]:
    refs: dict[str, LoRARef] = {}
    loras = []
    for name in names:
        if name is not None and name not in refs:
            refs[name] = engine.register_lora(name, adapters[name], "t")
        loras.append(None if name is None else refs[name])
    outs = []
    for i, (prompt, lora, n) in enumerate(zip(PROMPTS, loras, MAX_TOKENS, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True)
        engine.add_request(f"r{i}", prompt, params, lora)
    done: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.token_ids), list(out.logprobs or []))
    for i in range(len(PROMPTS)):
        outs.append(done[f"r{i}"])
    return outs


def _torch_eager(
    monkeypatch: pytest.MonkeyPatch,
    model: Path,
    adapters: dict[str, Path],
    names: Sequence[str | None],
    **overrides: object,
) -> list[tuple[list[int], list[float]]]:
    """What the replayed steps must give: the eager engine's tokens and log-probs on the torch
    attention and LoRA paths; the Triton paths are set again after."""
    monkeypatch.setenv(attention.ENV, "torch")
    monkeypatch.setenv(dispatch.ENV, "torch")
    try:
        return _generate(_engine(model, **overrides), adapters, names)
    finally:
        monkeypatch.setenv(attention.ENV, "triton")
        monkeypatch.setenv(dispatch.ENV, "triton")


def _same(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]):
    for (g_tokens, g_lp), (w_tokens, w_lp) in zip(got, want, strict=True):
        assert g_tokens == w_tokens
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


def test_replayed_decode_steps_generate_the_eager_engines_tokens_and_logprobs(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four adapters of ranks 8 to 64 (all modules, q/v only, MLP only) and the base model in
    one batch of 5 (graph 8: three padding rows), shrinking to 1 as requests finish."""
    names = ["r16", "r8-qv", None, "r32-mlp", "r64"]
    want = _torch_eager(monkeypatch, tiny_llama_dir, peft_adapters, names)
    engine = _engine(tiny_llama_dir)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4, 8)
    _same(_generate(engine, peft_adapters, names), want)
    # every decode step replayed (the last request decodes alone for its final tokens)
    assert graphs.replays >= max(MAX_TOKENS) - 1 and graphs.fallbacks == 0


def test_replayed_decode_steps_over_an_fp8_cache_holding_the_adapters_match_the_torch_path(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The FP8 KV cache (kv_quant.py) with the adapters inside its blocks (viewed as fp32), as
    the CUDA defaults would run it: the replayed steps (Triton attention over fp8) give the
    eager FP8 engine's output on the torch paths."""
    names = ["r16", None, None, "r16", None]
    fp8 = {"kv_cache_dtype": "fp8", "kv_lora_shared": True, "lora_memory": 1 << 20}
    monkeypatch.setenv(attention.ENV, "torch")
    monkeypatch.setenv(dispatch.ENV, "torch")
    want = _generate(_engine(tiny_llama_dir, **fp8), peft_adapters, names)
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    engine = _engine(tiny_llama_dir, **fp8)
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None
    _same(_generate(engine, peft_adapters, names), want)
    assert graphs.replays >= max(MAX_TOKENS) - 1 and graphs.fallbacks == 0


def test_replayed_gemma2_decode_steps_generate_the_eager_engines_tokens_and_logprobs(
    gemma_families: dict[str, Family],  # noqa: F811 - the imported fixture
    triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Soft-capped scores in the Triton kernel and windows of 6 that the decodes outgrow,
    replayed from the graphs with padding rows (Gemma 3 adds nothing the graphs freeze)."""
    family = gemma_families["gemma2"]
    names = ["r64", "r8-qv", None, "r32-mlp", "r16-rslora"]
    want = _torch_eager(monkeypatch, family.model_dir, family.adapters, names)
    engine = _engine(family.model_dir)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None
    _same(_generate(engine, family.adapters, names), want)
    assert graphs.replays >= max(MAX_TOKENS) - 1 and graphs.fallbacks == 0


def test_base_model_steps_replay_the_graphs_without_lora_launches(
    tiny_llama_dir: Path,
    triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names: list[str | None] = [None] * len(PROMPTS)
    want = _torch_eager(monkeypatch, tiny_llama_dir, {}, names)
    engine = _engine(tiny_llama_dir)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    _same(_generate(engine, {}, names), want)
    assert engine.runner.cuda_graphs is not None and engine.runner.cuda_graphs.replays > 0


def test_slot_tables_follow_adapters_moving_between_slots(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two device slots for three adapters: slots are emptied and refilled between replays
    (new tensors, new ranks), and each replay must read the slot's current adapter."""
    names = ["r16", "r64", "r8-qv", "r16", "r64"]
    want = _torch_eager(monkeypatch, tiny_llama_dir, peft_adapters, names, max_loras=2)
    engine = _engine(tiny_llama_dir, max_loras=2)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    got = _generate(engine, peft_adapters, names)
    _same(got, want)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.replays > 0
    assert max(engine.runner.pool.slot_generation) > 2  # some slot held several adapters


def test_a_slot_breaking_the_tables_alignment_promise_runs_eagerly(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    triton_paths: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks 4 and 12 (r4, r8-patterns) are not multiples of 8: steps using them run eagerly,
    the others still replay, and the tokens are the eager engine's."""
    names = ["r16", "r8-patterns", None, "r4", "r16"]
    want = _torch_eager(monkeypatch, tiny_llama_dir, peft_adapters, names)
    engine = _engine(tiny_llama_dir)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    _same(_generate(engine, peft_adapters, names), want)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.fallbacks > 0
    assert graphs.replays > 0  # once r8-patterns and r4 finish (after 5 and 3 tokens of 9)


def test_a_capture_error_leaves_the_engine_eager_and_says_so(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    triton_paths: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(forward: Forward) -> Forward:
        raise RuntimeError("operation not permitted when stream is capturing")

    names = ["r16", None, "r8-qv", "r16", None]
    want = _torch_eager(monkeypatch, tiny_llama_dir, peft_adapters, names)
    engine = _engine(tiny_llama_dir)
    with caplog.at_level(logging.WARNING, logger="loraplane.dataplane.cuda_graphs"):
        assert not engine.enable_cuda_graphs(capture=broken)
    assert "CUDA graph capture failed" in caplog.text and "not permitted" in caplog.text
    assert engine.runner.cuda_graphs is None
    assert engine.block_manager.num_reserved == 0  # the padding block went back
    assert all(slots.graph_table is None for slots in engine.runner.pool.modules.values())
    _same(_generate(engine, peft_adapters, names), want)


def test_cuda_graphs_on_a_cpu_engine_are_refused_with_a_reason(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--cuda-graphs` on CPU: a log line, eager steps; and the torch kernel paths cannot be
    captured either (they decide on the host what each step launches)."""
    with caplog.at_level(logging.WARNING, logger="loraplane.dataplane.cuda_graphs"):
        engine = _engine(tiny_llama_dir, cuda_graphs=True)
    assert engine.runner.cuda_graphs is None and engine.block_manager.num_reserved == 0
    assert "Triton attention and SGMV paths" in caplog.text
    if INTERPRETED:
        monkeypatch.setenv(attention.ENV, "triton")
        monkeypatch.setenv(dispatch.ENV, "triton")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="loraplane.dataplane.cuda_graphs"):
            assert not engine.enable_cuda_graphs()
        assert "need a CUDA device" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(engine.generate([[5, 9, 13]], params)[0].token_ids) == 3
