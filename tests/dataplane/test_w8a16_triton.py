"""The Triton W8A16 kernel (kernels/w8a16_triton.py) against FP8Linear's torch path
(models/quant.py).

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
here before Triton is imported, as tests/dataplane/test_kernels_triton.py does); bf16 `tl.dot` is
wrong in the interpreter, so bf16 is only tested on a GPU. With CUDA and TRITON_INTERPRET unset,
the same tests run the compiled kernel on CUDA tensors.
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
from loraplane.dataplane.kernels import w8a16_triton as wt  # noqa: E402
from loraplane.dataplane.models.quant import FP8Linear, quantize  # noqa: E402
from loraplane.dataplane.sampling import SamplingParams  # noqa: E402
from tests.dataplane.conftest import compile_without_gpu  # noqa: E402
from tests.dataplane.test_engine import prompts  # noqa: E402

if INTERPRETED and type(wt._w8a16_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "w8a16_triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}  # relative


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "per_channel", "bias"),
    [
        (1, 40, 96, True, False),  # a decode row; n, k not multiples of the tiles
        (17, 72, 64, False, True),  # per tensor, two row blocks' worth of masks
        (40, 24, 128, True, True),
    ],
)
def test_the_kernel_is_the_torch_dequantize_path(
    dtype: torch.dtype, m: int, n: int, k: int, per_channel: bool, bias: bool
) -> None:
    """y = x @ (W8 * scale).to(x.dtype)^T (+ bias), as F.linear on the dequantized weight."""
    g = torch.Generator().manual_seed(m)
    w8, scale = quantize(torch.randn(n, k, generator=g), per_channel)
    b = torch.randn(n, generator=g).to(device=DEVICE, dtype=dtype) if bias else None
    x = torch.randn(m, k, generator=g).to(device=DEVICE, dtype=dtype)
    y = wt.w8a16_linear(x, w8.to(DEVICE), scale.to(DEVICE), b)
    w = (w8.float() * scale).to(dtype).to(DEVICE)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (1, 40, 96, (16, 32)),  # tiles straddle scale blocks
        (17, 72, 64, (48, 40)),  # partial blocks at the end of rows and columns
        (5, 24, 128, (128, 128)),  # one block row: the weight smaller than a block
    ],
)
def test_the_kernel_with_block_scales_is_the_torch_dequantize_path(
    dtype: torch.dtype, m: int, n: int, k: int, block: tuple[int, int]
) -> None:
    """Block-wise FP8 (a factor per block of `block`): F.linear on the dequantized weight."""
    from tests.dataplane.test_quant_fp8_block import quantize_blocks

    g = torch.Generator().manual_seed(m)
    w8, scale, plain = quantize_blocks(torch.randn(n, k, generator=g), block)
    x = torch.randn(m, k, generator=g).to(device=DEVICE, dtype=dtype)
    y = wt.w8a16_linear(x, w8.to(DEVICE), scale.to(DEVICE), None, block)
    expected = F.linear(x.float(), plain.to(dtype).float().to(DEVICE))
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
    layer = FP8Linear(k, n, False, False, dtype, block).to(DEVICE)
    layer.weight.data, layer.weight_scale.data = w8.to(DEVICE), scale.to(DEVICE)
    torch.testing.assert_close(layer.dequantized(), plain.to(dtype).to(DEVICE), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"scale must be fp32 of shape \(3, 2\) \(blocks of"):
        wt.w8a16_linear(x, w8.to(DEVICE), scale.to(DEVICE)[:, :1], None, (-(-n // 3), k // 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slice_starting_inside_scale_blocks_reads_them_from_its_offset(
    dtype: torch.dtype,
) -> None:
    """A tensor-parallel rank's slice of a block-wise FP8 weight (rows 20-59, columns 30-93 of
    a 72 x 128 weight in blocks of 16 x 32): the blocks it touches, read from offsets (4, 30),
    equal F.linear on that slice of the dequantized weight, in the kernel and in FP8Linear."""
    from tests.dataplane.test_quant_fp8_block import quantize_blocks

    g = torch.Generator().manual_seed(9)
    block, rows, cols = (16, 32), slice(20, 60), slice(30, 94)
    w8, scale, plain = quantize_blocks(torch.randn(72, 128, generator=g), block)
    part_w8, part_plain = w8[rows, cols].contiguous(), plain[rows, cols]
    part_scale = scale[20 // 16 : -(-60 // 16), 30 // 32 : -(-94 // 32)].contiguous()
    offset = (20 % 16, 30 % 32)
    x = torch.randn(3, 64, generator=g).to(device=DEVICE, dtype=dtype)
    y = wt.w8a16_linear(x, part_w8.to(DEVICE), part_scale.to(DEVICE), None, block, offset)
    expected = F.linear(x.float(), part_plain.to(dtype).float().to(DEVICE))
    assert (y.float() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
    layer = FP8Linear(64, 40, False, False, dtype, block)
    layer.start_in_block(offset)
    assert tuple(layer.weight_scale.shape) == tuple(part_scale.shape) == (3, 3)
    layer.weight.data, layer.weight_scale.data = part_w8, part_scale
    torch.testing.assert_close(layer.dequantized(), part_plain.to(dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"scale must be fp32 of shape \(3, 2\)"):
        wt.w8a16_linear(x, part_w8.to(DEVICE), part_scale.to(DEVICE), None, block)


def test_an_fp8_layer_on_the_triton_path_computes_as_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8Linear with LORAPLANE_FP8=triton (read when the layer is built) runs the kernel on
    [..., in] inputs, with torch the dequantize path; the two agree."""
    g = torch.Generator().manual_seed(3)
    w8, scale = quantize(torch.randn(48, 64, generator=g), per_channel=True)
    bias = torch.randn(48, generator=g)
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLANE_FP8", backend)
        layer = FP8Linear(64, 48, True, True, torch.float32)
        layer.weight = torch.nn.Parameter(w8, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
        layers[backend] = layer.to(DEVICE)
    assert layers["triton"].backend == "triton"
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(layers["triton"](x), layers["torch"](x), rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("LORAPLANE_FP8", "cuda")
    with pytest.raises(ValueError, match="LORAPLANE_FP8 must be one of auto, torch, triton"):
        FP8Linear(64, 48, True, True, torch.float32)


def test_the_launcher_refuses_what_does_not_fit() -> None:
    w8, scale = quantize(torch.randn(16, 64), per_channel=True)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        wt.w8a16_linear(x[:, :32], w8, scale, None)
    with pytest.raises(ValueError, match="x must be one of"):
        wt.w8a16_linear(x.double(), w8, scale, None)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        wt.w8a16_linear(x, w8.float(), scale, None)
    with pytest.raises(ValueError, match="scale must be fp32 with 1 or 16 values"):
        wt.w8a16_linear(x, w8, scale[:3], None)
    assert wt.w8a16_linear(x[:0], w8, scale, None).shape == (0, 16)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loraplane.dataplane.kernels import w8a16_triton as wt

    kernel, count = wt._w8a16_kernel, 0
    for dt, precision in (("*bf16", "tf32"), ("*fp16", "tf32"), ("*fp32", "ieee")):
        for per_channel, bias, blocks in ((True, False, 0), (False, True, 0), (False, False, 128)):
            types = {"x_ptr": dt, "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": dt,
                     "y_ptr": dt, "M": "i32", "N": "i32", "K": "i32", "ROW_OFF": "i32",
                     "COL_OFF": "i32", "SCALE_COLS": "i32"}
            consts = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "PER_CHANNEL": per_channel,
                      "SCALE_N": blocks, "SCALE_K": blocks, "HAS_BIAS": bias,
                      "PRECISION": precision}
            sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (dt, per_channel)
            count += 1
    print("compiled", count)
    """
)


def test_the_kernel_compiles_to_sm90_cubin_in_every_dtype_without_a_gpu() -> None:
    """The interpreter does not lower kernels; compile this one for an H100/H200 target."""
    assert "compiled 9" in compile_without_gpu(_COMPILE_SCRIPT, timeout=240)


def test_an_engine_on_the_triton_path_generates_the_torch_paths_tokens(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end through the LoRA wrapper: a base quantized at load served with the kernel (on
    CPU tensors, interpreted) gives the torch path's greedy tokens, adapters and base mixed."""
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLANE_FP8", backend)
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device=str(DEVICE),
                                     dtype="float32", quantization="fp8", block_size=4,
                                     num_kv_blocks=64, max_num_seqs=4))  # fmt: skip
        layers = [m for m in engine.runner.model.modules() if isinstance(m, FP8Linear)]
        assert len(layers) == 14 and all(m.backend == backend for m in layers)
        ref = engine.register_lora("r16", peft_adapters["r16"], "t")
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outs[backend] = [o.token_ids for o in engine.generate(prompts(2, 5), params, [ref, None])]
    assert outs["triton"] == outs["torch"]


def test_a_mixture_of_experts_on_the_triton_path_generates_the_torch_paths_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixtral quantized at load: every expert's rows go through the kernel (models/moe.py
    `_expert_mm`, one launch per expert hit), with an adapter on attention and the experts
    beside base rows: the torch path's greedy tokens."""
    from loraplane.dataplane.models import quant
    from tests.dataplane.expert_kernels import torch_and_kernel_tokens
    from tests.factories import build_family_adapter, build_model

    model = build_model(tmp_path / "mixtral", "mixtral")
    adapter = build_family_adapter(model, tmp_path / "adapter", "mixtral", seed=3)
    launched: list[tuple[int, ...]] = []  # the weight shape of each kernel call

    def counted(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        launched.append(tuple(weight.shape))
        return wt.w8a16_linear(x, weight, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant, "_triton_linear", lambda: counted)
    outs, experts = torch_and_kernel_tokens(model, adapter, DEVICE, "LORAPLANE_FP8", FP8Linear,
                                            quantization="fp8")  # fmt: skip
    assert outs["triton"] == outs["torch"]
    gate, down = (tuple(e.weight.shape) for e in experts[:3:2])  # expert 0's w1 and w2
    assert gate != down and gate in launched and down in launched
