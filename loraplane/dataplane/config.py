"""The engine's configuration: one slots dataclass, checked once when it is built.

Each part of the engine takes only the fields it uses (the scheduler its `SchedulerConfig`,
made by `EngineConfig.scheduler_config()`; the block manager explicit arguments), so a part can
be built and tested without a whole engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from loraplane.sizes import parse_memory

# of the device memory free after loading the model, what the KV cache (and adapter memory
# inside it) may take: model_runner sizes the cache with it, the planner predicts with it
GPU_MEMORY_FRACTION = 0.85

Dtype = Literal["float32", "float16", "bfloat16"]
Device = Literal["cpu", "cuda"]
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DEVICES: tuple[str, ...] = ("cpu", "cuda")
QUANTIZATIONS: tuple[str, ...] = ("fp8",)  # models/quant.py's, kept here without torch
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")  # kv_quant.py's, kept here without torch
# Device memory for adapter slots, by default: a tenth of what the weights leave free. On a
# 24 GiB CPU host that is ~2 GiB: ~1,300 rank-16 q/v adapters of a 1B model, or ~25 rank-16
# all-module adapters of an 8B one in bf16 (docs/dataplane.md, "Sizing the adapter memory").
DEFAULT_LORA_MEMORY = 0.1


def _positive_int(name: str, value: object) -> None:
    # bool is an int subclass: `max_loras=True` is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_model_len(value: int | None) -> None:
    if value is not None:
        _positive_int("max_model_len", value)
        if value < 2:  # a prompt token and a generated one
            raise ValueError(f"max_model_len must be >= 2, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """Settings of one data plane engine (one base model on one device).

    `max_model_len` and `num_kv_blocks` may stay None: the model runner fills them in from the
    model's config and the free device memory (use `dataclasses.replace` so they are checked).
    """

    model: str
    served_model_name: str | None = None
    dtype: Dtype = "bfloat16"
    device: Device = "cuda"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    # distinct adapters per step at most; None ("auto"): whatever fits in lora_memory, at most
    # max_num_seqs (and max_cpu_loras, when that is set)
    max_loras: int | None = None
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # host bytes the host tier's copies may take (under tensor parallelism with the other
    # ranks' parts rank 0 keeps); None: no byte limit, only max_cpu_loras
    max_cpu_lora_bytes: int | None = None
    # device memory for adapter slots: bytes (int) or a fraction in (0, 1] (float) of the
    # device memory the weights leave free; the scheduler admits adapters within it
    lora_memory: int | float = DEFAULT_LORA_MEMORY
    # adapters live in KV cache blocks: one device pool for both (num_kv_blocks plus the
    # lora_memory in blocks), idle adapters give memory back to sequences and the other way
    # round. None: on for CUDA (preallocated device memory), off for CPU (host memory is
    # allocated as adapters load, and a CPU slot reads the host copy in place)
    kv_lora_shared: bool | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # load waiting requests' adapters in the background (off: load when admitted, stalling)
    enable_lora_prefetch: bool = True
    # a request deferred by the adapter limit for longer than this many steps stops admission
    # of other adapters until it gets a slot (see scheduler.py)
    max_deferral_steps: int = 32
    # prompt tokens of requests for prompt log-probabilities (scoring) computed per step at
    # most, so an evaluation run cannot stall other tenants' decodes (chunked prefill only)
    max_prompt_logprob_tokens_per_step: int = 512
    # stored versions (catalog mode) unused this long are forgotten (registered again on use)
    forget_idle_adapters_s: float = 600.0
    # a waiting request whose adapter is not in host memory this many seconds after it
    # arrived fails alone (AdapterLoadTimeout, HTTP 504) instead of waiting on a dead store
    adapter_load_timeout_s: float = 60.0
    # decode steps replay CUDA graphs captured at a ladder of batch sizes (cuda_graphs.py);
    # None: on for cuda (on an H200 a 64-row decode step of an 8B model over 8 adapters took
    # 15 ms against 86 ms eager), off for cpu; falls back to eager on a capture error
    cuda_graphs: bool | None = None
    # "fp8": quantize a 16-bit checkpoint's projections to float8 e4m3 at load (per-channel
    # scales; models/quant.py); None: as the checkpoint is (an FP8 checkpoint loads as FP8)
    quantization: str | None = None
    # processes (one per device) the model is split over (parallel/): its attention heads,
    # MLP columns and vocabulary, and every adapter's slices; 1: one process
    tensor_parallel_size: int = 1
    # the KV cache's element type: "auto", the model's dtype; "fp8", float8 e4m3 with a scale
    # per layer for K and for V (the checkpoint's, else 1.0; kv_quant.py): half the bytes of
    # bf16 per cached token, so twice the blocks in the same memory
    kv_cache_dtype: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if self.served_model_name is None:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(
                f"served_model_name must be a non-empty string, got {self.served_model_name!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_lora_rank",
            "max_deferral_steps",
            "max_prompt_logprob_tokens_per_step",
        ):
            _positive_int(name, getattr(self, name))
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _check_model_len(self.max_model_len)
        if self.max_loras is not None:
            _positive_int("max_loras", self.max_loras)
        if self.max_cpu_loras is None:
            # every slot's adapter, and as many again loaded ahead for waiting requests
            self.max_cpu_loras = 2 * self.lora_slots if self.max_loras is None else self.max_loras
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_loras is not None and self.max_cpu_loras < self.lora_slots:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}):"
                " every adapter in the GPU pool is also held in the CPU cache"
            )
        if self.max_cpu_lora_bytes is not None:
            _positive_int("max_cpu_lora_bytes", self.max_cpu_lora_bytes)
        self.lora_memory = parse_memory(self.lora_memory)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        split = self.tensor_parallel_size > 1
        if split and self.cuda_graphs:  # not written for split models yet
            raise ValueError("cuda_graphs is not supported with tensor_parallel_size > 1 yet")
        if self.kv_lora_shared is None:
            self.kv_lora_shared = self.device == "cuda"
        if self.cuda_graphs is None:
            self.cuda_graphs = self.device == "cuda" and not split
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got"
                f" {self.kv_cache_dtype!r}"
            )
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enable_lora_prefetch",
            "kv_lora_shared",
            "cuda_graphs",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.forget_idle_adapters_s, int | float) or (
            self.forget_idle_adapters_s <= 0
        ):
            raise ValueError(
                f"forget_idle_adapters_s must be a positive number, got"
                f" {self.forget_idle_adapters_s!r}"
            )
        if isinstance(self.adapter_load_timeout_s, bool) or not isinstance(
            self.adapter_load_timeout_s, int | float
        ) or not self.adapter_load_timeout_s > 0:  # fmt: skip
            raise ValueError(
                f"adapter_load_timeout_s must be a positive number, got"
                f" {self.adapter_load_timeout_s!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len"
                f" ({self.max_model_len}) when enable_chunked_prefill is off: a whole prompt"
                " must fit in one step"
            )

    @property
    def lora_slots(self) -> int:
        """Device pool slots: the most distinct adapters one step can hold (max_loras, or for
        "auto" max_num_seqs and max_cpu_loras, whichever is lower; memory limits them too)."""
        if self.max_loras is not None:
            return min(self.max_loras, self.max_num_seqs)
        if self.max_cpu_loras is None:  # while __post_init__ derives max_cpu_loras from this
            return self.max_num_seqs
        return min(self.max_num_seqs, self.max_cpu_loras)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's view of this config."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_loras=self.lora_slots,
            max_deferral_steps=self.max_deferral_steps,
            max_prompt_logprob_tokens_per_step=self.max_prompt_logprob_tokens_per_step,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=self.max_model_len,
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The engine settings the scheduler uses (see EngineConfig for their meaning)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_loras: int = 8
    max_deferral_steps: int = 32
    max_prompt_logprob_tokens_per_step: int = 512
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_loras",
            "max_deferral_steps",
            "max_prompt_logprob_tokens_per_step",
        ):
            _positive_int(name, getattr(self, name))
        _check_model_len(self.max_model_len)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(
                f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
