"""Weighted rollouts from the command line: `adapters rollout set|promote|rollback` (a tenant
key; docs/controlplane.md, "Weighted rollouts").

`rollout set NAME 2=90 3=10` splits the plain name's requests across versions by weight
(integers summing to 100, at most 4 versions; one at 100 promotes it). `rollout promote NAME
[VERSION]` serves one version of the split alone (by default its one version besides the
current) and `rollout rollback NAME` ends the split: the current version serves alone again.
Each asks for confirmation on a terminal (`--yes` answers for it). `NAME@VERSION` requests are
never split.
"""

from __future__ import annotations

import argparse
from typing import Any

from loraplane.tenant_cli import confirm
from loraplane.tenant_cli.commands import _connect, _emit, _v


def split_words(split: dict[int, int] | list[dict[str, Any]] | None) -> str:
    """A split in few words: "v2 90%, v3 10%" ("none" for no split)."""
    if not split:
        return "none"
    pairs = (
        sorted(split.items())
        if isinstance(split, dict)
        else [(v["version"], v["weight"]) for v in split]
    )
    return ", ".join(f"v{v} {w}%" for v, w in pairs)


def _lines(adapter: dict[str, Any]) -> list[str]:
    name, current = adapter["name"], adapter["current_version"]
    split = adapter.get("rollout")
    if split:
        return [
            f"rollout: {name} {split_words(split)} (rollback serves {_v(current)}; "
            f"`loraplane adapters rollout promote {name}` or `... rollback {name}`)"
        ]
    return [f"serving: {name} {_v(current)} alone (no rollout)"]


def set_split(args: argparse.Namespace) -> int:
    """`adapters rollout set NAME V=W ...`: split the plain name's requests by weight."""
    confirm.require(args)
    weights: dict[int, int] = dict(args.weights)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        now = adapter.get("rollout")
        confirm.ask(
            args,
            f"Split {args.name}'s requests {split_words(weights)} (now "
            f"{split_words(now) if now else _v(adapter['current_version']) + ' alone'})?",
        )
        adapter = client.set_rollout(args.name, weights)
    return _emit(args, adapter, _lines(adapter))


def promote(args: argparse.Namespace) -> int:
    """`adapters rollout promote NAME [VERSION]`: serve that version of the split alone."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        which = _v(args.version) if args.version else "its canary"
        if adapter.get("rollout"):  # none running: the control plane's refusal says so
            confirm.ask(
                args,
                f"End {args.name}'s rollout ({split_words(adapter['rollout'])}) by serving "
                f"{which} alone, and keep serving it when new versions are pushed?",
            )
        adapter = client.end_rollout(args.name, "promote", args.version)
    return _emit(args, adapter, _lines(adapter))


def rollback(args: argparse.Namespace) -> int:
    """`adapters rollout rollback NAME`: end the split; the current version serves alone."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        if adapter.get("rollout"):
            confirm.ask(
                args,
                f"End {args.name}'s rollout ({split_words(adapter['rollout'])}) and serve "
                f"{_v(adapter['current_version'])} alone?",
            )
        adapter = client.end_rollout(args.name, "rollback")
    return _emit(args, adapter, _lines(adapter))


def weight_pair(text: str) -> tuple[int, int]:
    """`2=90` (or `v2=90`) -> (2, 90); argparse shows the error for anything else."""
    version, sep, weight = text.partition("=")
    version = version.removeprefix("v")
    if not sep or not version.isdigit() or not weight.isdigit() or int(version) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not VERSION=WEIGHT (e.g. 2=90: version 2 takes 90% of the requests)"
        )
    return int(version), int(weight)
