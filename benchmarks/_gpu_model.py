"""engine_gpu.py's model, adapters and host-memory probe: a seeded random Llama written as a
sharded safetensors checkpoint, PEFT adapters on all seven projections, and the peak host
memory of a phase (anonymous and resident, sampled by a thread)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors.torch import save_file

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.models.loader import INDEX_NAME
from loraplane.demo.build import build_tokenizer, llama_config, module_shapes

WEIGHT_STD, ADAPTER_STD = 0.02, 0.05  # demo/build.py's build_llama and build_adapter


# -- the checkpoint and the adapters --------------------------------------------------------


def checkpoint_layout(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of an HF Llama checkpoint with this config."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    spec = BaseModelSpec.from_config(config, "model")
    layout: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            layout.append((f"{spec.module_key(layer, module)}.weight", (fan_out, fan_in)))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            layout.append((f"model.layers.{layer}.{norm}.weight", (hidden,)))
    return [*layout, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def write_llama(
    out: Path, shape: dict[str, Any], shard_bytes: int, dtype: torch.dtype, device: torch.device,
    seed: int = 0,
) -> tuple[dict[str, Any], int, int]:  # fmt: skip
    """Write a seeded random Llama as a sharded safetensors checkpoint in `dtype` (index,
    config.json and tokenizer included); return (config, checkpoint bytes, shards).

    demo/build.py's build_llama writes one fp32 file from numpy, minutes for 8B: here each
    tensor is drawn on `device` and the shards are written one by one, so the host holds at
    most one shard."""
    shape = dict(shape)
    config = llama_config(max(build_tokenizer(out), shape.pop("vocab_size")), **shape)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    # no EOS: HF's generate would stop at it (or, with min_new_tokens, forbid it) where the
    # engine, told to ignore EOS, goes on; the engine takes its EOS from the tokenizer
    del config["bos_token_id"], config["eos_token_id"]
    item = torch.empty(0, dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in checkpoint_layout(config):
        nbytes = math.prod(dims) * item
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if len(dims) == 1:  # RMSNorm weights
                tensors[name] = torch.ones(dims, dtype=dtype)
            else:
                w = torch.randn(dims, generator=gen, device=device, dtype=dtype)
                tensors[name] = w.mul_(WEIGHT_STD).cpu()
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return config, total, len(shards)


def write_adapter(
    out: Path, config: dict[str, Any], rank: int, seed: int, dtype: torch.dtype,
    device: torch.device, dora: bool = False,
) -> None:  # fmt: skip
    """A PEFT LoRA adapter on all seven projections (build_adapter's files and keys), drawn on
    `device` in `dtype`; with `dora`, a DoRA one: each module's magnitude vector about the
    norm of a base row of std WEIGHT_STD (sqrt(in) * WEIGHT_STD, within 10%), so g is near 1."""
    spec = BaseModelSpec.from_config(config, "model")
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            stem = "base_model.model." + spec.module_key(layer, module)
            for part, dims in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                w = torch.randn(dims, generator=gen, device=device, dtype=dtype)
                tensors[f"{stem}.{part}.weight"] = w.mul_(ADAPTER_STD).cpu()
            if dora:
                m = torch.rand(fan_out, generator=gen, device=device).mul_(0.2).add_(0.9)
                m *= WEIGHT_STD * fan_in**0.5
                tensors[f"{stem}.lora_magnitude_vector"] = m.to(dtype).cpu()
    out.mkdir(parents=True)
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                      "lora_alpha": 2 * rank, "target_modules": list(module_shapes(config)),
                      "bias": "none", "base_model_name_or_path": "model",
                      "use_dora": dora}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def adapter_bytes(config: dict[str, Any], rank: int, item: int) -> int:
    """Bytes of one adapter's A and B on all seven projections, `item` bytes per element."""
    per_layer = sum(rank * (i + o) for i, o in module_shapes(config).values())
    return int(config["num_hidden_layers"] * per_layer * item)


# -- host memory ---------------------------------------------------------------------------


def host_memory() -> tuple[int, int]:
    """(anonymous, resident) bytes of this process; zeros where there is no /proc."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmRSS"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields.get("RssAnon", 0), fields.get("VmRSS", 0)


def trim_host_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim), so that a load cannot hide
    its allocations in memory an earlier phase freed and the process kept."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class HostMemoryPeak:
    """Peak anonymous and resident memory of this process inside `with`, above what it held
    at the start (`anon`, `rss`, bytes), sampled every 5 ms by a thread."""

    def __init__(self) -> None:
        self.anon = self.rss = 0
        self._base = self._peak = (0, 0)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="host-memory", daemon=True)

    def _sample(self) -> None:
        anon, rss = host_memory()
        self._peak = (max(self._peak[0], anon), max(self._peak[1], rss))

    def _watch(self) -> None:
        while not self._done.wait(0.005):
            self._sample()

    def __enter__(self) -> HostMemoryPeak:
        self._base = self._peak = host_memory()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join()
        self._sample()
        self.anon = self._peak[0] - self._base[0]
        self.rss = self._peak[1] - self._base[1]
