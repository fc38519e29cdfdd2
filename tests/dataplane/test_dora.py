"""DoRA adapters served in mixed batches (issue 33), against HF + PEFT.

A DoRA adapter (its magnitude vectors given values far from PEFT's initial norms), a plain
LoRA adapter and the base model share every step; greedy tokens and their log-probabilities
must be PEFT's, on the torch path and the native CPU kernel for Llama, Qwen2 (q/k/v biases:
PEFT leaves the bias out of DoRA's scaling), Qwen3, Mistral, Phi-3 (fused qkv and gate/up),
Gemma 2 and 3, Mixtral and Qwen3-MoE (DoRA on their attention; PEFT has no DoRA for packed
experts, and loraplane refuses it there), and for Qwen2 on the Triton kernels (through
Triton's interpreter; DoRA's rescale in their epilogue) with decode graphs replaying DoRA
rows (tests/dataplane/test_dora_kernels.py has the kernels and graphs against the torch path).
The slot's per-row scales count in its bytes; what cannot be served is refused by name: a
quantized base and tensor parallelism.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane import attention
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cuda_graphs import replay_eagerly
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.kernels import dispatch, sgmv_cpu
from loraplane.dataplane.lora import LoRAPool, dora, install_lora, load_lora
from loraplane.dataplane.lora.dora import refusal
from loraplane.dataplane.models import load_model
from loraplane.dataplane.models.quant_w4 import W4Linear
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import _perturb
from tests.dataplane.test_engine import prompts

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
ATOL = 1e-4  # the parity tests' tolerance (fp32, CPU)
# the mixed batch: DoRA, plain LoRA and base rows, DoRA twice (two segments' worth of rows)
NAMES: list[str | None] = ["dora", "plain", None, "dora", "plain"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def peft_logits(reference: Any, tokens: list[int], adapter: str | None) -> torch.Tensor:
    """HF + PEFT's fp32 logits [len(tokens), vocab] under `adapter` (None: the base model),
    chosen with set_adapter: PEFT refuses per-row `adapter_names` once DoRA is loaded."""
    with torch.no_grad():
        if adapter is None:
            with reference.disable_adapter():
                out = reference(torch.tensor([tokens]))
        else:
            reference.set_adapter(adapter)
            out = reference(torch.tensor([tokens]))
    logits: torch.Tensor = out.logits[0]
    return logits.float()


def spread_magnitudes(adapter: Path, seed: int) -> None:
    """Scale each magnitude vector by factors in [0.5, 1.5]: PEFT initialises m to the
    norm itself (g = 1 at every row), which would let a missing rescale pass unnoticed."""
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("lora_magnitude_vector"):
            tensors[name] = t * (0.5 + torch.rand(t.shape, generator=gen))
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """kind -> (model dir, {"dora": folder, "plain": folder}, HF + PEFT reference), built on
    first use."""
    import peft
    import transformers

    from tests.factories import build_model, build_peft_adapter

    root = tmp_path_factory.mktemp("dora")
    cache: dict[str, tuple[Path, dict[str, Path], torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, dict[str, Path], torch.nn.Module]:
        if kind not in cache:
            if kind == "gemma2":  # soft caps, sliding and full layers (no build_model kind)
                from tests.dataplane.test_models_gemma_parity import _build_model

                model_dir = _build_model(root / kind, kind, seed=0)
            else:
                model_dir = build_model(root / kind, kind)
            _perturb(model_dir, seed=7)  # biases and norms away from 0 and 1
            # PEFT's DoRA cannot wrap Qwen3-MoE's packed expert parameters (ParamWrapper):
            # its adapters there adapt the attention, as loraplane serves DoRA on them
            targets = {"target_modules": ATTENTION} if kind == "qwen3_moe" else {}
            dora = build_peft_adapter(model_dir, root / f"{kind}-dora", seed=5, r=8,
                                      lora_alpha=16, use_dora=True, **targets)  # fmt: skip
            spread_magnitudes(dora, seed=6)
            lora = build_peft_adapter(model_dir, root / f"{kind}-lora", seed=9, r=8,
                                      lora_alpha=16)  # fmt: skip
            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            ref = peft.PeftModel.from_pretrained(base, dora, adapter_name="dora")
            ref.load_adapter(lora, adapter_name="plain")
            cache[kind] = (model_dir, {"dora": dora, "plain": lora}, ref.eval())
        return cache[kind]

    return get


def hf_greedy_logprobs(
    reference: torch.nn.Module, prompt: list[int], adapter: str | None, n: int
) -> tuple[list[int], list[float]]:
    """HF + PEFT's greedy tokens and the log-probability of each."""
    tokens, logprobs = list(prompt), []
    for _ in range(n):
        last = torch.log_softmax(peft_logits(reference, tokens, adapter)[-1], dim=-1)
        token = int(last.argmax())
        tokens.append(token)
        logprobs.append(float(last[token]))
    return tokens[len(prompt) :], logprobs


def engine_for(model_dir: Path, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                                "max_loras": 2, "num_kv_blocks": 256,
                                "max_num_batched_tokens": 40}  # fmt: skip
    settings.update(overrides)
    return Engine(EngineConfig(model=str(model_dir), **settings))


_EXPECTED: dict[tuple[str, int], list[tuple[list[int], list[float]]]] = {}


def expected(bases: Any, kind: str, batch: list[list[int]], n: int) -> list[Any]:
    """HF + PEFT's greedy tokens and log-probs for the mixed batch (once per kind and n)."""
    if (kind, n) not in _EXPECTED:
        reference = bases(kind)[2]
        _EXPECTED[(kind, n)] = [hf_greedy_logprobs(reference, prompt, name, n)
                                for prompt, name in zip(batch, NAMES, strict=True)]  # fmt: skip
    return _EXPECTED[(kind, n)]


def check_mixed_batch(
    bases: Any, kind: str, backend: str, n: int, engine: Engine | None = None
) -> Engine:
    """The mixed batch through `backend` equals HF + PEFT: tokens, and log-probs to ATOL."""
    model_dir, adapters, _ = bases(kind)
    engine = engine or engine_for(model_dir)
    refs = {name: engine.register_lora(name, path, "t") for name, path in adapters.items()}
    batch = prompts(len(NAMES), seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True)
    outs = engine.generate(batch, params, [refs[x] if x else None for x in NAMES])
    for name, out, (tokens, logprobs) in zip(NAMES, outs, expected(bases, kind, batch, n),
                                             strict=True):  # fmt: skip
        assert out.token_ids == tokens, (kind, backend, name)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(logprobs, dtype=torch.float64),
                                   atol=ATOL, rtol=0, msg=f"{kind} {backend} {name}")  # fmt: skip
    return engine


@pytest.mark.parametrize(
    "kind",
    ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe"],
)
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_dora_adapter_in_a_mixed_batch_gives_pefts_tokens_and_logprobs(
    bases: Any, kind: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "native" and sgmv_cpu.library() is None:
        pytest.skip("the native CPU kernel does not build here")
    monkeypatch.setenv(dispatch.ENV, backend)
    check_mixed_batch(bases, kind, backend, n=10)


def test_the_triton_kernels_give_pefts_tokens_and_dora_steps_replay_under_cuda_graphs(
    bases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton SGMV/BGMV kernels (interpreted), DoRA's rescale in their epilogue, give
    PEFT's tokens and log-probs with decode graphs on: steps with DoRA rows replay (no
    fallback), the graphs' tables holding the DoRA slot's g. The negative control: g dropped
    from the pool's tables (the slot's generation moved, as a reload moves it, so the eager
    kernels' tables and the graphs' are refreshed) gives other log-probs, and decode steps
    still replay."""
    if not INTERPRETED:
        pytest.skip("runs the tiny model on CPU through Triton's interpreter")
    pytest.importorskip("triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv(attention.ENV, "triton")
    model_dir, adapters, reference = bases("qwen2")
    engine = engine_for(model_dir, max_num_seqs=4, enable_prefix_caching=False)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None
    check_mixed_batch(bases, "qwen2", "triton+graphs", n=3, engine=engine)
    assert graphs.replays > 0 and graphs.fallbacks == 0
    pool = engine.runner.pool
    tables = list(pool.modules.values())
    dora_slots = {k for t in tables for k, g in enumerate(t.dora) if g is not None}
    assert len(dora_slots) == 1
    (slot,) = dora_slots
    # written only by a replayed step's refresh: a step with the DoRA slot's rows replayed
    assert all(t.graph_table is not None for t in tables)
    assert any(int(t.graph_table.g_ptrs[slot]) for t in tables if t.graph_table is not None)
    ref = engine.register_lora("dora", adapters["dora"], "t")
    for table in tables:  # drop the per-row scales: plain LoRA with the same A and B
        table.dora = [None] * len(table.dora)
        table.dora_mask = 0
    pool.slot_generation[slot] += 1
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=True)
    replays = graphs.replays
    (without,) = engine.generate([prompt], params, [ref])
    _, want = hf_greedy_logprobs(reference, prompt, "dora", 3)
    assert graphs.replays > replays and graphs.fallbacks == 0
    assert abs(without.logprobs[0] - want[0]) > 100 * ATOL  # the prompt's step: eager kernels
    assert not any(int(t.graph_table.g_ptrs[slot]) for t in tables if t.graph_table is not None)


def test_the_magnitudes_matter_a_dora_adapter_read_as_plain_lora_differs(
    bases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A negative control: the same A and B without the rescale give other log-probs."""
    model_dir, adapters, reference = bases("qwen2")
    monkeypatch.setenv(dispatch.ENV, "torch")
    engine = engine_for(model_dir)
    ref = engine.register_lora("dora", adapters["dora"], "t")
    slots = engine.runner.pool.modules.values()
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=True)
    (with_dora,) = engine.generate([prompt], params, [ref])
    for table in slots:  # drop the per-row scales: plain LoRA with the same A and B
        table.dora = [None] * len(table.dora)
        table.dora_mask = 0
    (without,) = engine.generate([prompt], params, [ref])
    _, want = hf_greedy_logprobs(reference, prompt, "dora", 1)
    assert abs(with_dora.logprobs[0] - want[0]) <= ATOL
    assert abs(without.logprobs[0] - want[0]) > 100 * ATOL


def test_a_dora_slot_counts_its_per_row_scales_in_its_bytes(bases: Any) -> None:
    model_dir, adapters, _ = bases("llama")
    spec = BaseModelSpec.from_dir(model_dir)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    pool = LoRAPool(2, spec, torch.float32, "cpu")
    install_lora(model, pool)
    dora, lora = (pool.host_form(load_lora(adapters[n], spec)) for n in ("dora", "plain"))
    assert dora.is_dora and not lora.is_dora
    rows = sum(w.b.shape[0] for w in dora.modules.values())
    factors = sum(w.a.numel() + w.b.numel() for w in dora.modules.values())
    assert pool.bytes_needed(dora) == 4 * (factors + rows)  # A and B, then g in fp32
    assert pool.bytes_needed(lora) == 4 * factors
    assert pool.load(0, dora) and pool.load(1, lora)
    assert pool.slot_bytes(0) == pool.bytes_needed(dora)
    assert pool.slot_bytes(1) == pool.bytes_needed(lora)
    table = pool.module_slots(0, "q_proj")
    g = table.dora[0]
    assert g is not None and g.dtype == torch.float32 and table.dora[1] is None
    assert table.dora_mask == 0b01
    pool.free(0)
    assert table.dora[0] is None and table.dora_mask == 0
    assert pool.bytes_used == pool.bytes_needed(lora)


def test_the_per_row_scale_is_the_magnitude_over_the_updated_weights_row_norm(
    bases: Any,
) -> None:
    """g = m / ||W + s B A||_row, from the layer's own base weight (PEFT's formula)."""
    model_dir, adapters, _ = bases("qwen2")
    spec = BaseModelSpec.from_dir(model_dir)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    pool = LoRAPool(1, spec, torch.float32, "cpu")
    install_lora(model, pool)
    adapter = load_lora(adapters["dora"], spec)
    pool.load(0, adapter)
    w = adapter.modules[(1, "v_proj")]
    base_weight = model.get_submodule("model.layers.1.self_attn.v_proj").base_layer.weight
    assert w.magnitude is not None
    want = w.magnitude / torch.linalg.norm(base_weight + w.scale * (w.b @ w.a), dim=1)
    g = pool.module_slots(1, "v_proj").dora[0]
    assert g is not None
    torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_base_weights_norm_is_read_in_row_slices_and_equals_the_whole_fp32_one(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A 16-bit W is copied to fp32 a slice of rows at a time (dora.CHUNK_BYTES, here 7 rows
    of 257 columns, the last slice short): each row's ||W_i + s B_i A||^2 equals the one of
    the whole W in fp32, rows and B's rows kept together."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(300, 257, generator=g) * 0.02).to(dtype)
    a, b = torch.randn(8, 257, generator=g), torch.randn(300, 8, generator=g) * 0.05
    monkeypatch.setattr(dora, "CHUNK_BYTES", 4 * 257 * 7)
    assert len(dora._row_slices(weight)) == 43  # ceil(300 / 7)
    assert len(dora._row_slices(weight.float())) == 1  # fp32: no copy, no slices
    w64 = weight.double()
    want = (w64 + 2.0 * (b.double() @ a.double())).square().sum(1)
    torch.testing.assert_close(dora.norm_sq(weight, a, b, 2.0), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(dora.row_norms_sq(weight), w64.square().sum(1), rtol=1e-9, atol=0)


@pytest.mark.parametrize(("form", "tp"), [("fp8", 1), ("awq", 1), ("gptq-act-order", 1),
                                          ("fp8", 2), ("awq", 2)])  # fmt: skip
def test_a_dora_adapter_on_a_quantized_base_gives_pefts_tokens_on_the_dequantized_weights(
    bases: Any, tmp_path: Path, form: str, tp: int
) -> None:
    """FP8 (compressed-tensors, per channel) and 4-bit (AWQ, GPTQ act-order) checkpoints of
    the perturbed Llama: DoRA's norm reads each projection's weight as the model computes
    with it, dequantized, so the mixed batch equals HF + PEFT on the dequantized checkpoint,
    on one rank and split over two (the row-parallel norms summed over the ranks)."""
    import peft
    import transformers

    from tests.dataplane.test_quant_fp8 import _write
    from tests.dataplane.w4_checkpoints import write

    model_dir, adapters, _ = bases("llama")
    if form == "fp8":
        quantized, plain = _write(model_dir, tmp_path, "channel")
    else:
        checkpoint = write(model_dir, tmp_path, form)
        quantized, plain = checkpoint.w4, checkpoint.plain
    base = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, adapters["dora"], adapter_name="dora")
    reference.load_adapter(adapters["plain"], adapter_name="plain")
    reference.eval()
    engine = engine_for(quantized, tensor_parallel_size=tp)
    try:
        refs = {name: engine.register_lora(name, path, "t") for name, path in adapters.items()}
        batch = prompts(len(NAMES), seed=23)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
        outs = engine.generate(batch, params, [refs[x] if x else None for x in NAMES])
    finally:
        engine.close()
    for name, prompt, out in zip(NAMES, batch, outs, strict=True):
        tokens, logprobs = hf_greedy_logprobs(reference, prompt, name, 8)
        assert out.token_ids == tokens, (form, tp, name)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(logprobs, dtype=torch.float64),
                                   atol=ATOL, rtol=0, msg=f"{form} tp{tp} {name}")  # fmt: skip


@pytest.mark.parametrize(("kind", "max_loras"), [("llama", 2), ("llama", 1), ("qwen2", 2),
                                                ("phi3", 2)])  # fmt: skip
def test_a_dora_adapter_split_over_two_ranks_gives_pefts_tokens_and_logprobs(
    bases: Any, kind: str, max_loras: int
) -> None:
    """Tensor parallelism: a column-parallel rank computes its rows' g alone (its rows of W
    whole), the row-parallel ones (o_proj, down_proj) add up their column slices' squares of
    each row's norm in one all-reduce when the adapter takes a slot (LoRAPool.sync_norms).
    The mixed batch over two ranks equals HF + PEFT; with one slot (llama, max_loras 1) the
    DoRA and plain adapters take turns in it, so DoRA's g is summed again at each placement;
    qwen2 (q/k/v biases, one KV head held by both ranks) and phi3 (fused qkv and gate_up)."""
    model_dir, _, _ = bases(kind)
    engine = engine_for(model_dir, tensor_parallel_size=2, max_loras=max_loras)
    try:
        check_mixed_batch(bases, kind, f"tp2, {max_loras} slots", n=10, engine=engine)
        assert engine.runner.pool.pending_norms == set()
    finally:
        engine.close()


def test_a_projection_without_a_floating_point_weight_refuses_dora_naming_its_class() -> None:
    """A quantized projection gives DoRA its dequantized weight (W4Linear, FP8Linear); a
    module with an integer weight and no dequantization cannot."""
    w4 = W4Linear(64, 32, bias=False, group_size=32, zeros=False, act_order=False,
                  compute_dtype=torch.float32)  # fmt: skip
    assert refusal(w4) is None and refusal(nn.Linear(64, 32)) is None
    odd = nn.Linear(64, 32)
    odd.weight = nn.Parameter(torch.zeros(32, 64, dtype=torch.int8), requires_grad=False)
    why = refusal(odd)
    assert why is not None and "(Linear) has no floating-point weight" in why
