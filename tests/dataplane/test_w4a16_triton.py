"""The Triton W4A16 kernel (kernels/w4a16_triton.py) against the torch path of models/quant_w4.py.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
here before Triton is imported, as tests/dataplane/test_kernels_triton.py does); bf16 `tl.dot` is
wrong in the interpreter, so bf16 is only tested on a GPU. With CUDA and TRITON_INTERPRET unset,
the same tests run the compiled kernel on CUDA tensors. Shapes stay small: the interpreter is
slow.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.dataplane.config import EngineConfig  # noqa: E402
from loraplane.dataplane.engine import Engine  # noqa: E402
from loraplane.dataplane.kernels import w4a16_triton as wt  # noqa: E402
from loraplane.dataplane.models.quant_w4 import W4Linear, dequantize, pack  # noqa: E402
from loraplane.dataplane.sampling import SamplingParams  # noqa: E402
from tests.dataplane.conftest import compile_without_gpu  # noqa: E402
from tests.dataplane.test_engine import hf_greedy, prompts  # noqa: E402
from tests.dataplane.w4_checkpoints import write  # noqa: E402

if INTERPRETED and type(wt._w4a16_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "w4a16_triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}  # relative


def _layer(
    n: int, k: int, group: int, zeros: bool, act_order: bool, bias: bool, seed: int
) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    return {
        "qweight": pack(torch.randint(0, 16, (n, k), generator=g)),
        "scales": (torch.rand(n, groups, generator=g) * 0.05 + 0.01).half(),
        "qzeros": torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
        if zeros
        else None,
        "g_idx": torch.randint(0, groups, (k,), generator=g, dtype=torch.int32)
        if act_order
        else None,
        "bias": torch.randn(n, generator=g) if bias else None,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "act_order", "bias"),
    [
        (1, 40, 96, 32, True, False, False),  # a decode row; n, k not multiples of the tiles
        (17, 72, 64, 16, False, False, True),  # symmetric, two row blocks' worth of masks
        (40, 24, 128, 128, True, True, True),  # act-order: groups read through g_idx
        (3, 64, 64, 64, False, True, False),  # one group per row
    ],
)
def test_the_kernel_is_the_torch_dequantize_path(
    dtype: torch.dtype, m: int, n: int, k: int, group: int, zeros: bool, act_order: bool,
    bias: bool,
) -> None:  # fmt: skip
    """y = x @ ((u - z) * s).to(x.dtype)^T (+ bias), as F.linear on the dequantized weight."""
    parts = _layer(n, k, group, zeros, act_order, bias, seed=m)
    on = {name: t.to(DEVICE) if t is not None else None for name, t in parts.items()}
    b = on["bias"].to(dtype) if on["bias"] is not None else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device=DEVICE, dtype=dtype)
    assert on["qweight"] is not None and on["scales"] is not None
    y = wt.w4a16_linear(x, on["qweight"], on["scales"], on["qzeros"], on["g_idx"], group, b)
    w = dequantize(on["qweight"], on["scales"], on["qzeros"], on["g_idx"]).to(dtype)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (m, n)
    scale = expected.abs().max()
    assert (y.float() - expected).abs().max() <= TOLERANCE[dtype] * scale


def test_a_tensor_parallel_slice_of_an_act_order_layer_reads_the_whole_layer_s_groups() -> None:
    """A row-parallel rank holds half of the input columns and, through the act-order map,
    every group's scales and zeros (W4Linear.hold_groups): more groups than k / group_size."""
    whole = _layer(24, 128, 16, True, True, False, seed=5)  # 8 groups over 128 columns
    qweight, g_idx = whole["qweight"], whole["g_idx"]
    assert qweight is not None and g_idx is not None
    part = {**whole, "qweight": qweight[:, 8:].contiguous(), "g_idx": g_idx[64:].contiguous()}
    on = {name: t.to(DEVICE) if t is not None else None for name, t in part.items()}
    assert on["qweight"] is not None and on["scales"] is not None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = wt.w4a16_linear(x, on["qweight"], on["scales"], on["qzeros"], on["g_idx"], 16, None)
    w = dequantize(on["qweight"], on["scales"], on["qzeros"], on["g_idx"])
    full = dequantize(*(whole[k] for k in ("qweight", "scales", "qzeros", "g_idx")))
    torch.testing.assert_close(w.cpu(), full[:, 64:], rtol=0, atol=0)  # the slice's weights
    expected = F.linear(x, w)
    assert (y - expected).abs().max() <= TOLERANCE[torch.float32] * expected.abs().max()


def test_a_w4_layer_on_the_triton_path_computes_as_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W4Linear with LORAPLANE_W4=triton (read when the layer is built) runs the kernel, on
    [..., in] inputs; with torch, the dequantize path; the two agree."""
    parts = _layer(48, 64, 32, True, False, True, seed=3)
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLANE_W4", backend)
        layer = W4Linear(64, 48, True, 32, True, False, torch.float32)
        for name, value in parts.items():
            if name == "bias" and value is not None:
                value = torch.nn.Parameter(value, requires_grad=False)
            setattr(layer, name, value)
        layers[backend] = layer.to(DEVICE)
    assert layers["triton"].backend == "triton"
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(layers["triton"](x), layers["torch"](x), rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("LORAPLANE_W4", "cuda")
    with pytest.raises(ValueError, match="LORAPLANE_W4 must be one of auto, torch, triton"):
        W4Linear(64, 48, True, 32, True, False, torch.float32)


def test_the_launcher_refuses_what_does_not_fit() -> None:
    parts = _layer(16, 64, 32, True, False, False, seed=0)
    q, s, z = parts["qweight"], parts["scales"], parts["qzeros"]
    assert q is not None and s is not None and z is not None
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        wt.w4a16_linear(x[:, :32], q, s, z, None, 32, None)
    with pytest.raises(ValueError, match="x must be one of"):
        wt.w4a16_linear(x.double(), q, s, z, None, 32, None)
    with pytest.raises(ValueError, match="do not fit"):
        wt.w4a16_linear(x, q, s, z, None, 16, None)
    with pytest.raises(ValueError, match="qzeros must be uint8"):
        wt.w4a16_linear(x, q, s, z.int(), None, 32, None)
    assert wt.w4a16_linear(x[:0], q, s, z, None, 32, None).shape == (0, 16)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loraplane.dataplane.kernels import w4a16_triton as wt

    kernel, count = wt._w4a16_kernel, 0
    for dt, precision in (("*bf16", "tf32"), ("*fp16", "tf32"), ("*fp32", "ieee")):
        for zeros, g_idx, bias in ((True, False, False), (False, True, True)):
            types = {"x_ptr": dt, "qweight_ptr": "*i32", "scales_ptr": "*fp16",
                     "qzeros_ptr": "*u8", "g_idx_ptr": "*i32", "bias_ptr": dt, "y_ptr": dt,
                     "M": "i32", "N": "i32", "K": "i32", "G": "i32", "group_size": "i32"}
            consts = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "HAS_ZEROS": zeros,
                      "HAS_G_IDX": g_idx, "HAS_BIAS": bias, "PRECISION": precision}
            sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (dt, zeros)
            count += 1
    print("compiled", count)
    """
)


def test_the_kernel_compiles_to_sm90_cubin_in_every_dtype_without_a_gpu() -> None:
    """The interpreter does not lower kernels; compile this one for an H100/H200 target."""
    assert "compiled 6" in compile_without_gpu(_COMPILE_SCRIPT, timeout=240)


def test_an_engine_on_the_triton_path_generates_hf_peft_tokens_on_an_awq_base(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """End to end through the LoRA wrapper: an AWQ checkpoint served with the kernel (on CPU
    tensors, interpreted) gives HF + PEFT's greedy tokens on its dequantized weights."""
    import peft
    import transformers

    ckpt = write(tiny_llama_dir, tmp_path, "awq")
    monkeypatch.setenv("LORAPLANE_W4", "triton")
    engine = Engine(EngineConfig(model=str(ckpt.w4), device=str(DEVICE), dtype="float32",
                                 block_size=4, num_kv_blocks=64, max_num_seqs=4))  # fmt: skip
    layers = [m for m in engine.runner.model.modules() if isinstance(m, W4Linear)]
    assert len(layers) == 14 and all(m.backend == "triton" for m in layers)
    ref = engine.register_lora("r16", peft_adapters["r16"], "t")
    batch = prompts(2, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = engine.generate(batch, params, [ref, None])
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt.plain, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, peft_adapters["r16"], adapter_name="r16")
    for prompt, name, out in zip(batch, ["r16", None], outs, strict=True):
        assert out.token_ids == hf_greedy(reference.eval(), prompt, name, 5), name


def test_a_4_bit_mixture_of_experts_on_the_triton_path_generates_the_torch_paths_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AWQ Mixtral: every expert's rows go through the kernel (models/moe.py `_expert_mm`,
    one launch per expert hit), an adapter on attention and the experts beside base rows: the
    torch path's greedy tokens."""
    from loraplane.dataplane.models import quant_w4
    from tests.dataplane.expert_kernels import torch_and_kernel_tokens
    from tests.factories import build_family_adapter, build_model

    model = build_model(tmp_path / "mixtral", "mixtral")
    adapter = build_family_adapter(model, tmp_path / "adapter", "mixtral", seed=3)
    ckpt = write(model, tmp_path, "awq")
    launched: list[tuple[int, ...]] = []  # the packed weight shape of each kernel call

    def counted(x: torch.Tensor, qweight: torch.Tensor, *args: object) -> torch.Tensor:
        launched.append(tuple(qweight.shape))
        return wt.w4a16_linear(x, qweight, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_w4, "_triton_linear", lambda: counted)
    outs, experts = torch_and_kernel_tokens(ckpt.w4, adapter, DEVICE, "LORAPLANE_W4", W4Linear)
    assert outs["triton"] == outs["torch"]
    gate, down = (tuple(e.qweight.shape) for e in experts[:3:2])  # expert 0's w1 and w2
    assert gate != down and gate in launched and down in launched
