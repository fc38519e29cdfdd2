"""The `loraplane` command.

Sub-commands: `adapters validate`, the tenant CLI on the REST API (`adapters push|list|versions`,
`keys`, `tenants`), `demo`, `serve` (the data plane), `controlplane` (and `controlplane
migrate`), `operator` (and `operator crds`), `plan` (the capacity planner). Each component
registers its own sub-commands and imports its heavy modules only when a command runs, so
`loraplane --help` stays fast and the control plane and operator never load torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from loraplane.sizes import format_bytes

__all__ = ["EXIT_OK", "EXIT_REJECTED", "EXIT_USAGE", "build_parser", "main"]
# `validate --base-model` was a folder, `push --base-model` a served name: one meaning per flag
DEPRECATED_BASE_MODEL = (
    "warning: `adapters validate --base-model DIR` is deprecated: use --base-model-dir DIR"
    " (--base-model names a served base model, as in `adapters push`)"
)


def _cmd_validate(args: argparse.Namespace) -> int:
    from loraplane import fileaccess
    from loraplane.adapters.base_model import BaseModelError, BaseModelSpec
    from loraplane.adapters.canonical import canonical_digest
    from loraplane.adapters.errors import AdapterRejected
    from loraplane.adapters.limits import AdapterLimits
    from loraplane.adapters.source import open_adapter_source
    from loraplane.adapters.validate import validate_adapter

    path = Path(args.path)
    try:
        exists = path.exists()
    except OSError as e:  # a folder on the way that this user cannot enter
        print(f"error: {fileaccess.message(e)}", file=sys.stderr)
        return EXIT_USAGE
    if not exists:
        print(f"error: {path} does not exist", file=sys.stderr)
        return EXIT_USAGE
    base = None
    base_dir, flag = args.base_model_dir, "--base-model-dir"
    if args.base_model_deprecated is not None:
        if base_dir is not None:
            print("error: give --base-model-dir only (--base-model is its old name)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
        print(DEPRECATED_BASE_MODEL, file=sys.stderr)
        base_dir, flag = args.base_model_deprecated, "--base-model"
    if base_dir is not None:
        try:
            base = BaseModelSpec.from_dir(base_dir)
        except BaseModelError as e:
            print(f"error: {flag}: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        limits = AdapterLimits(max_rank=args.max_rank)
    except ValueError as e:
        print(f"error: --max-rank: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with open_adapter_source(path, limits) as files:
            adapter = validate_adapter(files, base, limits)
            try:
                summary = adapter.summary()
                digest = canonical_digest(adapter)
                ignored = list(files.ignored)
            finally:
                adapter.close()
    except AdapterRejected as e:
        if args.json:
            print(json.dumps({"valid": False, "code": e.code.value, "message": e.message}))
        else:
            print(f"rejected: {e.code.value}: {e.message}")
        return EXIT_REJECTED
    except OSError as e:  # not a verdict on the adapter: this user may not read it
        print(f"error: {fileaccess.message(e)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        out = {"valid": True, "code": None, "message": "valid", "path": str(path)}
        print(json.dumps({**out, **summary, "digest": digest, "ignored": ignored}))
        return EXIT_OK
    ranks = ", ".join(map(str, summary["ranks"]))
    scales = ", ".join(f"{s:g}" for s in summary["scales"])
    unchecked = "not checked (pass --base-model-dir DIR)"
    base_line = f"{base.name} (shapes checked)" if base else unchecked
    print(f"valid: {path}")
    for label, value in (
        ("rank", f"{summary['rank']} (per module: {ranks})"),
        ("alpha", f"{summary['alpha']:g} (scale {scales}; rslora {summary['use_rslora']})"),
        (
            "modules",
            f"{', '.join(summary['target_modules'])} "
            f"({summary['modules']} adapted layers over {summary['layers']} blocks)",
        ),
        ("tensors", f"{summary['tensors']} ({', '.join(summary['dtypes'])})"),
        ("size", format_bytes(summary["size_bytes"])),
        ("digest", f"sha256:{digest}"),
        ("base model", base_line),
        *([("ignored", f"{', '.join(ignored)} (never opened)")] if ignored else []),
    ):
        print(f"  {label:<11} {value}")
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplane",
        description="Serve many tenants' LoRA fine-tunes of one base model from one GPU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from loraplane.demo.cli import add_commands as add_demo

    add_demo(sub)

    adapters = sub.add_parser("adapters", help="work with LoRA adapter files")
    asub = adapters.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)
    validate = asub.add_parser(
        "validate",
        help="check a PEFT LoRA adapter the way uploads are checked",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check a PEFT LoRA adapter (a folder with adapter_config.json and\n"
            "adapter_model.safetensors, or a .tar.gz/.zip of them) the way uploads are\n"
            "checked, without storing anything. Pickled weights are refused, never opened;\n"
            "a Trainer checkpoint's other files (training_args.bin, optimizer.pt, ...) are\n"
            "ignored and listed.\n\n"
            "Exit 0: valid; a summary (rank, alpha, modules, size, digest) is printed.\n"
            "Exit 1: rejected; prints 'rejected: <ReasonCode>: <message>'.\n"
            "Exit 2: usage error."
        ),
    )
    validate.add_argument("path", metavar="PATH", help="adapter folder or archive")
    validate.add_argument(
        "--base-model-dir",
        metavar="DIR",
        help="HF model folder whose config.json gives the shapes (default: shapes not checked)",
    )
    # the old name of --base-model-dir, kept working with a warning; hidden from --help
    validate.add_argument("--base-model", dest="base_model_deprecated", help=argparse.SUPPRESS)
    validate.add_argument(
        "--max-rank", type=_positive_int, metavar="N", help="reject ranks above N"
    )
    validate.add_argument("--json", action="store_true", help="print one JSON object")
    validate.set_defaults(func=_cmd_validate)

    from loraplane.tenant_cli.parsers import add_adapter_commands
    from loraplane.tenant_cli.parsers import add_commands as add_tenant_commands

    add_adapter_commands(asub)
    add_tenant_commands(sub)

    from loraplane.controlplane.cli import add_commands as add_controlplane
    from loraplane.dataplane.server.cli import add_commands as add_serve
    from loraplane.operator.cli import add_commands as add_operator
    from loraplane.planner.cli import add_commands as add_plan

    add_serve(sub)
    add_controlplane(sub)
    add_operator(sub)
    add_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C where a command does not handle it: no traceback
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code
