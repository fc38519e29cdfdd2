"""`loraplane operator` (run the Kopf operator in this process) and `loraplane operator crds`.

The operator runs standalone (no peering objects), over `--namespace NS` (repeatable) or
`--all-namespaces`; its settings come from `LORAPLANE_*` (see `settings`). `crds` prints the
CRD YAML (the one source, `crds.py`) or writes the files with `--output-dir`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_USAGE = 0, 2


def add_commands(subparsers: Any) -> None:
    """Register `operator` (and `operator crds`) on the `loraplane` command's sub-parsers."""
    from loraplane.operator.settings import settings_help

    op = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator (LoRAAdapter, ServingPool)",
        description="Run the Kopf operator in this process (standalone: one at a time). "
        "Settings come from the LORAPLANE_* variables below.",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeat)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    op.add_argument("--liveness", metavar="URL", help="e.g. http://0.0.0.0:8081/healthz")
    op.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        metavar="PORT",
        help="serve Prometheus metrics (per ServingPool: replicas, bounds, targets, pressure, "
        "scale events) at :PORT/metrics; 0 turns them off (default: 8080)",
    )
    op.add_argument(  # in a pod, Prometheus scrapes the pod's IP: every interface
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104
        metavar="HOST",
        help="address for --metrics-port (default: 0.0.0.0)",
    )
    op.add_argument("--verbose", action="store_true", help="debug logging")
    op.set_defaults(func=run_operator)
    sub = op.add_subparsers(dest="operator_command", metavar="ACTION")
    crds = sub.add_parser("crds", help="print the CRD manifests (YAML)")
    crds.add_argument("--output-dir", metavar="DIR", help="write the files here instead")
    crds.set_defaults(func=print_crds)


def print_crds(args: argparse.Namespace) -> int:
    """Print both CRDs as one YAML stream, or write them into --output-dir."""
    from loraplane.operator import crds

    if args.output_dir:
        for path in crds.write(Path(args.output_dir)):
            print(path)
        return EXIT_OK
    print("---\n".join(crds.rendered_files().values()), end="")
    return EXIT_OK


def run_operator(args: argparse.Namespace) -> int:
    """Run Kopf with the operator's registry until it is stopped."""
    import tempfile

    import kopf
    from kubernetes.config.config_exception import ConfigException

    from loraplane import fileaccess
    from loraplane.adapters.store.local import LocalStore
    from loraplane.operator.context import OperatorContext
    from loraplane.operator.registry import build_registry
    from loraplane.operator.settings import OperatorSettings, SettingsError

    try:
        settings = OperatorSettings.from_env(os.environ)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.namespace and not args.all_namespaces:
        print("error: pass --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return EXIT_USAGE
    if not 0 <= args.metrics_port <= 65535:
        print(f"error: --metrics-port {args.metrics_port} is not a port", file=sys.stderr)
        return EXIT_USAGE
    kopf.configure(verbose=args.verbose)
    try:
        ctx = OperatorContext.create(settings)
    except (OSError, ConfigException) as exc:  # an unreadable kubeconfig, no credentials
        print(f"error: no Kubernetes credentials (in-cluster or KUBECONFIG): "
              f"{fileaccess.message(exc)}", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if isinstance(ctx.store, LocalStore):  # versions are written there
        try:
            fileaccess.check_writable_dir(ctx.store.url())
        except OSError as exc:
            print(f"error: LORAPLANE_STORE: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:  # each source is fetched into a temp folder there (a pod mounts /tmp writable)
        fileaccess.check_writable_dir(tempfile.gettempdir())
    except OSError as exc:
        print(f"error: the temp folder (TMPDIR): {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.metrics_port:
        try:
            ctx.metrics.serve(args.metrics_host, args.metrics_port)
        except OSError as exc:
            print(f"error: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
                  f"{exc}", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
    memo = kopf.Memo(ctx=ctx)
    kopf.run(
        registry=build_registry(pool_interval=settings.pool_interval_seconds),
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        memo=memo,
    )
    return EXIT_OK
