"""The modules a tensor-parallel rank swaps into a Llama-family model.

`parallelize` runs after the rank's shard is built and loaded (the loader slices the
checkpoint, parallel/shard.py) and after `install_lora`: it replaces the embedding and lm_head
with their vocabulary-parallel forms and sums the row-parallel projections' outputs (the LoRA
wrapper's, so each rank's B(A_r x_r) joins the sum) with a forward hook. A mixture of experts'
sparse block is summed as a whole, once, after it weighs and adds its experts' rows (each
rank's rows are partial sums through its slices of the experts, their expert LoRA included;
the weighted sum is linear in them): one all-reduce per layer, as a dense MLP's. Module names
stay the checkpoint's, so nothing else in the engine sees a difference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.models.moe import SparseMoeBlock
from loraplane.dataplane.parallel.comm import Collectives


class VocabParallelEmbedding(nn.Module):
    """Rows start..stop of the embedding (padded to `rows`); ids outside give zeros, and the
    all-reduce sums every rank's rows into the full lookup."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.stop = start, stop
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class VocabParallelHead(nn.Module):
    """lm_head rows of this rank's vocabulary slice; the logits of every rank gathered side
    by side and trimmed to the vocabulary (the padding's columns dropped)."""

    def __init__(self, weight: torch.Tensor, vocab: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab = vocab
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        local = F.linear(hidden, self.weight)
        return self.comm.all_gather_last(local)[..., : self.vocab]


def _sum_hook(comm: Collectives) -> Any:
    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(output)

    return hook


def parallelize(model: LlamaForCausalLM, vocab: int, comm: Collectives) -> None:
    """Swap in the vocabulary-parallel embedding and head, and sum the row-parallel outputs
    (`model` holds this rank's shard, as the loader built it with `shard`)."""
    start, stop, _ = comm.shard.vocab_part(vocab)
    embedding = VocabParallelEmbedding(model.model.embed_tokens.weight, start, stop, comm)
    model.model.embed_tokens = embedding  # type: ignore[assignment]
    head_weight = embedding.weight if model.config.tie_word_embeddings else model.lm_head.weight
    model.lm_head = VocabParallelHead(head_weight, vocab, comm)  # type: ignore[assignment]
    for layer in model.model.decoder_layers:
        # the feed-forward block: a dense MLP, or a sparse layer's experts (models/moe.py)
        ffn = getattr(layer, getattr(layer, "block_name", "mlp"))
        down = ffn if isinstance(ffn, SparseMoeBlock) else ffn.down_proj
        for module in (layer.self_attn.o_proj, down):
            module.register_forward_hook(_sum_hook(comm))
