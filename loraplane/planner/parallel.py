"""Tensor parallelism in the planner: what one rank of a split replica holds, and what its
collectives cost.

The data plane's split (loraplane/dataplane/parallel/shard.py, Megatron-style) gives each of N
ranks 1/N of the attention heads and MLP columns, max(1, kv_heads / N) KV heads (one head,
replicated, when there are fewer KV heads than ranks), ceil(vocab / N) rows of the embedding
and of the LM head, and every norm whole. An adapter follows vLLM's default layout:
column-parallel modules (q, k, v, gate, up) keep A whole and 1/N of B's rows, row-parallel
ones (o, down) 1/N of A's columns and B whole; a mixture of experts' experts split as that
MLP (1/N of each expert's columns, `moe_intermediate_size`), its router whole. All of that is
exactly the model of the rank's own shapes (`rank_shape`, as `shard.local_config` builds
it), so the planner's weights, KV bytes per token, adapter bytes and roofline read that shape
and stay exact per rank.

A step's collectives (parallel/layers.py): an all-reduce of the embedding's output and two per
decoder layer (after o_proj, and after down_proj or a sparse layer's experts), each of [tokens,
hidden] in the model's dtype, and an all-gather of the sampled rows' logits ([rows, vocab / N]
from each rank). Their cost (`collective_seconds`) is a ring's: an all-reduce moves 2 (N - 1) /
N of its bytes over each GPU's link, an all-gather (N - 1) / N of the gathered bytes, each at
the link's rate times an efficiency, plus a fixed latency per collective. The collectives are
not overlapped with compute (the data plane runs them in line). Link rates and the latency are
data-sheet assumptions (`cost.GPUS`), not yet measured on a GPU.

Torch-free: the data plane's rules are mirrored here, and tests check them against each other.
"""

from __future__ import annotations

import dataclasses
import functools

from loraplane.adapters.base_model import tensor_parallel_problem
from loraplane.planner.shapes import ModelShape

TP_SIZES = (1, 2, 4, 8)  # the layouts the recommendation tries: GPUs of one node


class TensorParallelRefused(ValueError):
    """A model the data plane cannot split over that many ranks (the message says why)."""


def check_split(shape: ModelShape, size: int) -> None:
    """TensorParallelRefused naming why `shape` cannot be split over `size` ranks, as
    `loraplane serve --tensor-parallel-size` refuses it."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TensorParallelRefused(f"--tensor-parallel-size must be a positive integer: {size!r}")
    if size == 1:
        return
    problem = tensor_parallel_problem(
        shape.model_type, shape.num_heads, shape.num_kv_heads, shape.intermediate_size, size,
        shape.moe_intermediate_size,
    )  # fmt: skip
    if problem is not None:
        raise TensorParallelRefused(f"{problem} ({shape.name})")


@functools.lru_cache(maxsize=64)
def rank_shape(shape: ModelShape, size: int) -> ModelShape:
    """The shapes one of `size` ranks holds (`check_split` first): its heads, KV heads, MLP
    columns and vocabulary rows (padded, as every rank's slice is the same length). Its
    `num_params` are the rank's weights, its KV bytes per token the rank's, and an adapter's
    elements on it the rank's slices (A and B of the local in and out features)."""
    check_split(shape, size)
    if size == 1:
        return shape
    spec = shape.spec
    local = dataclasses.replace(
        spec,
        name=f"{spec.name} (1 of {size} ranks)",
        num_heads=spec.num_heads // size,
        num_kv_heads=max(1, spec.num_kv_heads // size),
        intermediate_size=spec.intermediate_size // size,
        moe_intermediate_size=spec.moe_intermediate_size // size,  # each expert's columns
    )
    return dataclasses.replace(shape, spec=local, vocab_size=-(-shape.vocab_size // size))


@dataclasses.dataclass(frozen=True, slots=True)
class Collectives:
    """One step's collectives and the link they run over (see the module docstring)."""

    size: int  # ranks
    link: float  # bytes/s per direction per GPU (NVLink; PCIe where a GPU has no NVLink)
    latency_s: float  # fixed cost of one collective
    efficiency: float = 0.8  # share of `link` a ring reaches

    def all_reduce_seconds(self, nbytes: float) -> float:
        """A ring all-reduce of `nbytes` on each rank."""
        if self.size == 1:
            return 0.0
        moved = 2 * (self.size - 1) / self.size * nbytes
        return self.latency_s + moved / (self.link * self.efficiency)

    def all_gather_seconds(self, nbytes: float) -> float:
        """A ring all-gather whose gathered result is `nbytes` on each rank."""
        if self.size == 1:
            return 0.0
        moved = (self.size - 1) / self.size * nbytes
        return self.latency_s + moved / (self.link * self.efficiency)

    def step_seconds(self, shape: ModelShape, elt: int, tokens: int, rows: int) -> float:
        """The collectives of a step of `tokens` tokens whose `rows` rows sample: 2 per layer
        and the embedding's all-reduce of [tokens, hidden], the logits' all-gather."""
        if self.size == 1:
            return 0.0
        activations = tokens * shape.hidden_size * elt
        logits = rows * rank_shape(shape, self.size).vocab_size * self.size * elt
        reduces = 2 * shape.num_layers + 1
        return reduces * self.all_reduce_seconds(activations) + self.all_gather_seconds(logits)
