"""A quantized mixture of experts served on the torch path and on a Triton kernel's path (the
W8A16 and W4A16 kernel tests share it): which weights the kernel was launched on, and the tokens
of each path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.test_engine import prompts


def torch_and_kernel_tokens(
    model: Path, adapter: Path, device: torch.device, env: str, layer: type[nn.Module],
    **settings: object,
) -> tuple[dict[str, list[list[int]]], list[nn.Module]]:  # fmt: skip
    """({"torch": tokens, "triton": tokens}, the Triton engine's expert layers, each a `layer`)
    of `model` served with `adapter` beside base rows, `env` (LORAPLANE_FP8 or LORAPLANE_W4)
    naming the backend."""
    outs = {}
    experts: list[nn.Module] = []
    with pytest.MonkeyPatch.context() as mp:
        for backend in ("torch", "triton"):
            mp.setenv(env, backend)
            engine = Engine(EngineConfig(model=str(model), device=str(device), dtype="float32",
                                         block_size=4, num_kv_blocks=64, max_num_seqs=4,
                                         **settings))  # type: ignore[arg-type]  # fmt: skip
            experts = [m for n, m in engine.runner.model.named_modules()
                       if ".experts." in n and isinstance(m, layer)]  # fmt: skip
            assert experts and all(getattr(m, "backend", None) == backend for m in experts)
            ref = engine.register_lora("experts", adapter, "t")
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            generated = engine.generate(prompts(2, 5), params, [ref, None])
            outs[backend] = [o.token_ids for o in generated]
    return outs, experts
