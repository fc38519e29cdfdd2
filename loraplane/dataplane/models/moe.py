"""Mixture-of-experts decoders: Mixtral (`mixtral`) and Qwen3-MoE (`qwen3_moe`).

Attention, norms and RoPE are llama.py's (Mixtral's attention is Mistral's, Qwen3-MoE's is
Qwen3's, q/k head norms included); a sparse layer's MLP is a `SparseMoeBlock`:

    probs = softmax(fp32(gate(x)))                  # the router: over all experts
    w, e = topk(probs, k)                           # k experts per token
    w = w / sum(w)                                  # Mixtral always; Qwen3-MoE if norm_topk_prob
    out = sum_j w_j * down_e_j(silu(gate_e_j(x)) * up_e_j(x))

as transformers 5 computes it (Mixtral multiplies by the fp32 weights, Qwen3-MoE by weights
cast to the activations' dtype; each token's experts are added in ascending expert order).
Experts are kept one module each, named as checkpoints (and 4.x adapters) name them:
Mixtral `block_sparse_moe.experts.N.{w1,w3,w2}`, Qwen3-MoE `mlp.experts.N.{gate,up,down}_proj`
(transformers 5 packs them in memory but saves them this way), so weights load by name. An
FP8 checkpoint's experts (or `--quantization fp8`) are models/quant.py's FP8Linear, one per
expert, as the dense projections are; the routers stay 16-bit.

LoRA: attention projections are wrapped as in every family (`LinearWithLoRA`); the experts'
adapters are applied by the block itself (`lora/experts.py`), rows grouped by (expert, adapter
slot). The router is never adapted: it decides which experts every tenant's tokens reach.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.lora.experts import ExpertLoRA, RoutedRows, route_rows
from loraplane.dataplane.lora.layers import LoRAContext
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.models.config import ModelConfig, UnsupportedModelError
from loraplane.dataplane.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# per family: the block holding router and experts, one expert's (gate, up, down) names
EXPERT_LAYOUT = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
# the dense family whose attention and RoPE reading each MoE family shares
_ATTENTION_OF = {"mixtral": "mistral", "qwen3_moe": "qwen3"}


def _count(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UnsupportedModelError(f"config.json field {key!r} must be an int >= 0: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class MoEConfig(ModelConfig):
    """A ModelConfig with the sparse layers' routing and expert shapes."""

    num_experts: int = 0
    top_k: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is a SparseMoeBlock
    fp32_routing_weights: bool = True  # Mixtral; Qwen3-MoE casts them to the activations' dtype

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MoEConfig:
        """Parse a mixtral / qwen3_moe config.json (UnsupportedModelError naming the problem)."""
        model_type = config["model_type"]
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        dense = dict(config, model_type=_ATTENTION_OF[model_type])
        if config.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int):
            dense["head_dim"] = hidden // max(1, heads)  # both: hidden / heads when unset
        if model_type == "qwen3_moe" and not config.get("use_sliding_window", False):
            dense["sliding_window"] = None  # Qwen3MoeConfig drops it unless enabled
        base = ModelConfig.from_dict(dense)
        # transformers 5 calls both `num_local_experts`; Qwen's own configs say num_experts
        key = "num_local_experts" if "num_local_experts" in config else "num_experts"
        if model_type == "mixtral":
            experts = _count(config, key, 8)
            inter = base.intermediate_size
            layers = tuple(range(base.num_layers))
            norm = True
        else:
            experts = _count(config, key, 128)
            inter = _count(config, "moe_intermediate_size", 768)
            step = max(1, _count(config, "decoder_sparse_step", 1))
            dense_layers = config.get("mlp_only_layers") or []
            if not isinstance(dense_layers, list):
                raise UnsupportedModelError("config.json mlp_only_layers must be a list")
            layers = tuple(
                i
                for i in range(base.num_layers)
                if experts > 0 and i not in dense_layers and (i + 1) % step == 0
            )
            norm = bool(config.get("norm_topk_prob", False))
        top_k = _count(config, "num_experts_per_tok", 2)
        if layers and not 1 <= top_k <= experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts"
            )
        if layers and inter < 1:
            raise UnsupportedModelError("the experts' intermediate size must be >= 1")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        return cls(
            **{**fields, "model_type": model_type},
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=norm,
            moe_layers=layers,
            fp32_routing_weights=model_type == "mixtral",
        )


def _expert_mm(linear: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x W^T for one expert's rows: straight into `out` for a plain linear, through the
    layer's own forward for a quantized one (models/quant.py's FP8Linear: its W8A16 kernel on
    CUDA, the dequantized weight elsewhere)."""
    if type(linear) is nn.Linear:
        torch.mm(x, linear.weight.t(), out=out)
    else:
        out.copy_(linear(x))


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), its linears named as the checkpoint's."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name, (fan_in, fan_out) in zip(
            names, ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True
        ):
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down)."""
        gate, up, down = (getattr(self, n) for n in self.names)
        return gate, up, down


class SparseMoeBlock(nn.Module):
    """The router (`gate`, never adapted) and the experts of one sparse layer."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        _, names = EXPERT_LAYOUT[config.model_type]
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.fp32_weights = config.fp32_routing_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        inter = self.inter = config.moe_intermediate_size
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, inter, names) for _ in range(config.num_experts)
        )
        self.expert_list = [e for e in self.experts if isinstance(e, Expert)]
        self.lora: ExpertLoRA | None = None  # set by bind_expert_lora
        self.context: LoRAContext | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token, as the HF router picks them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = self.route(x)
        batch = self.context.batch if self.context is not None else None
        lora = self.lora if batch is not None and not batch.is_empty else None
        rows: RoutedRows = route_rows(
            experts,
            batch if lora is not None else None,
            self.num_experts,
            lora.num_slots if lora is not None else None,
        )
        lora_rows = rows.batch if lora is not None else None
        xs = x[rows.tokens]  # [T * k, hidden]: routed rows, sorted by (expert, slot)
        n = xs.shape[0]
        hits = [(e, rows.expert_bounds[e], rows.expert_bounds[e + 1]) for e in rows.experts_hit]
        linears = [self.expert_list[e].linears() for e, _, _ in hits]
        # each expert's linears over its rows, written into the layer's row buffers; the
        # adapters' deltas of every expert then in one call per linear (lora/experts.py)
        gate = xs.new_empty(n, self.inter)
        up = xs.new_empty(n, self.inter)
        for (_, start, end), (gate_l, up_l, _) in zip(hits, linears, strict=True):
            _expert_mm(gate_l, xs[start:end], gate[start:end])
            _expert_mm(up_l, xs[start:end], up[start:end])
        stamp = self.context.stamp if self.context is not None else None
        if lora is not None and lora_rows is not None:
            lora.apply_layer(gate, xs, 0, lora_rows, stamp)
            lora.apply_layer(up, xs, 1, lora_rows, stamp)
        h = F.silu(gate, inplace=True).mul_(up)  # silu(gate) * up
        y = xs.new_empty(n, x.shape[1])
        for (_, start, end), (_, _, down_l) in zip(hits, linears, strict=True):
            _expert_mm(down_l, h[start:end], y[start:end])
        if lora is not None and lora_rows is not None:
            lora.apply_layer(y, h, 2, lora_rows, stamp)
        return self._combine(x, y, weights, experts, rows)

    def _combine(
        self,
        x: torch.Tensor,  # [T, hidden]
        y: torch.Tensor,  # [T * k, hidden]: the routed rows' expert outputs
        weights: torch.Tensor,  # [T, k]
        experts: torch.Tensor,  # [T, k]
        rows: RoutedRows,
    ) -> torch.Tensor:  # [T, hidden]
        """sum_j w_j * y_j per token, added as transformers adds them (from zeros, in
        ascending expert order) on any device: each row is put at its token's place in that
        order, then the k places are summed one after another (no scatter-add, whose order
        a GPU does not keep)."""
        tokens_n, k = experts.shape
        w = weights.reshape(-1)[rows.pairs]  # [T * k]: each row's routing weight
        weighted = (y * w[:, None]).to(x.dtype)
        # the place of choice c of token t among t's choices sorted by expert
        rank = torch.argsort(torch.argsort(experts, dim=1), dim=1)  # [T, k]
        base = torch.arange(tokens_n, device=x.device)[:, None] * k
        place = (base + rank).reshape(-1)[rows.pairs]  # [T * k]
        ordered = (
            torch.empty_like(weighted).index_copy_(0, place, weighted).view(tokens_n, k, x.shape[1])
        )
        out = torch.zeros_like(x)
        for j in range(k):
            out += ordered[:, j]
        return out


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP: sparse (experts) or dense (Qwen3-MoE's
    mlp_only_layers), each with a residual connection."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_name = "mlp"  # where the checkpoint keeps this layer's MLP or experts
        if layer_idx in config.moe_layers:
            self.block_name, _ = EXPERT_LAYOUT[config.model_type]
            setattr(self, self.block_name, SparseMoeBlock(config, layer_idx))
        else:
            self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        ffn: nn.Module = getattr(self, self.block_name)
        out: torch.Tensor = x + ffn(self.post_attention_layernorm(x))
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """A causal LM for model_type mixtral and qwen3_moe (the runner drives it as any other)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        layers = [MoEDecoderLayer(config, i) for i in range(config.num_layers)]
        self.model.layers = nn.ModuleList(layers)
        self.model.decoder_layers = layers  # type: ignore[assignment]

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        """The sparse layers' MoE blocks, in layer order."""
        return [b for b in self.modules() if isinstance(b, SparseMoeBlock)]

    def bind_expert_lora(self, pool: LoRAPool, context: LoRAContext) -> None:
        """Point every sparse block at the pool's per-expert slot tables (install_lora calls
        this after wrapping the attention projections)."""
        for block in self.sparse_blocks():
            names = block.expert_list[0].names if block.expert_list else ()
            block.lora = ExpertLoRA.from_pool(pool, block.layer_idx, block.num_experts, names)
            block.context = context
