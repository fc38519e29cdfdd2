"""What an adapter's plain name serves, and deleting it: `adapters serve|rollback|follow-latest|
delete` (a tenant key).

`serve NAME VERSION` serves a recorded version and holds it: later pushes add versions but do
not change what is served. `rollback NAME` serves the version before the current one (and
holds it). `follow-latest NAME` serves the newest version and lets each later push serve its
new version again. `delete NAME` stops serving the name (its versions stay stored). Each asks
for confirmation on a terminal (`--yes` answers for it; see `confirm`). Replicas pick a change
up within their resolve cache's lifetime (seconds); `NAME@VERSION` requests are not affected.
"""

from __future__ import annotations

import argparse
from typing import Any

from loraplane.tenant_cli import confirm
from loraplane.tenant_cli.commands import _connect, _emit, _v


def _serving_lines(adapter: dict[str, Any]) -> list[str]:
    """What the adapter serves now, and whether pushes change it."""
    name, current, latest = adapter["name"], adapter["current_version"], adapter["latest_version"]
    if adapter["follow_latest"]:
        return [f"serving: {name} {_v(current)}, following the latest (each push serves its "
                "new version)"]  # fmt: skip
    return [
        f"serving: {name} {_v(current)}, held (pushes do not change it; latest {_v(latest)}; "
        f"follow the latest again with `loraplane adapters follow-latest {name}`)"
    ]


def serve(args: argparse.Namespace) -> int:
    """`adapters serve NAME VERSION`: serve that version and hold it."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        recorded = {v["version"] for v in client.list_versions(args.name)}
        # a version that is not there changes nothing: the control plane's refusal names
        # the versions there are, so nobody is asked about a change that cannot happen
        if args.version in recorded and (args.version, False) != _mode(adapter):
            confirm.ask(
                args,
                f"Serve {args.name} {_v(args.version)} instead of "
                f"{_v(adapter['current_version'])}, and keep serving it when new versions "
                "are pushed?",
            )
        adapter = client.serve_version(args.name, args.version)
    return _emit(args, adapter, _serving_lines(adapter))


def rollback(args: argparse.Namespace) -> int:
    """`adapters rollback NAME`: serve the version before the current one, and hold it."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        current = adapter["current_version"]
        earlier = [v["version"] for v in client.list_versions(args.name)]
        earlier = [v for v in earlier if current is not None and v < current]
        if not earlier:
            from loraplane.tenant_cli.client import ApiError  # httpx: only when a command runs

            where = (
                f"serves {_v(current)}, its oldest version"
                if current is not None
                else "serves no version yet"
            )
            raise ApiError(
                "NoEarlierVersion",
                f"{args.name} {where}: there is no earlier version to roll back to (see: "
                f"loraplane adapters versions {args.name})",
                refused=True,
            )
        target = max(earlier)
        confirm.ask(
            args,
            f"Roll {args.name} back from {_v(current)} to {_v(target)}, and keep serving "
            f"{_v(target)} when new versions are pushed?",
        )
        adapter = client.serve_version(args.name, target)
    return _emit(args, adapter, _serving_lines(adapter))


def follow_latest(args: argparse.Namespace) -> int:
    """`adapters follow-latest NAME`: serve the newest version and each later push's."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        latest = adapter["latest_version"]
        if _mode(adapter) != (latest, True):
            confirm.ask(
                args,
                f"Serve {args.name}'s latest version {_v(latest)} (now "
                f"{_v(adapter['current_version'])}), and each new version when it is pushed?",
            )
        adapter = client.serve_version(args.name, None)
    return _emit(args, adapter, _serving_lines(adapter))


def delete(args: argparse.Namespace) -> int:
    """`adapters delete NAME`: stop serving it; its versions stay stored."""
    confirm.require(args)
    with _connect(args, admin=False) as client:
        adapter = client.get_adapter(args.name)
        confirm.ask(
            args,
            f"Delete adapter {args.name} (serving {_v(adapter['current_version'])})? Requests "
            "for it fail from now on; its versions stay stored, and pushing the name again "
            "starts it afresh.",
        )
        client.delete_adapter(args.name)
    document = {"name": args.name, "deleted": True}
    return _emit(
        args,
        document,
        [f"deleted: adapter {args.name} (no longer served; it no longer counts against "
         "max_adapters)"],
    )  # fmt: skip


def _mode(adapter: dict[str, Any]) -> tuple[int | None, bool]:
    return adapter["current_version"], bool(adapter["follow_latest"])
