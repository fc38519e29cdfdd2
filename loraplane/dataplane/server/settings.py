"""The server's settings: `LORAPLANE_*` environment variables, overridden by CLI flags.

Read once at start (`ServerSettings.load(**flags)`); a bad value fails start with a message that
names the variable. Every default runs on a CPU-only machine (device cpu, dtype float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loraplane.dataplane.config import DEFAULT_LORA_MEMORY, EngineConfig
from loraplane.envhelp import format_env_help
from loraplane.redact import clean_credential
from loraplane.sizes import parse_bytes, parse_memory

MAX_N = 8  # choices per request (`n`) at most


class SettingsError(ValueError):
    """A setting is invalid; the message names the environment variable or flag."""


class ServerSettings(BaseSettings):
    """Everything `loraplane serve` needs; env var = `LORAPLANE_` + the field name, upper case."""

    # hide_input_in_errors: a refused key or token is never echoed in the error
    model_config = SettingsConfigDict(
        env_prefix="LORAPLANE_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    model: str = Field(min_length=1)
    served_model_name: str | None = None
    # name -> adapter directory; env: `NAME=DIR,NAME=DIR`
    lora_modules: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # "auto" (None): as many distinct adapters per step as fit in lora_memory (<= max_num_seqs)
    max_loras: int | None = Field(default=None, ge=1)
    # device memory for adapters: a size (2GiB) or a fraction (0.1) of what the weights leave
    lora_memory: str = str(DEFAULT_LORA_MEMORY)
    # adapters inside the KV cache (one device pool); None: on for cuda, off for cpu
    kv_lora_shared: bool | None = None
    max_lora_rank: int = Field(default=64, ge=1)
    # decode steps replay CUDA graphs (cuda only); None: on for cuda
    cuda_graphs: bool | None = None
    # the engine loop in a child process of its own (engine_process.py), this process keeping
    # HTTP, tokenizing and SSE: neither waits for the other's turn at the GIL. Off: a thread
    engine_process: bool = True
    max_cpu_loras: int | None = Field(default=None, ge=1)
    # host bytes the host tier may take: a size (8GiB) or bytes; None: no byte limit
    max_cpu_lora_bytes: str | None = None
    max_num_seqs: int = Field(default=256, ge=1)
    dtype: Literal["float32", "float16", "bfloat16"] | None = None  # None: by device
    # "fp8": the base's projections quantized at load (an FP8 checkpoint needs nothing)
    quantization: Literal["fp8"] | None = None
    # processes (one per GPU) the base model is split over; 1: one process
    tensor_parallel_size: int = Field(default=1, ge=1)
    # "fp8": the KV cache in float8 e4m3 (kv_quant.py), twice the tokens in the same memory
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # every series, tenant-labelled and per-adapter ones included, on a port of its own that
    # only Prometheus may reach (0: off); the API port's /metrics keeps vLLM's protocol gauges
    metrics_port: int = Field(default=8002, ge=0, le=65535)
    # the endpoint picker's port: vLLM's protocol gauges with the adapter names of
    # vllm:lora_requests_info (its LoRA affinity), no tenant label (0: off)
    gateway_metrics_port: int = Field(default=8003, ge=0, le=65535)
    # deprecated, no effect (the gateway-metrics port names adapters; the API port never does):
    # still accepted so that old manifests start, with a warning (serving.py)
    api_metrics_adapters: bool = False
    controlplane_url: str | None = None
    api_key: str | None = None
    admin_token: str | None = None
    service_token: str | None = None  # catalog mode: this replica's credential
    store: str = ".loraplane/store"  # catalog mode: the store (a path or s3://bucket/prefix)
    pool: str = "default"  # catalog mode: the ServingPool this replica reports pressure for
    # catalog mode: that ServingPool's namespace (pools are named by namespace and name)
    pool_namespace: str = Field(
        default="default", max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
    )
    replica: str | None = None  # catalog mode: this replica's name (default: hostname:port)
    resolve_ttl_s: float = Field(default=5.0, ge=0)
    # tool_choice "auto": how tool calls are read out of the model's text (None: auto is a 400)
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    # a known (key, model) keeps its last good resolution this long while the control plane is
    # unreachable: serving goes on through a control plane outage
    resolve_stale_s: float = Field(default=300.0, ge=0)
    # catalog mode: usage not yet delivered to the control plane is kept in a file here, so a
    # crash does not lose it (None: memory only; the operator's pods use an emptyDir)
    usage_spool_dir: Path | None = None
    pressure_interval_s: float = Field(default=5.0, gt=0)
    requests_per_minute: int = Field(default=0, ge=0)  # standalone tenant; 0 = unlimited
    tokens_per_minute: int = Field(default=0, ge=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # an adapter unload waits this long for the adapter's running requests (then it is given
    # up, 503 unload_timeout, and the adapter served as before)
    unload_timeout_s: float = Field(default=120.0, gt=0)
    # a request whose adapter is not loaded this long after it arrived fails with 504
    adapter_load_timeout_s: float = Field(default=60.0, gt=0)
    # /ready fails while the engine has work but no step has ended for this long. 30 s: a step
    # takes milliseconds to about a second (a full prefill chunk of a large model); the slowest
    # honest ones are the first steps after start, which compile Triton kernels for their
    # shapes and load adapters. 30 s clears those, and the readiness probe adds its own
    # failures x period before the pod leaves rotation; it is never killed for this (/health).
    ready_stall_s: float = Field(default=30.0, gt=0)
    # /ready fails while the engine's last this many steps all raised (until one returns)
    ready_failed_steps: int = Field(default=3, ge=1)
    # bounded work: engine requests in flight per replica and per tenant (429 past them),
    # prompts in one completions request and request body bytes (400 / 413 past them)
    max_queued_requests: int = Field(default=1024, ge=1)
    max_queued_requests_per_tenant: int = Field(default=256, ge=1)
    max_prompts_per_request: int = Field(default=64, ge=1)
    max_request_bytes: int = Field(default=8 << 20, ge=1024)
    # intake workers per pool (tokenizing, compiling grammars); unset: from the cores (intake.py)
    tokenize_workers: int | None = Field(default=None, ge=1)
    grammar_workers: int | None = Field(default=None, ge=1)
    # engine sizing, env only (tests and small machines)
    max_model_len: int | None = Field(default=None, ge=2)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=4096, ge=1)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_modules(cls, value: Any) -> Any:
        """`NAME=DIR` strings (flags, or a comma-separated env var) into a dict."""
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            return dict(parse_lora_module(v) for v in value)
        return value

    @field_validator("api_key", "admin_token", "service_token", mode="before")
    @classmethod
    def _clean_token(cls, value: Any) -> Any:
        """Whitespace around a key or token (an env file, a Secret made from a file, a paste)
        is not part of it; whitespace inside it is refused, the value never echoed."""
        if not isinstance(value, str) or value == "":
            return value
        return clean_credential(value, "the value")

    @field_validator("metrics_port")
    @classmethod
    def _check_metrics_port(cls, value: int, info: ValidationInfo) -> int:
        """Tenant-labelled metrics never share the API port."""
        if value and value == info.data.get("port"):
            raise ValueError(f"{value} is the API port (--port): give another, or 0 for none")
        return value

    @field_validator("gateway_metrics_port")
    @classmethod
    def _check_gateway_metrics_port(cls, value: int, info: ValidationInfo) -> int:
        """Adapter names never share the API port; the picker's view is not the metrics port's."""
        if value and value == info.data.get("port"):
            raise ValueError(f"{value} is the API port (--port): give another, or 0 for none")
        if value and value == info.data.get("metrics_port"):
            raise ValueError(
                f"{value} is the metrics port (--metrics-port): give another, or 0 for none"
            )
        return value

    @field_validator("max_loras", mode="before")
    @classmethod
    def _parse_max_loras(cls, value: Any) -> Any:
        """`auto` (any case) means None: memory decides."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            return None
        return value

    @field_validator("lora_memory", mode="before")
    @classmethod
    def _parse_lora_memory(cls, value: Any) -> Any:
        parse_memory(value if isinstance(value, str | int | float) else str(value))
        return str(value)

    @field_validator("max_cpu_lora_bytes", mode="before")
    @classmethod
    def _parse_max_cpu_lora_bytes(cls, value: Any) -> Any:
        if value is None:
            return None
        parse_bytes(value if isinstance(value, str | int) else str(value), "max_cpu_lora_bytes")
        return str(value)

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        for name in self.lora_modules:
            if not name or "@" in name or "/" in name:
                raise ValueError(f"lora_modules: bad adapter name {name!r} (no '@' or '/')")
        if self.served_model_name is not None and self.served_model_name in self.lora_modules:
            raise ValueError("lora_modules: an adapter may not take the base model's name")
        return self

    @classmethod
    def load(cls, **overrides: Any) -> ServerSettings:
        """Environment first, then `overrides` (flags; None means not given)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**given)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"][:1]) or "settings"
            raise SettingsError(
                f"LORAPLANE_{field.upper()} / --{field.replace('_', '-')}: {err['msg']}"
            ) from None

    @property
    def effective_dtype(self) -> Literal["float32", "float16", "bfloat16"]:
        """float32 on CPU, bfloat16 on CUDA, unless set."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    def engine_config(self) -> EngineConfig:
        """The engine's config (raises ValueError naming the field when it is inconsistent)."""
        return EngineConfig(
            model=self.model,
            served_model_name=self.served_model_name,
            dtype=self.effective_dtype,
            device=self.device,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_loras=self.max_loras,
            lora_memory=parse_memory(self.lora_memory),
            kv_lora_shared=self.kv_lora_shared,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            max_cpu_lora_bytes=None
            if self.max_cpu_lora_bytes is None
            else parse_bytes(self.max_cpu_lora_bytes, "max_cpu_lora_bytes"),
            cuda_graphs=self.cuda_graphs,
            quantization=self.quantization,
            tensor_parallel_size=self.tensor_parallel_size,
            kv_cache_dtype=self.kv_cache_dtype,
            adapter_load_timeout_s=self.adapter_load_timeout_s,
        )

    def adapter_dirs(self) -> dict[str, Path]:
        """The static `--lora-modules`, name -> directory."""
        return {name: Path(path) for name, path in self.lora_modules.items()}


# What each setting means, for `loraplane serve --help` (a test keeps it complete).
SETTINGS_HELP: dict[str, str] = {
    "model": "base model directory (HF format); required",
    "served_model_name": "the base model's name in the API (default: the directory's name)",
    "lora_modules": "trusted static adapters, NAME=DIR[,NAME=DIR...]",
    "max_loras": "distinct adapters per batch at most: auto (as many as fit) or N",
    "lora_memory": "device memory for adapters: a size (2GiB) or a fraction of what the weights"
    " leave free",
    "kv_lora_shared": "adapters inside the KV cache, one device pool (unset: on for cuda)",
    "max_lora_rank": "largest adapter rank accepted",
    "cuda_graphs": "decode steps replay CUDA graphs captured at start (unset: on for cuda; eager"
    " on a capture error)",
    "engine_process": "the engine loop in a process of its own (on), or on a thread of the API"
    " server's (off)",
    "max_cpu_loras": "adapters kept in host memory (unset: twice the device slots)",
    "max_cpu_lora_bytes": "host memory the adapters kept there may take: a size (8GiB, 512MiB)"
    " or bytes (unset: no byte limit, only max_cpu_loras)",
    "max_num_seqs": "requests per batch at most",
    "dtype": "float32, float16 or bfloat16 (unset: float32 on cpu, bfloat16 on cuda)",
    "quantization": "fp8: the base's projections quantized to float8 e4m3 at load (unset: as the"
    " checkpoint is: FP8 compressed-tensors or block-wise as FP8, AWQ, GPTQ or pack-quantized as"
    " 4-bit)",
    "tensor_parallel_size": "processes the base model is split over, one per GPU (its heads,"
    " MLP columns, vocabulary and every adapter's slices; gloo between CPU processes)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8: the KV cache in float8 e4m3 with a"
    " scale per layer for K and V (the checkpoint's, else 1.0), twice the tokens of bf16",
    "device": "cpu or cuda",
    "host": "address to listen on",
    "port": "port to listen on (the OpenAI API; its /metrics: vLLM's protocol gauges, no"
    " adapter names)",
    "metrics_port": "port of every metric, per-tenant and per-adapter ones included, for"
    " Prometheus only (0: off; never the API port)",
    "gateway_metrics_port": "port of the endpoint picker's metrics: vLLM's protocol gauges with"
    " adapter names (vllm:lora_requests_info), no tenant label (0: off)",
    "api_metrics_adapters": "deprecated, no effect: the gateway-metrics port names adapters, the"
    " API port never does",
    "controlplane_url": "catalog mode: the control plane's URL (tenants, keys, adapters)",
    "api_key": "standalone mode: the key every /v1 route needs (unset: none)",
    "admin_token": "enables /v1/load_lora_adapter and /v1/unload_lora_adapter",
    "service_token": "catalog mode: this replica's credential for the internal API",
    "store": "catalog mode: the adapter store (a path or s3://bucket/prefix)",
    "pool": "catalog mode: the ServingPool this replica reports pressure for",
    "pool_namespace": "catalog mode: that ServingPool's namespace",
    "replica": "catalog mode: this replica's name (unset: hostname:port)",
    "resolve_ttl_s": "seconds a key's resolution is cached (a revoked key stops within it)",
    "resolve_stale_s": "seconds a known key's last good resolution serves while the control"
    " plane is unreachable",
    "usage_spool_dir": "catalog mode: folder where usage not yet delivered to the control plane"
    " survives a crash (unset: memory only)",
    "tool_call_parser": 'reads tool calls out of the text for tool_choice "auto" (hermes,'
    " llama3_json, mistral, pythonic)",
    "pressure_interval_s": "seconds between pressure and usage reports",
    "requests_per_minute": "standalone tenant's request limit (0: unlimited)",
    "tokens_per_minute": "standalone tenant's token limit (0: unlimited)",
    "shutdown_grace_s": "seconds running requests get to finish on SIGTERM",
    "unload_timeout_s": "seconds an adapter unload waits for the adapter's running requests"
    " (then 503 unload_timeout: the unload is given up)",
    "adapter_load_timeout_s": "seconds a request waits for its adapter to load (then 504"
    " AdapterLoadTimeout)",
    "ready_stall_s": "/ready fails while the engine has work and no step has ended this long",
    "ready_failed_steps": "/ready fails while the engine's last this many steps all failed",
    "max_queued_requests": "engine requests in flight per replica (429 past it)",
    "max_queued_requests_per_tenant": "engine requests in flight per tenant (429 past it)",
    "max_prompts_per_request": "prompts in one completions request (400 past it)",
    "max_request_bytes": "request body bytes (413 past it)",
    "tokenize_workers": "threads that tokenize and format answers, shared fairly by tenants"
    " (unset: a quarter of the cores, 2 to 4)",
    "grammar_workers": "threads that compile structured-output grammars, shared fairly by"
    " tenants (unset: a quarter of the cores, 2 to 4)",
    "max_model_len": "context length (unset: the model's)",
    "num_kv_blocks": "KV cache blocks (unset: sized from free memory)",
    "block_size": "tokens per KV block",
    "max_num_batched_tokens": "tokens per step at most",
}


def settings_help() -> str:
    """The LORAPLANE_* variables `loraplane serve` reads, their defaults and meanings."""
    rows = []
    for name, field in ServerSettings.model_fields.items():
        default: object = "required" if field.is_required() else field.default
        if field.default_factory is not None:
            default = None
        rows.append((name, default, SETTINGS_HELP.get(name, "")))
    return format_env_help(rows)


def parse_lora_module(text: str) -> tuple[str, str]:
    """`NAME=DIR` -> (NAME, DIR); ValueError otherwise."""
    name, sep, path = str(text).strip().partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected NAME=DIR, got {text!r}")
    return name, path
