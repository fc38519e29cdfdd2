"""`loraplane plan`: the capacity planner's command (`add_commands` registers it)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loraplane.adapters.base_model import SUPPORTED_MODULES
from loraplane.sizes import parse_bytes, parse_memory

EXIT_USAGE = 2
# --warmup's default follows --duration: a short simulation still counts most of its requests
WARMUP_MAX_S, WARMUP_SHARE = 10.0, 5.0

DESCRIPTION = """\
Size a pool of loraplane replicas. From a base model (a folder's config.json, or a named
shape), a device, a dtype and an adapter profile it prints one replica's memory split (weights,
KV cache, adapter memory, as the engine's --lora-memory rule sizes them), the adapters that
run at once per replica, the host and disk tier sizes, and, given a request rate and a p99
time-to-first-token target, the replicas needed under three routing policies: round_robin,
lora_affinity (the llm-d endpoint picker's LoRA affinity scorer) and bounded_k (rendezvous
placement on k replicas per adapter, k growing under load). The replicas come from a
discrete-event simulation of the fleet, whose step and load times come from a roofline of
the GPU (--gpu, --device-bandwidth, --device-flops, --pcie) or from this engine measured here
(--calibrate, saved and reused with --cost FILE). A base split over N GPUs
(--tensor-parallel-size N) is sized per GPU, its steps paying their all-reduces over the
GPUs' interconnect; a base that fits no single GPU gets its layouts compared (--dtype on 1, 2,
4, 8 GPUs, and fp8 alike: --recommend-layout), the cheapest named and planned.

examples:
  loraplane plan --model-shape llama-3-8b --device-memory 80GiB --device-bandwidth 3350
  loraplane plan --model-shape llama-3-8b --gpu h200 --adapters 2000 --adapter-rank 16 \\
      --popularity zipf:1.0 --rate 50 --ttft-p99 2.0 --plot plan.png
  loraplane plan --model ./Llama-3.1-8B --adapter-modules q_proj,v_proj --json
  loraplane plan --model-shape llama-3-70b --gpu h200 --adapters 2000 --rate 2
  loraplane plan --model-shape llama-3-70b --gpu h100 --tensor-parallel-size 4
  loraplane plan --model ./small-model --device cpu --dtype float32 --device-memory 24GiB \\
      --calibrate --cost here.json --rate 5 --ttft-p99 1.0"""


def _size(text: str) -> int:
    try:
        value = parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"{text!r} is a fraction; give a size such as 80GiB")
    return value


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not positive")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _auto_int(text: str) -> int | None:
    if text == "auto":
        return None
    value: int = _positive(int)(text)
    return value


def _host_bytes(text: str) -> int:
    try:
        return parse_bytes(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _modules(text: str) -> tuple[str, ...]:
    if text == "all":
        return SUPPORTED_MODULES
    modules = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modules if m not in SUPPORTED_MODULES]
    if unknown or not modules:
        raise argparse.ArgumentTypeError(
            f"modules must be 'all' or among {', '.join(SUPPORTED_MODULES)}"
        )
    return modules


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's default appended to its help, unless the
    help already says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS
        if "(default" in text or unset or not action.option_strings:
            return text
        shown = ",".join(default) if isinstance(default, tuple) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def add_commands(subparsers: Any) -> None:
    """Register `plan` on the `loraplane` command's sub-parsers."""
    from loraplane.planner.cost import GPUS
    from loraplane.planner.routing import POLICIES
    from loraplane.planner.shapes import SHAPES

    plan = subparsers.add_parser(
        "plan",
        help="capacity planner: memory split, adapters per replica, replicas for a load",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    model = plan.add_argument_group("model and device")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="model folder (its config.json)")
    which.add_argument("--model-shape", metavar="NAME", help=f"one of {', '.join(SHAPES)}")
    model.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16",
        help="weights' and KV cache's dtype",
    )  # fmt: skip
    model.add_argument(
        "--quantization", choices=["fp8", "int4"], default=None,
        help="fp8: the base's projections in float8 e4m3, as serve --quantization fp8 (half"
        " the weights' memory; the roofline reads a byte per weight where the GPU has FP8,"
        " the torch path's dequantization traffic where not); int4: a 4-bit checkpoint (AWQ,"
        " GPTQ, compressed-tensors pack-quantized: serve reads it with no flag), half a byte"
        " per weight and a scale and zero per group of 128 (default: none, --dtype)",
    )  # fmt: skip
    model.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
        help="fp8: the KV cache in float8 e4m3, as serve --kv-cache-dtype fp8 (a byte per"
        " cached value: twice the tokens of bf16 in the same memory, half the bytes a step"
        " reads from it) (default: auto, --dtype)",
    )  # fmt: skip
    model.add_argument(
        "--tensor-parallel-size", type=_positive(int), default=None, metavar="N",
        help="GPUs one replica is split over, as serve --tensor-parallel-size (llama, mistral,"
        " qwen2, qwen3, phi3, gemma2, gemma3; N divides the heads and the MLP): the memory split is"
        " per GPU, the step adds its all-reduces over --interconnect (default: 1, or the layout"
        " --recommend-layout picks when the model does not fit one GPU in --dtype)",
    )  # fmt: skip
    model.add_argument(
        "--recommend-layout", action="store_true",
        help="size every layout (--dtype and fp8, each on 1, 2, 4 and 8 GPUs), name the cheapest"
        " (fewest GPUs, then most tokens/s per GPU) and plan it (default: only when the"
        " model does not fit one GPU in --dtype and neither --tensor-parallel-size nor"
        " --quantization is given)",
    )  # fmt: skip
    model.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda",
        help="cpu needs --device-memory and a measured cost model (--calibrate or --cost)",
    )  # fmt: skip
    model.add_argument(
        "--gpu", choices=sorted(GPUS), default="h100",
        help="GPU whose data sheet gives the next four flags when they are not given",
    )  # fmt: skip
    model.add_argument(
        "--device-memory", type=_size, metavar="SIZE",
        help="e.g. 80GiB, 141GB (default: the --gpu's)",
    )  # fmt: skip
    model.add_argument(
        "--device-bandwidth", type=_positive(float), metavar="GB/s",
        help="memory bandwidth (default: the --gpu's)",
    )  # fmt: skip
    model.add_argument(
        "--device-flops", type=_positive(float), metavar="TFLOPS",
        help="dense bf16/fp16 peak (default: the --gpu's)",
    )  # fmt: skip
    model.add_argument(
        "--pcie", type=_positive(float), metavar="GB/s",
        help="host to device copies (default: the --gpu's)",
    )  # fmt: skip
    model.add_argument(
        "--interconnect", type=_positive(float), metavar="GB/s",
        help="GPU to GPU, per direction, that tensor parallelism's all-reduces run over"
        " (default: the --gpu's: NVLink, 450 on h100/h200; PCIe on l40s)",
    )  # fmt: skip
    model.add_argument(
        "--reserved", type=_size, default=0, metavar="SIZE",
        help="device memory the weights do not explain (CUDA context, ...)",
    )  # fmt: skip
    adapters = plan.add_argument_group("adapters")
    adapters.add_argument(
        "--adapters", type=_positive(int), default=1000, metavar="N", help="adapters in the pool"
    )
    adapters.add_argument(
        "--adapter-rank", type=_positive(int), default=16, metavar="R", help="their LoRA rank"
    )
    adapters.add_argument(
        "--adapter-modules", type=_modules, default=SUPPORTED_MODULES, metavar="LIST",
        help="the modules they adapt: comma-separated, or all (default: all seven)",
    )  # fmt: skip
    adapters.add_argument(
        "--popularity", default="zipf:1.0", metavar="zipf:S|uniform",
        help="how requests spread over the adapters",
    )  # fmt: skip
    adapters.add_argument(
        "--pinned", type=_count, default=0, metavar="N",
        help="of the adapters, pinned on every replica (kept on the device whatever the"
        " traffic, as `loraplane adapters pin` does): their bytes and slots come off what the"
        " rest of the traffic has, in the memory split and the fleet's simulation; more than"
        " half the adapter memory or slots is refused, as the data plane refuses it",
    )  # fmt: skip
    engine = plan.add_argument_group("engine settings (as `loraplane serve`)")
    engine.add_argument(
        "--lora-memory", default="0.1", metavar="SIZE|FRACTION",
        help="adapter memory: a size, or a share of what the weights leave free",
    )  # fmt: skip
    engine.add_argument(
        "--max-loras", type=_auto_int, default=None, metavar="auto|N",
        help="adapters in one batch (default: auto, what fits)",
    )  # fmt: skip
    engine.add_argument(
        "--max-cpu-loras", type=_auto_int, default=None, metavar="auto|N",
        help="adapters in the host tier (default: auto, as `loraplane serve`)",
    )  # fmt: skip
    engine.add_argument(
        "--max-cpu-lora-bytes", type=_host_bytes, default=None, metavar="SIZE",
        help="host memory the host tier's copies may take, 8GiB, 512MiB or bytes; under"
        " tensor parallelism rank 0 keeps every rank's part (default: no byte limit)",
    )  # fmt: skip
    engine.add_argument(
        "--max-num-seqs", type=_positive(int), default=256, metavar="N",
        help="requests running at once per replica",
    )  # fmt: skip
    engine.add_argument(
        "--max-num-batched-tokens", type=_positive(int), default=4096, metavar="N",
        help="tokens per engine step at most",
    )  # fmt: skip
    engine.add_argument(
        "--max-model-len", type=_positive(int), metavar="N",
        help="longest sequence (default: the model's)",
    )  # fmt: skip
    load = plan.add_argument_group("load and target (sizing the fleet needs --rate)")
    load.add_argument(
        "--rate", type=_positive(float), metavar="REQ/S",
        help="requests per second to serve (default: none, the memory split only)",
    )  # fmt: skip
    load.add_argument(
        "--ttft-p99", type=_positive(float), default=2.0, metavar="SECONDS",
        help="target p99 time to first token",
    )  # fmt: skip
    load.add_argument(
        "--prompt-tokens", type=_positive(int), default=512, metavar="N", help="mean prompt length"
    )
    load.add_argument(
        "--output-tokens", type=_positive(int), default=128, metavar="N", help="mean output length"
    )
    load.add_argument(
        "--spread", type=float, default=0.5, help="lengths uniform within mean x (1 +- spread)"
    )
    load.add_argument(
        "--duration", type=_positive(float), default=40.0, metavar="SECONDS",
        help="simulated time per run",
    )  # fmt: skip
    load.add_argument(
        "--warmup", type=float, default=None, metavar="SECONDS",
        help="simulated time not counted at the start, below --duration (default:"
        f" min({WARMUP_MAX_S:g}, duration / {WARMUP_SHARE:g}))",
    )  # fmt: skip
    load.add_argument("--seed", type=int, default=0, help="the arrivals' random seed")
    load.add_argument(
        "--policies", default=",".join(POLICIES), metavar="LIST",
        help="routing policies to compare, comma-separated",
    )  # fmt: skip
    load.add_argument(
        "--max-replicas", type=_positive(int), default=128, metavar="N",
        help="the largest fleet the search tries",
    )  # fmt: skip
    cost = plan.add_argument_group("cost model (default: the --gpu's roofline)")
    cost.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this engine here (needs --model with weights)",
    )
    cost.add_argument(
        "--cost", metavar="FILE", help="calibrated costs: written by --calibrate, read otherwise"
    )
    out = plan.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument(
        "--plot", metavar="PNG", help="draw p99 TTFT and tokens/s per policy (needs --rate)"
    )
    plan.set_defaults(func=_cmd_plan)


class ArgumentsRefused(ValueError):
    """Flags that cannot give an answer together; the message says what to give."""


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any model work, what the planner cannot answer; fill in the warmup,
    which follows the duration."""
    if args.plot and args.rate is None:
        raise ArgumentsRefused(
            "--plot draws the fleet's p99 TTFT against the replica count, which needs a load:"
            " give --rate REQ/S (and --ttft-p99 for the target)"
        )
    if args.device == "cpu" and not (args.calibrate or args.cost):
        raise ArgumentsRefused(
            "--device cpu: the default cost model is a GPU's roofline (--gpu), which says"
            " nothing about a CPU; measure this machine with --calibrate --model DIR (add"
            " --cost FILE to save the costs), or read costs saved earlier with --cost FILE"
        )
    layout = args.tensor_parallel_size is not None or args.quantization is not None
    if args.recommend_layout and layout:
        raise ArgumentsRefused(
            "--recommend-layout chooses --tensor-parallel-size and --quantization itself:"
            " give either it or those"
        )
    split = (args.tensor_parallel_size or 1) > 1 or args.recommend_layout
    measured = args.device == "cpu" or args.calibrate or args.cost
    if split and measured:
        flag = "--recommend-layout" if args.recommend_layout else "--tensor-parallel-size"
        raise ArgumentsRefused(
            f"{flag} is planned on a GPU's roofline: a calibrated cost model (--calibrate,"
            " --cost, --device cpu) measures one unsplit process"
        )
    if args.warmup is None:
        args.warmup = min(WARMUP_MAX_S, args.duration / WARMUP_SHARE)
    elif not 0 <= args.warmup < args.duration:
        raise ArgumentsRefused(
            f"--warmup {args.warmup:g} must be at least 0 and below --duration {args.duration:g}"
        )


def _cmd_plan(args: argparse.Namespace) -> int:
    from loraplane.planner.report import PlanError, run_plan

    try:
        check_arguments(args)
    except ArgumentsRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = run_plan(args)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.text())
    return 0
