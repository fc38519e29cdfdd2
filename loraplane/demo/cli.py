"""The `loraplane demo` sub-command: `add_commands(subparsers)` registers it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loraplane.demo.families import DEFAULT, FAMILIES

DESCRIPTION = """\
The whole system on this machine, from nothing outside it (no downloads, CPU only):

  1. build, once: a small Llama model (or, with --family, a Qwen3, Gemma 3, Phi-3, Mixtral or
     Qwen3-MoE one) and three tenants' LoRA adapters, trained on CPU in well under a minute
     (seeded; cached in --workdir). Each tenant's adapter answers the same help-desk questions
     in its own voice: acme like a pirate, globex like a legal department, initech in terse
     bullet points.
  2. start the control plane (SQLite catalog, local object store) and a data plane (CPU,
     catalog mode) on localhost; register the pool, create the tenants and their API keys, and
     upload the adapters through the REST API (validated and stored for real).
  3. serve until Ctrl-C, printing ready-to-paste curl and openai examples with the real keys;
     or, with --once, run a scripted tour and exit: one prompt to the base model and each
     adapter, a concurrent mixed batch, each tenant's /v1/models, bad adapters refused with
     their reason codes, and the slot pressure and usage both services report.

The admin token is in .loraplane/admin-token under the folder you run the demo from (mode
0600; written unless one is there): the tenant CLI reads it there. Both services log one JSON
line per request to WORKDIR/run/requests.log (printed; --access-log on: on stderr, beside the
tour; --access-log off; or --access-log-file FILE); the model is
chat-trained: use chat completions, or the chat format <|user|>...</s><|assistant|> as the
prompt of a completion (a bare question gets an empty reply).

Ports: the asked-for ones if free, otherwise free ones (printed). Every run starts with a
fresh catalog and store under WORKDIR/run; the build is reused while its recipe is unchanged.
Building needs transformers and peft (the `demo` extra); later runs do not import them."""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


def _cmd_demo(args: argparse.Namespace) -> int:
    import sys

    from loraplane.accesslog import AccessLogError, chosen, settings_from
    from loraplane.demo.run import run_demo

    try:
        access_log = settings_from(args) if chosen(args) else None  # None: the run's file
    except AccessLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_demo(
        Path(args.workdir),
        once=args.once,
        host=args.host,
        port=args.port,
        controlplane_port=args.controlplane_port,
        rebuild=args.rebuild,
        access_log=access_log,
        family_name=args.family,
    )


def add_commands(sub: Any) -> None:
    """Register `demo` on the `loraplane` command's sub-parsers."""
    demo = sub.add_parser(
        "demo",
        help="the whole system on this machine: build a small model and adapters, serve them",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--once", action="store_true", help="run the scripted tour and exit (0: all went well)"
    )
    demo.add_argument(
        "--workdir",
        default=".loraplane/demo",
        metavar="DIR",
        help="where the build is cached and the run keeps its state (default: %(default)s)",
    )
    demo.add_argument("--rebuild", action="store_true", help="build the model and adapters again")
    demo.add_argument(
        "--family",
        default=DEFAULT,
        choices=list(FAMILIES),
        help="the base model's family, built the same way at the same size with transformers'"
        " class for it, the adapters targeting what PEFT targets on it (fused projections on"
        " phi3, packed experts on mixtral and qwen3_moe); a family other than llama builds in"
        " WORKDIR/NAME (default: %(default)s)",
    )
    demo.add_argument(
        "--host", default="127.0.0.1", help="address both services listen on (default: %(default)s)"
    )
    demo.add_argument(
        "--port",
        type=_port,
        default=8000,
        metavar="N",
        help="data plane (OpenAI API) port; a free one if taken (default: %(default)s)",
    )
    demo.add_argument(
        "--controlplane-port",
        type=_port,
        default=8080,
        metavar="N",
        help="control plane (REST API) port; a free one if taken (default: %(default)s)",
    )
    from loraplane.accesslog import add_arguments as add_access_log

    add_access_log(demo, default="to requests.log in WORKDIR/run")
    demo.set_defaults(func=_cmd_demo)
