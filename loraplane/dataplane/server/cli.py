"""`loraplane serve`: the data plane server (its flags: docs/dataplane.md, "Running").

Flags override `LORAPLANE_*` environment variables. SIGTERM or SIGINT drain the server: it stops
accepting connections, lets running requests finish for up to LORAPLANE_SHUTDOWN_GRACE_S
seconds (then aborts them), stops the engine and exits 0. A start that fails (a bad model, a
rejected `--lora-modules` adapter) exits 1 with the reason on stderr; a model path that is no
folder at all (a typo) exits 2 at once, before anything starts.
"""

from __future__ import annotations

import argparse
import stat
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


def add_commands(subparsers: Any) -> None:
    """Register `serve` on the `loraplane` command's sub-parsers."""
    serve = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API for a base model and its LoRA adapters",
        description="Serve the OpenAI-compatible data plane. Every setting is also read from"
        " its LORAPLANE_* variable (listed below); flags win.",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--model", help="base model directory (HF format)")
    serve.add_argument("--served-model-name", help="the base model's name in the API")
    serve.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=DIR", help="trusted static adapters"
    )
    serve.add_argument(
        "--max-loras",
        metavar="auto|N",
        help="distinct adapters per batch at most (default auto: as many as fit in"
        " --lora-memory, at most --max-num-seqs)",
    )
    serve.add_argument(
        "--lora-memory",
        metavar="SIZE|FRACTION",
        help="device memory for adapters: a size (2GiB, 512MiB) or a fraction of the memory"
        " the weights leave free (default 0.1; on CPU of the RAM available, reclaimable page"
        " cache included, within the container's memory limit)",
    )
    serve.add_argument(
        "--max-cpu-lora-bytes",
        metavar="SIZE",
        help="host memory the adapters kept there may take: a size (8GiB, 512MiB) or bytes"
        " (default: no byte limit, only --max-cpu-loras); the least recently used copies go"
        " first",
    )
    for flag, what in (
        ("--max-lora-rank", "largest adapter rank accepted"),
        ("--max-cpu-loras", "adapters kept in host memory"),
        ("--max-num-seqs", "requests per batch"),
    ):
        serve.add_argument(flag, type=int, help=what)
    serve.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    serve.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: quantize the base's projections to float8 e4m3 at load (per-channel scales;"
        " about half the weights' memory of bf16; LoRA unchanged); an FP8 checkpoint"
        " (compressed-tensors, or block-wise as Qwen's FP8 releases) loads as FP8 without it,"
        " a 4-bit one (AWQ, GPTQ, pack-quantized) as 4-bit, and fp8 is refused for it",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="split the base model over N processes, one per GPU (cuda:0..N-1; on cpu, the"
        " cores shared out): attention heads, MLP columns and the vocabulary, and each"
        " adapter's matching slices, exact; N must divide the attention heads and the MLP"
        " width (an expert's too), and the KV heads divide by N or N by them. Every family,"
        " mixtures of experts included; combines with --quantization and FP8 or 4-bit"
        " checkpoints; default 1",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        help="the KV cache's element type: auto (default: the model's dtype) or fp8 (float8"
        " e4m3, a scale per layer for K and for V read from the checkpoint, else 1.0): one byte"
        " per cached value, so twice the tokens of bf16 in the same memory, at a small accuracy"
        " cost; on CUDA it needs compute capability 8.9 (Ada, Hopper)",
    )
    serve.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps replay CUDA graphs captured at start for a ladder of batch sizes"
        " (default: on for cuda, ignored on cpu; falls back to eager, with a log line, if"
        " capture fails); --no-cuda-graphs: every step eager",
    )
    serve.add_argument(
        "--engine-process",
        choices=["on", "off"],
        help="on (default): the engine loop runs in a child process, this one keeps HTTP,"
        " tokenizing and SSE (no contention for the GIL); off: on a thread of this process",
    )
    serve.add_argument("--device", choices=["cpu", "cuda"])
    serve.add_argument("--host")
    serve.add_argument("--port", type=int, help="the OpenAI API's port (default 8000)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="every metric, per-tenant and per-adapter ones included, on a port of its own for"
        " Prometheus only (default 8002; 0: off); the API port's /metrics keeps vLLM's"
        " protocol gauges",
    )
    serve.add_argument(
        "--gateway-metrics-port",
        type=int,
        help="the inference gateway's endpoint picker scrapes this port: vLLM's protocol gauges"
        " with adapter names (vllm:lora_requests_info, for LoRA affinity), no tenant label"
        " (default 8003; 0: off)",
    )
    serve.add_argument(
        "--api-metrics-adapters",
        action="store_true",
        default=None,
        help="deprecated, no effect (the gateway-metrics port names adapters; the API port"
        " never does)",
    )
    serve.add_argument("--controlplane-url", help="catalog mode: the control plane's URL")
    serve.add_argument(
        "--usage-spool-dir",
        help="catalog mode: folder where usage not yet delivered to the control plane survives"
        " a crash (default: memory only)",
    )
    serve.add_argument("--api-key", help="standalone mode: the key every /v1 route needs")
    serve.add_argument("--admin-token", help="enables /v1/load_lora_adapter and unload")
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help='reads tool calls out of the text for tool_choice "auto", in a model family\'s'
        " format (hermes: <tool_call> JSON blocks; llama3_json; mistral: [TOOL_CALLS]; pythonic:"
        " [f(a=1)]); without it, auto is refused",
    )
    from loraplane.accesslog import add_arguments as add_access_log

    add_access_log(serve)
    serve.set_defaults(func=run_serve)


def _settings_help() -> str | None:
    """The LORAPLANE_* list, when the data plane's packages are installed (the `loraplane`
    command also runs without them)."""
    try:
        from loraplane.dataplane.server.settings import settings_help
    except ImportError:
        return None
    return settings_help()


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until it is told to stop; return the exit code."""
    from loraplane.dataplane.server.settings import ServerSettings, SettingsError

    flags = {
        k: getattr(args, k, None)
        for k in ("model", "served_model_name", "lora_modules", "max_loras", "lora_memory",
                  "max_lora_rank", "cuda_graphs", "engine_process", "quantization",
                  "tensor_parallel_size", "kv_cache_dtype",
                  "max_cpu_loras", "max_cpu_lora_bytes", "max_num_seqs", "dtype", "device",
                  "host", "port",
                  "metrics_port", "gateway_metrics_port", "api_metrics_adapters",
                  "controlplane_url", "usage_spool_dir",
                  "api_key", "admin_token", "tool_call_parser")
    }  # fmt: skip
    from loraplane.accesslog import AccessLogError, settings_from

    try:
        settings = ServerSettings.load(**flags)
        access_log = settings_from(args)
    except (SettingsError, AccessLogError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    problem = model_folder_problem(settings.model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from loraplane.dataplane.server.serving import serve  # torch and uvicorn: only now

    return serve(settings, access_log)


def model_folder_problem(model: str) -> str | None:
    """Why `model` cannot be a base model's folder, known before anything starts: it does not
    exist, or is a file (None otherwise: what is in the folder, and what this process may
    read, the load checks and names, file by file)."""
    try:
        mode = Path(model).stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        found = "no such folder"
    except OSError:
        return None  # a folder on the way this process may not enter: the load names it
    else:
        if stat.S_ISDIR(mode):
            return None
        found = "not a folder"
    return (
        f"--model / LORAPLANE_MODEL {model}: {found} (the base model's folder in Hugging Face "
        "format: config.json, tokenizer.json and *.safetensors weights; `loraplane demo` "
        "builds a small one)"
    )
