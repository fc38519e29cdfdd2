"""LinearWithLoRA and install_lora: one walk wraps each projection; batches are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec
from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.kernels import cpu_linear
from loraplane.dataplane.lora import (
    LinearWithLoRA,
    LoadedAdapter,
    LoRABatch,
    LoRAContext,
    LoRAPool,
    LoRAWeights,
    install_lora,
)
from loraplane.dataplane.models import LlamaForCausalLM, load_model


def _model_with_pool(model_dir: Path, max_loras: int = 2) -> tuple[LlamaForCausalLM, LoRAPool]:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    pool = LoRAPool(max_loras, BaseModelSpec.from_dir(model_dir), torch.float32, "cpu")
    install_lora(model, pool)
    return model, pool


def test_install_wraps_every_projection_of_every_layer_exactly_once(tiny_llama_dir: Path) -> None:
    model, _ = _model_with_pool(tiny_llama_dir)
    wrapped = {
        (m.layer_idx, m.module_name) for m in model.modules() if isinstance(m, LinearWithLoRA)
    }
    assert wrapped == {(layer, module) for layer in range(2) for module in SUPPORTED_MODULES}
    assert not any(
        isinstance(m.base_layer, LinearWithLoRA)
        for m in model.modules()
        if isinstance(m, LinearWithLoRA)
    )
    assert not isinstance(model.lm_head, LinearWithLoRA)


def test_installing_twice_is_refused(tiny_llama_dir: Path) -> None:
    model, pool = _model_with_pool(tiny_llama_dir)
    with pytest.raises(ValueError, match="already installed"):
        install_lora(model, pool)


def test_a_batch_using_an_empty_slot_is_refused(tiny_llama_dir: Path) -> None:
    model, _ = _model_with_pool(tiny_llama_dir)
    model.allocate_kv_cache(2, 4)
    attn = AttentionMetadata.build([2], [2], [[0]], 4)
    with pytest.raises(ValueError, match="slot 1, which holds no adapter"):
        model(torch.tensor([4, 5]), torch.tensor([0, 1]), attn, LoRABatch.from_token_slots([1, 1]))


def test_wrapped_layer_adds_scaled_update_only_to_its_adapters_tokens() -> None:
    spec = BaseModelSpec("m", "llama", 1, 8, 16, 2, 2, 4)
    pool = LoRAPool(2, spec, torch.float32, "cpu")
    a, b = torch.randn(2, 8), torch.randn(8, 2)
    pool.load(1, LoadedAdapter("x", {(0, "q_proj"): LoRAWeights(a, b, 0.5)}))

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Module()])
            self.layers[0].self_attn = nn.Module()
            self.layers[0].self_attn.q_proj = nn.Linear(8, 8)
            self.lora_context: LoRAContext | None = None

    host = Host()
    context = install_lora(host, pool)
    layer = host.layers[0].self_attn.q_proj
    assert isinstance(layer, LinearWithLoRA)
    x = torch.randn(3, 8)
    base = cpu_linear.apply(layer.base_layer, x)  # the base projection the layer computes
    context.activate(LoRABatch.from_token_slots([1, -1, 1]))
    out = layer(x)
    torch.testing.assert_close(out[1], base[1], atol=0, rtol=0)
    torch.testing.assert_close(out[[0, 2]], base[[0, 2]] + 0.5 * (x[[0, 2]] @ a.t() @ b.t()))
    context.activate(None)
    torch.testing.assert_close(layer(x), base, atol=0, rtol=0)


def test_unknown_module_names_are_refused() -> None:
    with pytest.raises(ValueError, match="module_name 'lm_head'"):
        LinearWithLoRA(nn.Linear(2, 2), 0, "lm_head")


def test_a_pool_in_another_dtype_than_the_model_is_refused(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu"))
    pool = LoRAPool(1, BaseModelSpec.from_dir(tiny_llama_dir), torch.float32, "cpu")
    with pytest.raises(ValueError, match="pool dtype"):
        install_lora(model, pool)
