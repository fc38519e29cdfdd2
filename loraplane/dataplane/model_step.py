"""The model's part of a step, the same on every tensor-parallel rank: build the (sharded)
model with its LoRA slots, and run a planned step through it.

The model runner (rank 0) decides a step (`StepPlan`: the rows, their adapter slots, which
rows sample, which want prompt log-probabilities) and runs `run_plan`; with tensor parallelism
every worker runs `run_plan` on the same plan, so each collective in the forward pass and in
the logits happens in the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane import kv_quant
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cuda_graphs import DecodeGraphs
from loraplane.dataplane.host_copy import HostCopy, to_device
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora.layers import install_lora
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.models.loader import load_model
from loraplane.dataplane.parallel.comm import Collectives
from loraplane.dataplane.parallel.layers import parallelize
from loraplane.dataplane.parallel.shard import ROW_PARALLEL, TPShard, local_spec
from loraplane.dataplane.prompt_logprobs import PromptScores, PromptSpan, score_prompts
from loraplane.dataplane.step_metadata import StepRow, build_step

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class PromptRow:
    """Row `row` of a step wants log-probabilities of prompt tokens `first`.. (`tokens`)."""

    row: int
    request_id: str
    first: int
    tokens: list[int]
    top: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A scheduled step as the model sees it (plain data: it is sent to the workers)."""

    rows: list[StepRow]
    with_lora: bool  # some row has an adapter
    sample: list[bool]  # per row: its last token's logits are sampled
    prompt: list[PromptRow] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A step's logits, fp32 on the model's device (the sampler reads them there)."""

    sampled: torch.Tensor  # [len(out.sampled), vocab]: the rows that sample, in order
    # request id -> the step's scores of its prompt tokens (reduced on the device), for
    # requests that want prompt log-probabilities
    prompt: dict[str, PromptScores] = field(default_factory=dict)


@dataclass(slots=True)
class BuiltModel:
    """One rank's model with its LoRA layers installed over `pool`."""

    model: LlamaForCausalLM
    pool: LoRAPool
    spec: BaseModelSpec  # the whole base's shapes (adapters are validated against these)
    vocab_size: int  # columns of the logits (the model's vocabulary, padding included)


def build_model(
    config: EngineConfig,
    device: torch.device,
    shard: TPShard | None = None,
    comm: Collectives | None = None,
) -> BuiltModel:
    """Load the model (rank `shard.rank`'s part of it, when split), its LoRA pool of
    `config.lora_slots` slots shaped for that part, and the LoRA layers reading it; with
    `comm`, the vocabulary-parallel embedding and head and the row-parallel sums."""
    dtype = TORCH_DTYPES[config.dtype]
    model = load_model(config.model, dtype, device, config.quantization, shard)
    model.kv_cache_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, dtype, device)
    spec = BaseModelSpec.from_dir(config.model, name=config.served_model_name)
    part = spec if shard is None else local_spec(spec, shard)
    layout = dispatch.b_transposed(dtype, device)  # B as the kernels picked for it read it
    # split rows: a DoRA g there is summed over the ranks when it takes a slot (sync_norms)
    summed = frozenset() if shard is None or shard.size == 1 else frozenset(ROW_PARALLEL)
    pool = LoRAPool(config.lora_slots, part, dtype, device, b_transposed=layout, summed=summed)
    install_lora(model, pool)
    vocab = int(model.config.vocab_size)
    if comm is not None:
        parallelize(model, vocab, comm)
    return BuiltModel(model, pool, spec, vocab)


def run_plan(
    model: LlamaForCausalLM,
    plan: StepPlan,
    block_size: int,
    host_copy: HostCopy,
    graphs: DecodeGraphs | None = None,
) -> StepLogits:
    """Run `plan` through `model`; return the sampled rows' fp32 logits (on the device) and
    the prompt scores (prompt_logprobs.py) of the rows that want them, on the host (one copy
    through `host_copy`)."""
    device = model.lm_head.weight.device
    hidden = None
    if graphs is not None:  # decode rows only, so no prompt log-probabilities
        hidden = graphs.run(plan.rows)
    if hidden is not None:
        cu = list(range(len(plan.rows) + 1))
    else:
        step = build_step(plan.rows, block_size, device, with_lora=plan.with_lora)
        hidden = model(step.input_ids, step.positions, step.attn, step.lora)
        cu = step.attn.host_cu_seqlens_q
    spans = [PromptSpan(p.request_id, p.first, cu[p.row], p.tokens, p.top) for p in plan.prompt]
    # reduced on the device, in bounded slices of rows: no full prompt logits reach the host
    prompt = score_prompts(spans, hidden, model.compute_logits, host_copy)
    last = [cu[i + 1] - 1 for i, sample in enumerate(plan.sample) if sample]
    if not last:
        vocab = int(model.config.vocab_size)
        sampled = torch.empty(0, vocab, dtype=torch.float32, device=device)
    elif len(last) == hidden.shape[0]:  # a decode step: every row samples
        sampled = model.compute_logits(hidden).float()
    else:
        sampled = model.compute_logits(hidden[to_device(last, torch.long, device)]).float()
    return StepLogits(sampled, prompt)  # on the device: the sampler reads it there
