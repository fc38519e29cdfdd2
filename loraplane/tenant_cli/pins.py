"""Pinned versions: `adapters pin|unpin|pins` (a tenant key; docs/controlplane.md, "Pinned
adapters").

`pin NAME VERSION --pool P --replicas K` keeps the version resident on K replicas of the pool,
within the tenant's max_pinned_bytes (each pin counts its size times its replicas); a pin that
does not fit is refused with the numbers (exit 1). `unpin` lets the replicas evict it again.
`pins` lists them, each with how many of its replicas hold it and those that refused it, with
the reason (from the replicas' last reports).
"""

from __future__ import annotations

import argparse
from typing import Any

from loraplane.tenant_cli.commands import _connect, _emit, _v


def _line(pin: dict[str, Any]) -> str:
    line = (
        f"{pin['adapter']} {_v(pin['version'])} on {pin['replicas']} replica(s) of pool"
        f" {pin['namespace']}/{pin['pool']} ({pin['pinned_bytes']:,} bytes of your"
        " max_pinned_bytes)"
    )
    if "held" not in pin:  # a control plane from before replicas reported their pins
        return line
    line += f"; held by {pin['held']} of {pin['replicas']}"
    for refusal in pin.get("refused") or []:
        line += f"; refused by {refusal['replica']}: {refusal['reason']}"
    return line


def pin(args: argparse.Namespace) -> int:
    """`adapters pin NAME VERSION --pool P [--replicas K]`."""
    with _connect(args, admin=False) as client:
        result = client.pin_version(
            args.name, args.version, args.pool, args.namespace, args.replicas
        )
    return _emit(args, result, [f"pinned: {_line(result)}"])


def unpin(args: argparse.Namespace) -> int:
    """`adapters unpin NAME VERSION --pool P`."""
    with _connect(args, admin=False) as client:
        client.unpin_version(args.name, args.version, args.pool, args.namespace)
    document = {"name": args.name, "version": args.version, "pinned": False}
    where = f"{args.namespace}/{args.pool}"
    return _emit(args, document, [f"unpinned: {args.name} {_v(args.version)} on pool {where}"])


def list_pins(args: argparse.Namespace) -> int:
    """`adapters pins`: the caller's pinned versions."""
    with _connect(args, admin=False) as client:
        pins = client.list_pins()
    lines = [_line(p) for p in pins] or ["no pinned versions"]
    return _emit(args, pins, lines)
