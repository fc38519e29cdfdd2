"""4-bit checkpoints as people download them (W4A16, issue 31): what each format's
`quantization_config` may say, and how its tensors become quant_w4's one packed layout.

Read, anything else refused by name (UnsupportedModelError):
- compressed-tensors `pack-quantized` (llm-compressor's W4A16): one config group of 4-bit int
  weights, strategy "group" (with group_size) or "channel", symmetric or not, targets Linear,
  no activation quantization, an `ignore` list. `weight_packed` int32 [out, in/8] holds the
  signed values + 8 with element i of a row in bits 4*(i % 8) of word i // 8 (the layout
  itself); `weight_scale` [out, groups]; `weight_zero_point` (asymmetric) int32 [out/8, groups],
  packed the same way down the rows; `weight_shape` is checked; `weight_g_idx` with actorder
  "group".
- AWQ (`quant_method: awq`, version gemm, 4 bits, zero_point true): `qweight` int32
  [in, out/8] and `qzeros` int32 [groups, out/8] packed along the outputs in AWQ's interleaved
  order (nibble k of a word holds column AWQ_ORDER[k] of its eight), `scales` [groups, out];
  W[o, i] = (q - z) * s. `modules_to_not_convert` names projections left 16-bit.
- GPTQ (`quant_method: gptq`, 4 bits, checkpoint_format gptq or gptq_v2): `qweight` int32
  [in/8, out] packed along the inputs in order (its transpose is the layout), `qzeros` int32
  [groups, out/8] in order, `scales` [groups, out], `g_idx` [in]. GPTQ v1 stores each zero
  point minus one (the tools that read it add the one back: z = stored + 1); gptq_v2 stores
  it as is. desc_act (act-order) keeps g_idx: column i takes group g_idx[i]'s scale and zero.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraplane.dataplane.models import quant
from loraplane.dataplane.models.config import UnsupportedModelError
from loraplane.dataplane.models.quant import PROJECTION
from loraplane.dataplane.models.quant_w4 import PACK, W4Linear, pack, unpack

FORMATS = ("pack-quantized", "awq", "gptq", "gptq_v2")
# AWQ's GEMM packing: nibble k of a word holds column AWQ_ORDER[k] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_COLUMNS = tuple(AWQ_ORDER.index(c) for c in range(PACK))  # column c: nibble _AWQ_COLUMNS[c]


@dataclass(frozen=True, slots=True)
class W4Scheme:
    """How a 4-bit checkpoint's projections are stored."""

    format: str  # one of FORMATS
    group_size: int  # input columns per scale; -1: one group per row
    zeros: bool  # a zero point per group (asymmetric); else symmetric, z = 8
    act_order: bool  # a g_idx column-to-group map is read and kept
    ignore: tuple[str, ...] = ()  # compressed-tensors: names or "re:" patterns; AWQ: substrings
    only: tuple[str, ...] | None = None  # GPTQ modules_in_block_to_quantize, flattened

    def covers(self, name: str) -> bool:
        """Whether module `name` is 4-bit in the checkpoint."""
        if PROJECTION.match(name) is None:
            return False
        if self.only is not None:
            return name.split(".", 3)[3] in self.only  # model.layers.N.<self_attn.q_proj>
        for rule in self.ignore:
            if self.format == "awq":
                if rule in name:
                    return False
            elif (rule.startswith("re:") and re.match(rule[3:], name)) or name == rule:
                return False
        return True

    def group(self, in_features: int) -> int:
        """The group size of a projection of `in_features` inputs."""
        return in_features if self.group_size == -1 else self.group_size


def scheme_for(config: dict[str, Any], quantization: str | None) -> W4Scheme | None:
    """The checkpoint's 4-bit scheme, or None when it is not a 4-bit checkpoint;
    UnsupportedModelError names the field and value that cannot be served."""
    if not quant.is_4_bit(config):
        return None
    stored = config["quantization_config"]
    method = stored["quant_method"]
    if quantization is not None:
        raise UnsupportedModelError(
            f"the checkpoint is already quantized ({method}, 4-bit): --quantization"
            f" {quantization} applies to 16-bit checkpoints"
        )
    if method == "awq":
        return _awq(stored)
    if method == "gptq":
        return _gptq(stored)
    return _pack_quantized(stored)


def _group_size(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise UnsupportedModelError(f"{field} {value!r} is not supported: a positive int or -1")
    if value != -1 and value % PACK:
        raise UnsupportedModelError(f"{field} {value} is not a multiple of {PACK}")
    return value


def _bits(value: Any, field: str) -> None:
    if value != 4:
        raise UnsupportedModelError(f"{field} {value!r} is not supported; supported: 4")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModelError(f"{field} must be a list of module names")
    return tuple(value)


def _awq(stored: dict[str, Any]) -> W4Scheme:
    _bits(stored.get("bits", stored.get("w_bit")), "quantization_config.bits")
    version = stored.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise UnsupportedModelError(f"AWQ version {version!r} is not supported; supported: gemm")
    if stored.get("zero_point", True) is not True:
        raise UnsupportedModelError(
            f"AWQ zero_point {stored.get('zero_point')!r} is not supported; supported: true"
        )
    group = _group_size(stored.get("group_size", stored.get("q_group_size")),
                        "quantization_config.group_size")  # fmt: skip
    ignore = _names(stored.get("modules_to_not_convert"), "modules_to_not_convert")
    return W4Scheme("awq", group, zeros=True, act_order=False, ignore=ignore)


def _gptq(stored: dict[str, Any]) -> W4Scheme:
    _bits(stored.get("bits"), "quantization_config.bits")
    fmt = stored.get("checkpoint_format", stored.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2") or stored.get("is_marlin_format"):
        raise UnsupportedModelError(
            f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2"
        )
    if stored.get("dynamic"):
        raise UnsupportedModelError("GPTQ `dynamic` per-module overrides are not supported")
    act_order = stored.get("desc_act", False)
    if not isinstance(act_order, bool):
        raise UnsupportedModelError(f"quantization_config.desc_act {act_order!r} is not a bool")
    group = _group_size(stored.get("group_size"), "quantization_config.group_size")
    blocks = stored.get("modules_in_block_to_quantize")
    only = None
    if blocks is not None:
        if not isinstance(blocks, list) or not all(isinstance(b, list) for b in blocks):
            raise UnsupportedModelError("modules_in_block_to_quantize must be a list of lists")
        only = tuple(n for b in blocks for n in _names(b, "modules_in_block_to_quantize"))
    return W4Scheme(fmt, group, zeros=True, act_order=act_order, only=only)


def _pack_quantized(stored: dict[str, Any]) -> W4Scheme:
    sparsity = stored.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
        raise UnsupportedModelError(
            f"quantization_config.sparsity_config {sparsity!r} is not supported; supported: none"
            " or dense"
        )
    if stored.get("transform_config"):  # rotations (SpinQuant, QuIP) applied around the weights
        raise UnsupportedModelError("quantization_config.transform_config is not supported")
    group, weights = quant.config_group(stored, "pack-quantized", num_bits=4, kind="int")
    if group.get("format") not in (None, "pack-quantized"):
        raise UnsupportedModelError(f"config group format {group.get('format')!r} is mixed in")
    strategy = weights.get("strategy")
    if strategy == "group":
        size = _group_size(weights.get("group_size"), "weights.group_size")
    elif strategy == "channel":
        size = -1
    else:
        raise UnsupportedModelError(
            f"4-bit weights with strategy {strategy!r} are not supported; supported: group, channel"
        )
    if weights.get("dynamic") not in (None, False):
        raise UnsupportedModelError("dynamically quantized weights are not supported")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "static", "weight", "group"):
        raise UnsupportedModelError(f"weights.actorder {actorder!r} is not supported")
    for field in ("input_activations", "output_activations"):
        if group.get(field) is not None:
            raise UnsupportedModelError(
                f"{field} are quantized: only weight-only 4-bit (W4A16) is supported"
            )
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise UnsupportedModelError(f"weights.symmetric {symmetric!r} is not a bool")
    ignore = _names(stored.get("ignore"), "quantization_config.ignore")
    return W4Scheme("pack-quantized", size, zeros=not symmetric,
                    act_order=actorder == "group", ignore=ignore)  # fmt: skip


def replace_projections(
    model: nn.Module, scheme: W4Scheme, dtype: torch.dtype
) -> dict[str, W4Linear]:
    """Swap every projection `scheme` covers (on the meta device, before loading) for a
    W4Linear computing in `dtype`; returns them by name."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and scheme.covers(n)]
    layers = {}
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        layer = W4Linear(linear.in_features, linear.out_features, linear.bias is not None,
                         scheme.group(linear.in_features), scheme.zeros, scheme.act_order,
                         dtype)  # fmt: skip
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
        layers[name] = layer
    if not layers:
        raise UnsupportedModelError("the model has no projections to read as 4-bit")
    return layers


def _int32(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name} is {tensor.dtype}, a packed 4-bit tensor is int32")
    return tensor


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols/8] int32 in AWQ's interleaved order -> [rows, cols] uint8."""
    nibbles = unpack(packed).view(packed.shape[0], -1, PACK)  # [rows, cols/8, 8]: nibble order
    return nibbles[..., list(_AWQ_COLUMNS)].reshape(packed.shape[0], -1)


def convert(
    scheme: W4Scheme, layer: W4Linear, name: str, tensor: torch.Tensor, dtype: torch.dtype
) -> tuple[str, torch.Tensor] | None:
    """Checkpoint tensor `name` (`<module>.<part>`) of a 4-bit projection as (the layer's
    state name, its value in the packed layout), or None for a tensor read past or checked."""
    module, _, part = name.rpartition(".")
    fmt = scheme.format
    value: torch.Tensor
    if part == "bias":
        return f"{module}.bias", tensor.to(dtype)
    if fmt == "pack-quantized":
        renamed = {"weight_packed": "qweight", "weight_scale": "scales",
                   "weight_zero_point": "qzeros", "weight_g_idx": "g_idx"}  # fmt: skip
        if part == "weight_shape":
            if tensor.tolist() != [layer.out_features, layer.in_features]:
                raise ValueError(f"{name} is {tensor.tolist()}, the model's projection is"
                                 f" {[layer.out_features, layer.in_features]}")  # fmt: skip
            return None
        if part == "weight_zero_point" and not scheme.zeros:
            return None  # symmetric: zero by definition
        if part not in renamed:
            raise ValueError(f"unexpected tensor {name} in a pack-quantized checkpoint")
        part = renamed[part]
        if part == "qweight":
            value = _int32(tensor, name)
        elif part == "qzeros":  # signed + 8, packed down the rows: [out/8, groups]
            value = unpack(_int32(tensor, name).t().contiguous()).t().contiguous()
        else:
            value = tensor
    elif part not in ("qweight", "qzeros", "scales", "g_idx"):
        raise ValueError(f"unexpected tensor {name} in a {fmt} checkpoint")
    elif fmt == "awq":
        if part == "qweight":  # [in, out/8] -> [out, in/8]
            value = pack(_awq_unpack(_int32(tensor, name)).t())
        elif part == "qzeros":  # [groups, out/8] -> [out, groups]
            value = _awq_unpack(_int32(tensor, name)).t().contiguous()
        elif part == "scales":
            value = tensor.t().contiguous()
        else:
            raise ValueError(f"unexpected tensor {name} in an AWQ checkpoint")
    elif part == "qweight":  # GPTQ: [in/8, out], in order down the inputs: the layout's .t()
        value = _int32(tensor, name).t().contiguous()
    elif part == "qzeros":
        zeros = unpack(_int32(tensor, name)).t()  # [out, groups]
        value = (zeros + 1 if fmt == "gptq" else zeros).contiguous()  # v1 stores z - 1
    elif part == "scales":
        value = tensor.t().contiguous()
    else:
        value = tensor
    if part == "g_idx":
        return _g_idx(scheme, layer, name, value)
    if part == "scales" and not value.is_floating_point():
        raise ValueError(f"{name} is {value.dtype}, scales are floating point")
    return f"{module}.{part}", value


def _g_idx(
    scheme: W4Scheme, layer: W4Linear, name: str, g_idx: torch.Tensor
) -> tuple[str, torch.Tensor] | None:
    """Act-order keeps the column-to-group map; otherwise it must be the trivial one."""
    groups = layer.in_features // layer.group_size
    if g_idx.shape != (layer.in_features,) or g_idx.is_floating_point():
        raise ValueError(f"{name} must be {layer.in_features} integers, is {tuple(g_idx.shape)}"
                         f" {g_idx.dtype}")  # fmt: skip
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{name} names groups outside [0, {groups})")
    if scheme.act_order:
        return f"{name.rpartition('.')[0]}.g_idx", g_idx.to(torch.int32)
    order = torch.arange(layer.in_features, device=g_idx.device) // layer.group_size
    if not torch.equal(g_idx.long(), order):
        raise ValueError(
            f"{name} is not in column order but the quantization_config has no act-order"
            ' (desc_act / actorder "group")'
        )
    return None
