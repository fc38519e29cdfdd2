"""Which slice of every weight and adapter tensor a tensor-parallel rank holds.

Pure functions over shapes and tensors (no process group): the loader asks `checkpoint_slice`
for each checkpoint tensor, rank 0's LoRA manager `shard_adapter` for its own part of each
adapter it reads and for the workers' parts (`ship.py` packs them to ship at placement), the
model runner `local_config` / `local_spec` for the shapes a rank builds.

Column-parallel (output rows split): q_proj, k_proj, v_proj, gate_proj, up_proj and their
biases. Row-parallel (input columns split, outputs summed across ranks): o_proj, down_proj;
their bias is held by rank 0 only, so the sum adds it once. Vocabulary-parallel: the
embedding and lm_head rows, `ceil(vocab / size)` per rank, the last rank's tail zero padding.
A mixture of experts splits every expert as a dense MLP (models/moe.py): its gate and up
(Mixtral's w1, w3) by output rows, its down (w2) by input columns, so each rank computes
every routed row through its slice of the expert and the all-reduce after the weighted sum
of the experts adds the slices up; the router (`gate`) is replicated, so every rank routes
every token alike. Everything else (norms, Qwen3's per-head q/k norms) is replicated. A
module is split by its last name (`experts.3.w1` as `w1`), adapters' factors alike.
An FP8 projection's weight splits as a 16-bit one, its per-channel scales ([out, 1]) with its
output rows (whole in a row-parallel one) and a per-tensor scale is kept by every rank, so
each rank's slice dequantizes to the slice of the dequantized weight. A 4-bit projection
(`packed_slice`) splits in its packed layout: the packed words and group scales with their
rows or input columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from loraplane.adapters.base_model import BaseModelSpec, tensor_parallel_problem
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights
from loraplane.dataplane.models.config import ModelConfig, UnsupportedModelError

# Phi-3's fused qkv_proj ([q | k | v] rows) and gate_up_proj ([gate | up]) split part by part;
# Mixtral's experts' w1 (gate), w3 (up), w2 (down) as the dense names
COLUMN_PARALLEL = (
    "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj", "w1", "w3",
)  # fmt: skip
ROW_PARALLEL = ("o_proj", "down_proj", "w2")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` processes."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def part(self, length: int) -> slice:
        """This rank's equal share of `length` (which `size` divides)."""
        step = length // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def kv_part(self, length: int, kv_heads: int) -> slice:
        """This rank's rows of a k_proj / v_proj output of `length` rows over `kv_heads` heads:
        an equal share, or (fewer heads than ranks) the one head its query heads read, each
        head then held by `size // kv_heads` ranks."""
        if kv_heads % self.size == 0:
            return self.part(length)
        rows = length // kv_heads
        head = self.rank // (self.size // kv_heads)
        return slice(head * rows, (head + 1) * rows)

    def vocab_part(self, vocab: int) -> tuple[int, int, int]:
        """(start, stop, rows): the vocabulary ids this rank holds, and the rows of its padded
        slice (the same on every rank: the gathered logits are `rows * size` wide)."""
        rows = -(-vocab // self.size)
        start = min(vocab, self.rank * rows)
        return start, min(vocab, start + rows), rows


def check_supported(config: ModelConfig, size: int) -> None:
    """UnsupportedModelError naming why `config` cannot be split over `size` ranks."""
    problem = tensor_parallel_problem(
        config.model_type, config.num_heads, config.num_kv_heads, config.intermediate_size, size,
        _moe_width(config),
    )  # fmt: skip
    if problem is not None:
        raise UnsupportedModelError(problem)


def _moe_width(config: ModelConfig) -> int:
    """One expert's intermediate size (models/moe.MoEConfig), 0 for a dense model."""
    return int(getattr(config, "moe_intermediate_size", 0))


def local_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The shapes rank `shard.rank` builds: its heads and MLP columns, each expert's too (the
    vocabulary is split by the vocab-parallel layers, not here)."""
    if shard.size == 1:
        return config
    changes: dict[str, Any] = {
        "num_heads": config.num_heads // shard.size,
        "num_kv_heads": max(1, config.num_kv_heads // shard.size),
        "intermediate_size": config.intermediate_size // shard.size,
    }
    if _moe_width(config):  # a MoEConfig (models/moe.py): its experts' columns
        changes["moe_intermediate_size"] = _moe_width(config) // shard.size
    return dataclasses.replace(config, **changes)


def local_spec(spec: BaseModelSpec, shard: TPShard) -> BaseModelSpec:
    """The adaptable layers' shapes on one rank: what its LoRA pool's slots hold."""
    if shard.size == 1:
        return spec
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // shard.size,
        num_kv_heads=max(1, spec.num_kv_heads // shard.size),
        intermediate_size=spec.intermediate_size // shard.size,
        moe_intermediate_size=spec.moe_intermediate_size // shard.size,
    )


def _projection(name: str) -> tuple[str, str] | None:
    """(module, "weight" | "bias") of a decoder projection's tensor, else None."""
    module, _, part = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if not module.startswith("model.layers.") or leaf not in COLUMN_PARALLEL + ROW_PARALLEL:
        return None
    return leaf, part


@dataclass(frozen=True, slots=True)
class Heads:
    """A model's attention heads, what the split of its q/k/v rows depends on."""

    num_heads: int
    num_kv_heads: int


def heads_of(spec: BaseModelSpec) -> Heads:
    """The heads of the base `spec` describes."""
    return Heads(spec.num_heads, spec.num_kv_heads)


def _shift(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)


def _rows(module: str, length: int, shard: TPShard, heads: Heads) -> list[slice]:
    """A column-parallel module's output rows on this rank (several runs for a fused one)."""
    kv = heads.num_kv_heads
    if module in ("k_proj", "v_proj"):
        return [shard.kv_part(length, kv)]
    if module == "qkv_proj":  # [q | k | v], each part split as its own projection's
        head_dim = length // (heads.num_heads + 2 * kv)
        q, kv_rows = heads.num_heads * head_dim, kv * head_dim
        kv_part = shard.kv_part(kv_rows, kv)
        return [shard.part(q), _shift(kv_part, q), _shift(kv_part, q + kv_rows)]
    if module == "gate_up_proj":  # [gate | up]
        half = length // 2
        return [shard.part(half), _shift(shard.part(half), half)]
    return [shard.part(length)]


def _take_rows(tensor: torch.Tensor, runs: list[slice]) -> torch.Tensor:
    return tensor[runs[0]] if len(runs) == 1 else torch.cat([tensor[r] for r in runs])


def checkpoint_slice(name: str, tensor: torch.Tensor, shard: TPShard, heads: Heads) -> torch.Tensor:
    """Rank `shard.rank`'s part of checkpoint tensor `name` (the tensor itself when whole)
    of a model with `heads`."""
    if shard.size == 1:
        return tensor
    if name in VOCAB_PARALLEL:
        start, stop, rows = shard.vocab_part(tensor.shape[0])
        if stop - start == rows:
            return tensor[start:stop]
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: stop - start] = tensor[start:stop]
        return padded
    found = _projection(name)
    if found is None:
        return tensor
    leaf, kind = found
    if kind == "weight_scale" and tensor.dim() == 0:
        return tensor  # an FP8 weight's one scale: every rank's slice keeps it
    if leaf in COLUMN_PARALLEL:  # output rows (a bias, an FP8 [out, 1] scale: its entries)
        return _take_rows(tensor, _rows(leaf, tensor.shape[0], shard, heads))
    if kind == "bias":  # row-parallel: added once, by rank 0, to the summed output
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    if kind == "weight_scale":  # row-parallel, per output row: the rows are whole
        return tensor
    return tensor[:, shard.part(tensor.shape[1])]


def _block_runs(
    name: str, shard: TPShard, heads: Heads, block: tuple[int, int], weight_shape: tuple[int, int]
) -> tuple[int, list[slice], int]:
    """(axis, the rank's runs along it, the scale block's length along it) of a block-wise FP8
    projection: output rows (axis 0) of a column-parallel one, input columns (axis 1) of a
    row-parallel one. A fused projection's several runs must start and end on block edges
    (ValueError otherwise, naming them); a single run may start inside a block."""
    found = _projection(name)
    assert found is not None, name
    leaf, _ = found
    out, inputs = weight_shape
    if leaf in COLUMN_PARALLEL:
        axis, runs, unit, length = 0, _rows(leaf, out, shard, heads), block[0], out
    else:
        axis, runs, unit, length = 1, [shard.part(inputs)], block[1], inputs
    if len(runs) > 1:
        for run in runs:
            if run.start % unit or (run.stop % unit and run.stop != length):
                raise ValueError(
                    f"{name}: rank {shard.rank}'s slice {run.start}:{run.stop} of the fused"
                    f" projection's {length} does not fall on the FP8 scale blocks of {unit}"
                )
    return axis, runs, unit


def block_offset(
    name: str, shard: TPShard, heads: Heads, block: tuple[int, int], weight_shape: tuple[int, int]
) -> tuple[int, int]:
    """(rows, columns) by which rank `shard.rank`'s slice of a block-wise FP8 projection's
    weight `name` (of `weight_shape`) starts inside its first scale block: a rank's rows or inputs
    need not be whole blocks, its factors are the blocks its slice touches
    (`block_scale_slice`), read from that offset (models/quant.py FP8Linear)."""
    if shard.size == 1 or _projection(name) is None:
        return 0, 0
    axis, runs, unit = _block_runs(name, shard, heads, block, weight_shape)
    start = runs[0].start % unit if len(runs) == 1 else 0
    return (start, 0) if axis == 0 else (0, start)


def block_scale_slice(
    name: str, scale: torch.Tensor, shard: TPShard, heads: Heads, block: tuple[int, int],
    weight_shape: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """Rank `shard.rank`'s part of a block-wise FP8 projection's scale `name` ([ceil(out / bn),
    ceil(in / bk)], one factor per block of its weight of `weight_shape`): the blocks that the
    rows (column-parallel) or input columns (row-parallel) of the rank's weight slice touch,
    from the block its slice starts in (`block_offset` says where in it)."""
    if shard.size == 1 or _projection(name) is None:
        return scale
    axis, runs, unit = _block_runs(name, shard, heads, block, weight_shape)
    parts = [slice(run.start // unit, -(-run.stop // unit)) for run in runs]
    if axis == 0:
        return _take_rows(scale, parts)
    return scale[:, parts[0]]


def packed_slice(
    name: str, tensor: torch.Tensor, shard: TPShard, heads: Heads, whole_groups: bool
) -> torch.Tensor:
    """Rank `shard.rank`'s part of a 4-bit projection's tensor `name` in models/quant_w4.py's
    packed layout (qweight [out, in/8], scales and qzeros [out, groups], g_idx [in], bias).
    Column-parallel: the rows of each, g_idx whole. Row-parallel: qweight's words and g_idx's
    entries of this rank's input columns, the groups of its columns (`whole_groups`: every
    group, kept whole: an act-order map sends a rank's columns to any group, and one group per
    row spans every rank's columns)."""
    found = _projection(name)
    if shard.size == 1 or found is None:
        return tensor
    leaf, kind = found
    if kind == "bias":
        return checkpoint_slice(name, tensor, shard, heads)
    if leaf in COLUMN_PARALLEL:
        return tensor if kind == "g_idx" else _take_rows(tensor, _rows(leaf, tensor.shape[0],
                                                                      shard, heads))  # fmt: skip
    if kind == "g_idx":
        return tensor[shard.part(tensor.shape[0])]
    if kind in ("scales", "qzeros") and whole_groups:
        return tensor
    return tensor[:, shard.part(tensor.shape[1])]


def shard_adapter(adapter: LoadedAdapter, shard: TPShard, heads: Heads) -> LoadedAdapter:
    """`adapter`'s part on this rank (vLLM's default layout): a column-parallel module keeps A
    whole and its slice of B's rows, a row-parallel one its slice of A's columns and B whole;
    a DoRA magnitude goes with B's rows.
    Slices are copied (contiguous), so the pool's host form reads them as one run each."""
    if shard.size == 1:
        return adapter
    modules = {}
    for (layer, module), w in adapter.modules.items():
        leaf = module.rpartition(".")[2]  # an expert's linear (`experts.N.w1`) by its name
        m = w.magnitude  # DoRA's [out]: with B's rows
        if leaf in COLUMN_PARALLEL:
            runs = _rows(leaf, w.b.shape[0], shard, heads)
            a, b = w.a, _take_rows(w.b, runs).contiguous()
            m = None if m is None else _take_rows(m, runs).contiguous()
        elif leaf in ROW_PARALLEL:
            a, b = w.a[:, shard.part(w.a.shape[1])].contiguous(), w.b
        else:  # pragma: no cover - check_supported refused such models
            raise UnsupportedModelError(f"module {module!r} cannot be split for tensor parallelism")
        modules[(layer, module)] = LoRAWeights(a=a, b=b, scale=w.scale, magnitude=m)
    return LoadedAdapter(adapter.source, modules, adapter.digest)
