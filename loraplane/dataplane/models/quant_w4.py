"""4-bit base weights with group scales (W4A16, issue 31): the layer, and the one packed layout
every 4-bit checkpoint format is converted to as it is read (models/w4_formats.py).

The layout is compressed-tensors' pack-quantized one, with unsigned nibbles:

    qweight  int32 [out, in / 8]    W's element (o, i) is u = bits 4*(i % 8) .. +3 of
                                    qweight[o, i // 8], an unsigned nibble in [0, 16)
    scales   float [out, groups]    as the checkpoint stores them (fp16, bf16 or fp32)
    qzeros   uint8 [out, groups]    the zero point z (absent: symmetric, z = 8)
    g_idx    int32 [in]             column i's group (absent: i // group_size)

    W[o, i] = (u[o, i] - z[o, g(i)]) * s[o, g(i)]          in fp32, then to the activation dtype

A projection computes y = x @ W.to(x.dtype)^T (+ bias): what transformers computes on the same
weights dequantized, so HF on the dequantized checkpoint is the reference. Activations are not
quantized (W4A16) and LoRA, applied around this layer by lora/layers.py, reads them as they are
and keeps the adapters in the activation dtype. The weight takes half a byte per parameter on
the device plus a scale (and a zero byte) per group of each row.

On CPU the torch path dequantizes per call (each call rebuilds the layer's full weight); on CUDA
the Triton kernel of kernels/w4a16_triton.py dequantizes tile by tile inside the product and
never writes the full weight. `LORAPLANE_W4` (auto, torch, triton; read when the layer is built)
picks one: auto is Triton for CUDA tensors when Triton is installed, torch otherwise.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from loraplane.dataplane.kernels import backends
from loraplane.dataplane.models.config import UnsupportedModelError

PACK = 8  # nibbles per int32
W4_ENV = "LORAPLANE_W4"
W4_BACKENDS = ("auto", "torch", "triton")
SYMMETRIC_ZERO = 8  # the zero point of a symmetric scheme, in unsigned nibbles


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 -> [rows, cols] uint8: nibble k of each word (bits 4k..4k+3) is
    column 8 * word + k."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, cols / 8, 8]
    return nibbles.to(torch.uint8).reshape(packed.shape[0], -1)


def pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of values in [0, 16) -> [rows, cols / 8] int32, the inverse of `unpack`."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"{cols} columns do not pack by {PACK}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)  # [8]
    words = (values.to(torch.int64).reshape(rows, cols // PACK, PACK) << shifts).sum(-1)
    # [0, 2^32) as the int32 of the same bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@functools.cache
def _byte_nibbles(device: torch.device) -> torch.Tensor:  # [256, 2]
    """Byte b -> (its low nibble, its high nibble) as floats."""
    b = torch.arange(256)
    return torch.stack([b & 0xF, b >> 4], dim=1).float().to(device)


def _nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """`unpack(qweight)` as fp32 [out, in]. On a little-endian host byte j of a word holds its
    nibbles 2j (low) and 2j + 1 (high), so one table lookup per byte unpacks two at once: about
    1.6x faster on CPU than shifting and masking each nibble (4096 x 4096, 2 threads)."""
    if sys.byteorder != "little" or not qweight.is_contiguous():
        return unpack(qweight).float()
    pairs = F.embedding(qweight.view(torch.uint8).long(), _byte_nibbles(qweight.device))
    return pairs.reshape(qweight.shape[0], -1)  # [out, in / 2, 2] -> [out, in]


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The fp32 [out, in] weight of the packed layout (module docstring)."""
    w = _nibbles(qweight)  # [out, in], a fresh tensor: updated in place below
    out, groups = scales.shape
    if g_idx is None:  # contiguous groups: broadcast each group's scale over its columns
        grouped = w.view(out, groups, -1)  # [out, groups, group_size]
        grouped.sub_(SYMMETRIC_ZERO if qzeros is None else qzeros.float().unsqueeze(-1))
        grouped.mul_(scales.float().unsqueeze(-1))
        return w
    cols = g_idx.long()  # [in]: act-order, each column's group read by index
    w.sub_(SYMMETRIC_ZERO if qzeros is None else qzeros[:, cols].float())
    return w.mul_(scales[:, cols].float())


@functools.cache
def _triton_linear() -> Callable[..., torch.Tensor]:
    from loraplane.dataplane.kernels.w4a16_triton import w4a16_linear  # imports Triton

    return w4a16_linear


class W4Linear(nn.Linear):
    """A projection whose weight is 4-bit (packed eight to an int32) with a float scale per
    group of `group_size` input columns of each row, and optionally a zero point per group and
    a column-to-group map (act-order); it computes in `compute_dtype`, the model's.

    An nn.Linear to the LoRA wrapper (lora/layers.py), as FP8Linear is: `in_features`,
    `out_features`, `compute_dtype` and `weight` (the dequantized weight, rebuilt on each read;
    what the wrapper reads is its device) are the unquantized layer's."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group_size: int, zeros: bool,
        act_order: bool, compute_dtype: torch.dtype,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-size weight
        if in_features % PACK or in_features % group_size:
            raise UnsupportedModelError(
                f"a 4-bit projection of {in_features} inputs does not split into groups of"
                f" {group_size} packed {PACK} to an int32"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        self.backend = backends.read_choice(W4_ENV, W4_BACKENDS)  # once, not per call
        groups = in_features // group_size
        self.qweight: torch.Tensor
        self.register_buffer("qweight", torch.zeros(out_features, in_features // PACK,
                                                    dtype=torch.int32))  # fmt: skip
        self.scales: torch.Tensor
        self.register_buffer("scales", torch.ones(out_features, groups))
        self.qzeros: torch.Tensor | None
        self.register_buffer(
            "qzeros", torch.zeros(out_features, groups, dtype=torch.uint8) if zeros else None
        )
        self.g_idx: torch.Tensor | None
        self.register_buffer(
            "g_idx", torch.zeros(in_features, dtype=torch.int32) if act_order else None
        )
        bias_value = torch.zeros(out_features, dtype=compute_dtype) if bias else None
        self.register_parameter(
            "bias", None if bias_value is None else nn.Parameter(bias_value, requires_grad=False)
        )

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]  # nn.Linear's is stored
        # [out, in]
        """The weight as the model computes with it, dequantized (a full-size copy)."""
        return self.dequantized()

    def hold_groups(self, groups: int) -> None:
        """Scales (and zero points) for `groups` groups, not `in_features / group_size`: a
        tensor-parallel slice of an act-order layer's input columns, whose map (g_idx) sends
        them to any of the whole layer's groups. Called on the meta device, before loading."""
        self.scales = torch.ones(self.out_features, groups, device=self.scales.device)
        if self.qzeros is not None:
            self.qzeros = torch.zeros(self.out_features, groups, dtype=torch.uint8,
                                      device=self.qzeros.device)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """The weight as the model computes with it: (u - z) * s in compute_dtype."""
        return dequantize(self.qweight, self.scales, self.qzeros, self.g_idx).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if backends.resolve(self.backend, x) == "triton":
            return _triton_linear()(x, self.qweight, self.scales, self.qzeros, self.g_idx,
                                    self.group_size, self.bias)  # fmt: skip
        w = dequantize(self.qweight, self.scales, self.qzeros, self.g_idx)
        return F.linear(x, w.to(x.dtype), self.bias)

    def device_bytes(self) -> int:
        """Bytes this layer holds on its device (packed weight, scales, zeros, map, bias)."""
        held = [self.qweight, self.scales, self.qzeros, self.g_idx, self.bias]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def extra_repr(self) -> str:
        zeros = "asymmetric" if self.qzeros is not None else "symmetric"
        order = ", act-order" if self.g_idx is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features},"
            f" bias={self.bias is not None}, int4 group {self.group_size}, {zeros}{order}"
        )
