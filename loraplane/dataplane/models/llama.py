"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4) over a flat batch and a
paged KV cache.

Module names follow the HF checkpoints (`model.layers.0.self_attn.q_proj`, ...), so weights load
by name and LoRA wraps the same projections PEFT adapts. Every linear layer stays the
`nn.Linear` the checkpoint has: q, k, v, gate, up separate for Llama, Mistral and Qwen; Phi-3's
`qkv_proj` and `gate_up_proj` fused, so a Phi-3 adapter (trained on those fused names) wraps
them directly, its B [q + k + v out, r] read once, rank-exact.
Qwen3 norms each q and k head (RMSNorm over head_dim) before RoPE; Phi-3 rotates only the first
partial_rotary_factor of each head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from loraplane.dataplane.attention import AttentionMetadata, paged_attention
from loraplane.dataplane.kernels import cpu_linear, cpu_ops
from loraplane.dataplane.lora.layers import LoRAContext
from loraplane.dataplane.lora.metadata import LoRABatch
from loraplane.dataplane.models.config import ModelConfig
from loraplane.dataplane.models.rope import RotaryEmbedding, apply_rotary

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, rotary_dim]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in fp32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if x.dim() == 2:  # a step's rows: one native call on the CPU (cpu_ops)
                return cpu_ops.rms_norm(x, self.weight, self.eps)[0]
            # torch's fused kernel: the same arithmetic (bit for bit in fp32), one op not seven
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, dim]: (norm(x + residual), x + residual)
        """The norm of `x + residual`, and that sum; `x` (a layer's fresh output, read by
        nothing else) may hold the sum afterwards."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        s = residual + x
        return self(s), s


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; K/V go to this layer's slice of the paged cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden = config.hidden_size
        self.split = [q_out, kv_out, kv_out]
        self.fused = config.fused_projections
        if self.fused:
            self.qkv_proj = nn.Linear(hidden, q_out + 2 * kv_out, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=config.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_head_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's scales (the checkpoint's, if any)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("the KV cache is not allocated: call allocate_kv_cache first")
        tokens = x.shape[0]
        if self.fused:
            q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
            v = v.contiguous()
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not cpu_ops.rope(q, k, cos, sin):  # in place, one native call on the CPU
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(
            q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.sliding_window,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Phi-3: gate and up are the halves of gate_up(x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.fused = config.fused_projections
        if self.fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # in place: no [T, inter] tensor allocated for silu(gate) or the product (at a prefill's
        # size each would be fresh pages, faulted in on first write)
        out: torch.Tensor = self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        h, x = self.post_attention_layernorm.add_forward(attended, x)
        out: torch.Tensor = x + self.mlp(h)
        return out


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """nn.Embedding(vocab_size, hidden_size), drawn as torch draws it except on the meta device
    (the loader's, before the checkpoint's weights replace it): there torch's init imports
    torch._dynamo, 2-4 s of every engine's start and nothing else the engine needs."""
    weight = torch.empty(vocab_size, hidden_size)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(vocab_size, hidden_size, _weight=weight)


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        layers = [DecoderLayer(config, i) for i in range(config.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers = layers  # the same modules, typed
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)
        # RoPE per layer type (transformers 5 rope_parameters keyed by layer type): one table
        # per distinct RoPE, each layer reading its own
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = [r for i, r in enumerate(ropes) if r != config.rope and r not in ropes[:i]]
        self.layer_rotary = nn.ModuleList(RotaryEmbedding(r, config.head_dim) for r in distinct)
        self.layer_table = [0 if r == config.rope else 1 + distinct.index(r) for r in ropes]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        tables: list[RopeTables] = [self.rotary_emb(positions, x.dtype, attn)]
        tables += [rotary(positions, x.dtype, attn) for rotary in self.layer_rotary]
        for layer, table in zip(self.decoder_layers, self.layer_table, strict=True):
            cos, sin = tables[table]
            x = layer(x, cos, sin, attn)
        return self.norm(x)  # type: ignore[no-any-return]


class LlamaForCausalLM(nn.Module):
    """A causal LM for model_type llama, mistral, qwen2, qwen3 and phi3, driven by the engine's
    model runner.

    The runner calls `allocate_kv_cache` once, then per step `forward` on a flat batch and
    `compute_logits` on the rows it samples from.
    """

    # the cache's element type (set before allocate_kv_cache: kv_quant.cache_dtype); None:
    # the weights' dtype
    kv_cache_dtype: torch.dtype | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lora_context: LoRAContext | None = None  # set by install_lora
        self.kv_cache: torch.Tensor | None = None  # [2, layers, blocks, block_size, kv, dim]

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Bytes one cache block takes across all layers (K and V), for sizing num_blocks."""
        c = self.config
        itemsize = (self.kv_cache_dtype or self.lm_head.weight.dtype).itemsize
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate per-layer K and V caches, each [num_blocks, block_size, kv_heads, head_dim],
        in `kv_cache_dtype` (default: the weights')."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        c, weight = self.config, self.lm_head.weight
        layers = self.model.decoder_layers
        self.kv_cache = None  # drop any old cache before allocating the new one
        for layer in layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
        shape = (2, c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        dtype = self.kv_cache_dtype or weight.dtype
        cache = torch.zeros(shape, dtype=dtype, device=weight.device)
        for i, layer in enumerate(layers):
            layer.self_attn.k_cache = cache[0, i]
            layer.self_attn.v_cache = cache[1, i]
        self.kv_cache = cache

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int
        positions: torch.Tensor,  # [T] int: each token's position in its sequence
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Run the decoder on T tokens from attn.num_seqs sequences; return final hidden states."""
        tokens = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                "must both be [T]"
            )
        if attn.num_tokens != tokens:
            raise ValueError(f"attn covers {attn.num_tokens} tokens but input_ids has {tokens}")
        if lora is not None and self.lora_context is None:
            raise ValueError("lora was given but no LoRA layers are installed (install_lora)")
        if lora is not None and lora.num_tokens != tokens:
            raise ValueError(f"lora covers {lora.num_tokens} tokens but input_ids has {tokens}")
        context = self.lora_context
        if context is None:
            return self.model(input_ids, positions, attn)  # type: ignore[no-any-return]
        context.activate(lora)
        try:
            return self.model(input_ids, positions, attn)  # type: ignore[no-any-return]
        finally:
            context.activate(None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """fp32 logits for the rows the caller samples from (e.g. each sequence's last token)."""
        logits = cpu_linear.apply(self.lm_head, hidden)
        return logits.float()
