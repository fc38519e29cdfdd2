"""FP8 base weights (issue 31): checkpoints written by llm-compressor / compressed-tensors, or a
16-bit checkpoint quantized at load (`--quantization fp8`).

A quantized projection keeps its weight in float8 e4m3 with fp32 scales, per tensor (one scale),
per output channel (`[out, 1]`) or per block of the weight (`[ceil(out / bn), ceil(in / bk)]`,
the block-wise FP8 that Qwen's and DeepSeek's own FP8 releases use), and computes in the
activation dtype:

    y = x @ (W8.float() * scale).to(x.dtype).T (+ bias)     (a block scale spread over its block)

which is what transformers computes on the same weights dequantized to that dtype, so the
reference for every test is HF on the dequantized checkpoint. Activations are never quantized
here (W8A16: a checkpoint's `input_scale` is read past), and LoRA, applied by the wrapper
around this layer (lora/layers.py), reads the unquantized activations and keeps the adapters in
the activation dtype: its delta does not depend on the base's format. The weight takes a byte
per parameter on the device. On CPU (and `LORAPLANE_FP8=torch`) each call dequantizes the
weight and runs F.linear; on CUDA tensors the Triton W8A16 kernel of kernels/w8a16_triton.py
scales the fp8 tiles inside the product and never writes the 16-bit weight.

What a checkpoint may say (`quantization_config` in config.json), anything else refused by
name: quant_method "compressed-tensors", format "float-quantized" or "naive-quantized", one
config group whose weights are 8-bit floats, symmetric, strategy "tensor" or "channel",
targeting "Linear", and an `ignore` list (the lm_head, typically); strategy "block" (its
`block_structure` [bn, bk], a `weight_scale` of one factor per block), or transformers' own
quant_method "fp8" (its FineGrainedFP8 layout): `fmt` "e4m3", `weight_block_size` [bn, bk],
each projection's `weight` with a `weight_scale_inv` of one fp32 factor per block (multiplied,
despite its name), `modules_to_not_convert` left 16-bit, activations dynamic or static (read
past: W8A16).

4-bit checkpoints (compressed-tensors pack-quantized, AWQ, GPTQ) are read by
models/w4_formats.py into models/quant_w4.py's W4Linear (W4A16, half a byte per weight plus
group scales, the same contract with the LoRA wrapper): `scheme_for` here leaves them to it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from loraplane.adapters import base_model
from loraplane.dataplane.kernels import backends
from loraplane.dataplane.models.config import UnsupportedModelError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# --quantization: what a 16-bit checkpoint can be quantized to at load (config.py keeps the
# same tuple for EngineConfig's check, without importing torch)
QUANTIZATIONS = ("fp8",)
# the decoder layers' projections, a mixture of experts' experts included (Mixtral's
# block_sparse_moe.experts.N.w1/w3/w2, Qwen3-MoE's mlp.experts.N.gate_proj/...): what is
# quantized (embeddings, norms, the routers and lm_head are not)
PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(?:"
    r"(?:self_attn|mlp)\.(?:q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_up_proj)"
    r"|(?:mlp|block_sparse_moe)\.(?:experts\.\d+\.)?(?:gate_proj|up_proj|down_proj|w1|w2|w3)"
    r")$"
)
_STRATEGIES = ("tensor", "channel", "block")
# the FP8 projections' compute path: auto (Triton's W8A16 kernel on CUDA tensors, the torch
# dequantize path elsewhere), torch or triton; read when the layer is built
FP8_ENV = "LORAPLANE_FP8"
FP8_BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _has_fp8(device: torch.device) -> bool:
    """Whether `auto` takes the kernel on this device: a CUDA GPU with FP8 conversions in
    hardware (compute capability 8.9: Ada, Hopper and later); older ones keep the torch path."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _triton_linear() -> Callable[..., torch.Tensor]:
    from loraplane.dataplane.kernels.w8a16_triton import w8a16_linear  # imports Triton

    return w8a16_linear


@dataclass(frozen=True, slots=True)
class FP8Scheme:
    """How a model's projections are stored: per-tensor or per-channel scales, from the
    checkpoint (`from_checkpoint`) or made at load (`at_load`)."""

    per_channel: bool
    at_load: bool  # the checkpoint is 16-bit: quantize each projection as it is read
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) left unquantized
    block: tuple[int, int] | None = None  # (rows, columns) per scale: block-wise FP8
    scale_name: str = "weight_scale"  # a block-wise scale's tensor (transformers': _inv)

    def covers(self, name: str) -> bool:
        """Whether module `name` is quantized."""
        if PROJECTION.match(name) is None:
            return False
        for rule in self.ignore:
            pattern = rule.removeprefix("re:")
            if (rule.startswith("re:") and re.match(pattern, name)) or name == rule:
                return False
            if self.block is not None and (name == rule or name.endswith("." + rule)):
                return False  # transformers' modules_to_not_convert: names or their ends
        return True

    def scale_shape(
        self, out_features: int, in_features: int, offset: tuple[int, int] = (0, 0)
    ) -> tuple[int, ...]:
        """The shape of a projection's scale: [] per tensor, [out, 1] per channel, one per
        block of the weight (a partial block at the end of a row or column counts; a
        tensor-parallel slice starting `offset` rows and columns into its first block counts
        the blocks it touches)."""
        if self.block is not None:
            rows, cols = self.block
            return (-(-(out_features + offset[0]) // rows), -(-(in_features + offset[1]) // cols))
        return (out_features, 1) if self.per_channel else ()


def scheme_for(config: dict[str, Any], quantization: str | None) -> FP8Scheme | None:
    """The scheme a model loads with: its checkpoint's (`quantization_config`), else
    `quantization` applied at load, else None (16-bit). UnsupportedModelError names what
    cannot be served."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UnsupportedModelError(
            f"quantization {quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}"
        )
    if is_4_bit(config):  # models/w4_formats.py's (which refuses `quantization` on it)
        return None
    stored = config.get("quantization_config")
    if stored is None:
        return None if quantization is None else FP8Scheme(per_channel=True, at_load=True)
    scheme = _from_checkpoint(stored)
    if quantization is not None and quantization != "fp8":
        raise UnsupportedModelError(f"the checkpoint is already quantized (fp8): {quantization}")
    return scheme


def is_4_bit(config: dict[str, Any]) -> bool:
    """Whether config.json describes a 4-bit checkpoint (compressed-tensors pack-quantized,
    AWQ, GPTQ): one models/w4_formats.py reads."""
    return base_model.checkpoint_quantization(config) == "int4"


def _from_checkpoint(stored: Any) -> FP8Scheme:
    if not isinstance(stored, dict):
        raise UnsupportedModelError("quantization_config must be an object")
    method = stored.get("quant_method")
    if method == "fp8":
        return _block_scheme(stored)
    if method != "compressed-tensors":
        raise UnsupportedModelError(
            f"quantization_config.quant_method {method!r} is not supported; supported:"
            " compressed-tensors (FP8, 4-bit pack-quantized), fp8 (block-wise), awq, gptq"
        )
    fmt = stored.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedModelError(
            f"compressed-tensors format {fmt!r} is not supported; supported: float-quantized,"
            " pack-quantized (4-bit)"
        )
    _, weights = config_group(stored, fmt, num_bits=8, kind="float")  # e4m3
    strategy = weights.get("strategy")
    if strategy not in _STRATEGIES or weights.get("symmetric", True) is not True:
        raise UnsupportedModelError(
            f"FP8 weights with strategy {strategy!r} (symmetric {weights.get('symmetric')}) are"
            " not supported; supported: symmetric, per tensor, per channel or per block"
        )
    block = base_model.fp8_block(stored)
    if strategy == "block" and block is None:
        raise UnsupportedModelError(
            f"FP8 weights per block need block_structure [rows, columns], got"
            f" {weights.get('block_structure')!r}"
        )
    if weights.get("dynamic") is True:
        raise UnsupportedModelError("dynamically quantized weights are not supported")
    ignore = stored.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise UnsupportedModelError("quantization_config.ignore must be a list of module names")
    return FP8Scheme(per_channel=strategy == "channel", at_load=False, ignore=tuple(ignore),
                     block=block)  # fmt: skip


def _block_scheme(stored: dict[str, Any]) -> FP8Scheme:
    """transformers' quant_method "fp8": e4m3 weights with a scale per block."""
    fmt = stored.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"fp8 weights in format {fmt!r} are not supported: e4m3")
    block = base_model.fp8_block(stored)
    if block is None:
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size {stored.get('weight_block_size')!r} must be"
            " two positive ints, [rows, columns] (per-tensor and per-channel FP8 are read from"
            " compressed-tensors checkpoints)"
        )
    keep = stored.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(m, str) for m in keep):
        raise UnsupportedModelError("quantization_config.modules_to_not_convert must be a list")
    return FP8Scheme(per_channel=False, at_load=False, ignore=tuple(keep), block=block,
                     scale_name="weight_scale_inv")  # fmt: skip


def config_group(
    stored: dict[str, Any], fmt: str, num_bits: int, kind: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(group, its weights scheme): the one config group of a compressed-tensors
    quantization_config of format `fmt`, checked to quantize Linear layers' weights to
    `num_bits` bits of type `kind`; UnsupportedModelError otherwise (FP8 here, 4-bit in
    models/w4_formats.py)."""
    groups = stored.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedModelError("quantization_config.config_groups must hold one group")
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise UnsupportedModelError("the config group has no weights scheme")
    if (weights.get("num_bits"), weights.get("type")) != (num_bits, kind):
        raise UnsupportedModelError(
            f"{fmt} weights of num_bits {weights.get('num_bits')!r}, type"
            f" {weights.get('type')!r} are not supported; supported: num_bits {num_bits},"
            f" type {kind}"
        )
    if group.get("targets", ["Linear"]) != ["Linear"]:
        raise UnsupportedModelError(
            f"config group targets {group.get('targets')} are not supported: Linear"
        )
    return group, weights


def quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, scale): `weight` [out, in] in float8 e4m3 with fp32 scales ([out, 1] per channel,
    [] per tensor) such that W8.float() * scale approximates it; amax / 448 per scale, as
    llm-compressor's symmetric min-max observer."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class FP8Linear(nn.Linear):
    """A projection whose weight is float8 e4m3 (one byte per parameter) with fp32 scales,
    computing in `compute_dtype` (the model's): x @ (W8 * scale)^T, dequantized per call."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, per_channel: bool,
        compute_dtype: torch.dtype, block: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, dtype=FP8)
        self.block = block
        self.per_channel = per_channel
        self.block_offset = (0, 0)  # where a tensor-parallel slice starts in its first block
        self.weight_scale = nn.Parameter(torch.ones(self._scale_shape()), requires_grad=False)
        self.compute_dtype = compute_dtype
        if self.bias is not None:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype))
        self.backend = backends.read_choice(FP8_ENV, FP8_BACKENDS)  # once, not per call

    def reset_parameters(self) -> None:  # built on the meta device, loaded from the file
        pass

    def _scale_shape(self) -> tuple[int, ...]:
        scheme = FP8Scheme(self.per_channel, False, block=self.block)
        return scheme.scale_shape(self.out_features, self.in_features, self.block_offset)

    def start_in_block(self, offset: tuple[int, int]) -> None:
        """This tensor-parallel slice's rows and columns start `offset` into their first scale
        block (parallel/shard.py `block_offset`): its factors are the blocks it touches."""
        self.block_offset = offset
        self.weight_scale = nn.Parameter(
            torch.ones(self._scale_shape(), device=self.weight_scale.device), requires_grad=False
        )

    def dequantized(self) -> torch.Tensor:
        """The weight as the model computes with it: (W8.float() * scale) in compute_dtype."""
        scale: torch.Tensor = self.weight_scale
        if self.block is not None:  # each block's factor over its rows and columns
            (rows, cols), (row, col) = self.block, self.block_offset
            out, inp = self.weight.shape
            scale = scale.repeat_interleave(rows, 0)[row : row + out]
            scale = scale.repeat_interleave(cols, 1)[:, col : col + inp]
        return (self.weight.float() * scale).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if backends.resolve(self.backend, x) == "triton" and (
            self.backend == "triton" or _has_fp8(x.device)
        ):
            return _triton_linear()(x, self.weight, self.weight_scale, self.bias, self.block,
                                    self.block_offset)  # fmt: skip
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    @property
    def scale_form(self) -> str:
        """ "per tensor", "per channel" or "per block of RxC": how the scales cover W."""
        if self.block is not None:
            return f"per block of {self.block[0]}x{self.block[1]}"
        return "per channel" if self.weight_scale.dim() else "per tensor"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 e4m3, {self.scale_form}"


def quantize_projections(model: nn.Module, scheme: FP8Scheme, dtype: torch.dtype) -> list[str]:
    """Swap every projection `scheme` covers (on the meta device, before loading) for an
    FP8Linear; returns their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and scheme.covers(n)]
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        fp8 = FP8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                        scheme.per_channel, dtype, scheme.block)  # fmt: skip
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, fp8)
    if not names:
        raise UnsupportedModelError("the model has no projections to quantize")
    return names
