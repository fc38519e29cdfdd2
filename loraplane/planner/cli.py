"""`loraplane plan`: the capacity planner's command (`add_commands` registers it)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loraplane.adapters.base_model import SUPPORTED_MODULES
from loraplane.sizes import parse_memory

EXIT_USAGE = 2

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
(--calibrate, saved and reused with --cost FILE).

examples:
  loraplane plan --model-shape llama-3-8b --device-memory 80GiB --device-bandwidth 3350
  loraplane plan --model-shape llama-3-8b --gpu h200 --adapters 2000 --adapter-rank 16 \\
      --popularity zipf:1.0 --rate 50 --ttft-p99 2.0 --plot plan.png
  loraplane plan --model ./Llama-3.1-8B --adapter-modules q_proj,v_proj --json
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


def _auto_int(text: str) -> int | None:
    if text == "auto":
        return None
    value: int = _positive(int)(text)
    return value


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


def add_commands(subparsers: Any) -> None:
    """Register `plan` on the `loraplane` command's sub-parsers."""
    from loraplane.planner.cost import GPUS
    from loraplane.planner.routing import POLICIES
    from loraplane.planner.shapes import SHAPES

    plan = subparsers.add_parser(
        "plan",
        help="capacity planner: memory split, adapters per replica, replicas for a load",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = plan.add_argument_group("model and device")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="model folder (its config.json)")
    which.add_argument("--model-shape", metavar="NAME", help=f"one of {', '.join(SHAPES)}")
    model.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    model.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    model.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        default="h100",
        help="GPU whose data sheet gives the defaults below (default h100)",
    )
    model.add_argument("--device-memory", type=_size, metavar="SIZE", help="e.g. 80GiB, 141GB")
    model.add_argument("--device-bandwidth", type=_positive(float), metavar="GB/s")
    model.add_argument(
        "--device-flops", type=_positive(float), metavar="TFLOPS", help="dense bf16/fp16 peak"
    )
    model.add_argument(
        "--pcie", type=_positive(float), metavar="GB/s", help="host to device copies"
    )
    model.add_argument(
        "--reserved",
        type=_size,
        default=0,
        metavar="SIZE",
        help="device memory the weights do not explain (CUDA context, ...)",
    )
    adapters = plan.add_argument_group("adapters")
    adapters.add_argument("--adapters", type=_positive(int), default=1000, metavar="N")
    adapters.add_argument("--adapter-rank", type=_positive(int), default=16, metavar="R")
    adapters.add_argument(
        "--adapter-modules",
        type=_modules,
        default=SUPPORTED_MODULES,
        metavar="LIST",
        help="comma-separated, or all (default: all seven)",
    )
    adapters.add_argument("--popularity", default="zipf:1.0", metavar="zipf:S|uniform")
    engine = plan.add_argument_group("engine settings (as `loraplane serve`)")
    engine.add_argument("--lora-memory", default="0.1", metavar="SIZE|FRACTION")
    engine.add_argument("--max-loras", type=_auto_int, default=None, metavar="auto|N")
    engine.add_argument("--max-cpu-loras", type=_auto_int, default=None, metavar="auto|N")
    engine.add_argument("--max-num-seqs", type=_positive(int), default=256, metavar="N")
    engine.add_argument("--max-num-batched-tokens", type=_positive(int), default=4096, metavar="N")
    engine.add_argument("--max-model-len", type=_positive(int), metavar="N")
    load = plan.add_argument_group("load and target")
    load.add_argument("--rate", type=_positive(float), metavar="REQ/S")
    load.add_argument("--ttft-p99", type=_positive(float), default=2.0, metavar="SECONDS")
    load.add_argument("--prompt-tokens", type=_positive(int), default=512, metavar="N")
    load.add_argument("--output-tokens", type=_positive(int), default=128, metavar="N")
    load.add_argument(
        "--spread",
        type=float,
        default=0.5,
        help="lengths uniform within mean x (1 +- spread) (default 0.5)",
    )
    load.add_argument(
        "--duration",
        type=_positive(float),
        default=40.0,
        metavar="SECONDS",
        help="simulated time per run (default 40)",
    )
    load.add_argument("--warmup", type=float, default=10.0, metavar="SECONDS")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--policies", default=",".join(POLICIES), metavar="LIST")
    load.add_argument("--max-replicas", type=_positive(int), default=128, metavar="N")
    cost = plan.add_argument_group("cost model")
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
    out.add_argument("--plot", metavar="PNG", help="draw p99 TTFT and tokens/s per policy")
    plan.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from loraplane.planner.report import PlanError, run_plan

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
