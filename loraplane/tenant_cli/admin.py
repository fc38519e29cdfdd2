"""Admin commands beyond keys and quotas: `tenants delete` and `pools list|show|create|update|
delete` (the admin token), over the control plane's tenant and pool routes.

A pool is named by its namespace and name (`--namespace`, default "default"): in a cluster
the operator mirrors each ServingPool there, so a pool deleted here while its ServingPool
exists comes back at the operator's next sync. Deleting asks for confirmation on a terminal
(`--yes` answers for it; see `confirm`).
"""

from __future__ import annotations

import argparse
from typing import Any

from loraplane.tenant_cli import confirm
from loraplane.tenant_cli.commands import UsageError, _connect, _emit, _table

# The pool limit flags of `pools create` and `pools update`: the API's field names.
POOL_LIMITS = ("max_lora_rank", "max_loras", "max_cpu_loras", "max_cpu_lora_bytes",
               "require_signed_adapters")  # fmt: skip
# What `--max-cpu-lora-bytes none` parses to: no byte limit, sent as null (which `pools update`
# uses to clear one; the API's PATCH takes null for it), shown as "none" as `pools show` does
NO_LIMIT = "none"


# -- tenants --------------------------------------------------------------------------------------


def delete_tenant(args: argparse.Namespace) -> int:
    """`tenants delete NAME`: revoke its keys and stop serving its adapters, for good."""
    confirm.require(args)
    with _connect(args, admin=True) as client:
        client.get_tenant(args.name)  # NotFound before anyone is asked
        live = [k for k in client.list_keys(args.name) if not k["revoked_at"]]
        confirm.ask(
            args,
            f"Delete tenant {args.name}? Its {len(live)} live key(s) are revoked and its "
            "adapters stop serving at once; the name cannot be used again.",
        )
        client.delete_tenant(args.name)
    document = {"name": args.name, "deleted": True, "keys_revoked": len(live)}
    return _emit(
        args,
        document,
        [f"deleted: tenant {args.name} ({len(live)} key(s) revoked, adapters no longer served)"],
    )


# -- pools ----------------------------------------------------------------------------------------


def _ref(pool: dict[str, Any]) -> str:
    return f"{pool['namespace']}/{pool['name']}"


def _replicas(pool: dict[str, Any]) -> int:
    """Replicas that have reported pressure (live or not: `pools show` has the times)."""
    return len(((pool.get("pressure") or {}).get("replicas")) or {})


def _config_state(pool: dict[str, Any]) -> str:
    config = pool.get("base_model_config")
    if config is None:
        return "pending (from the replicas' first report)"
    return str(config.get("model_type") or "known")


def _limit(value: Any) -> str:
    return "none" if value is None else str(value)  # a null byte limit: none


def _pool_lines(pool: dict[str, Any], verb: str) -> list[str]:
    lines = [
        f"{verb}pool {_ref(pool)}",
        f"  base model      {pool['base_model']['name']} ({pool['base_model']['uri']})",
        f"  model config    {_config_state(pool)}",
        *(f"  {f:<14}  {_limit(pool[f])}" for f in POOL_LIMITS if f in pool),
        f"  replicas        {_replicas(pool)} reported",
    ]
    for replica, report in sorted(((pool.get("pressure") or {}).get("replicas") or {}).items()):
        when = str(report.get("time", "-"))[:19].replace("T", " ")
        lines.append(
            f"    {replica}  last report {when}: {report.get('running_adapters', 0)} adapters "
            f"running, {report.get('waiting_adapters', 0)} waiting, "
            f"{report.get('deferred', 0)} requests deferred, {report.get('cpu_bytes', 0)} bytes of"
            f" adapters in host memory"
        )
    return lines


def list_pools(args: argparse.Namespace) -> int:
    """`pools list`: every pool, its base model and limits."""
    with _connect(args, admin=True) as client:
        pools = client.list_pools()
    rows = [
        [
            p["namespace"],
            p["name"],
            p["base_model"]["name"],
            "yes" if p.get("base_model_config") is not None else "pending",
            str(p["max_lora_rank"]),
            str(p["max_loras"]),
            str(p["max_cpu_loras"]),
            str(_replicas(p)),
        ]
        for p in pools
    ]
    header = ["NAMESPACE", "NAME", "BASE MODEL", "CONFIG", "MAX RANK", "MAX LORAS",
              "CPU LORAS", "REPLICAS"]  # fmt: skip
    return _emit(args, pools, _table(header, rows, "no pools"))


def show_pool(args: argparse.Namespace) -> int:
    """`pools show NAME`: one pool, with its replicas' last reports."""
    with _connect(args, admin=True) as client:
        pool = client.get_pool(args.name, args.namespace)
    return _emit(args, pool, _pool_lines(pool, ""))


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The limit flags given, as the API takes them (`none` as null)."""
    given = {f: getattr(args, f) for f in POOL_LIMITS if getattr(args, f, None) is not None}
    return {f: None if value == NO_LIMIT else value for f, value in given.items()}


def create_pool(args: argparse.Namespace) -> int:
    """`pools create NAME --base-model M --base-model-uri URI`: register a pool."""
    base: dict[str, Any] = {"name": args.base_model, "uri": args.base_model_uri}
    if args.config_from_replicas:
        base["config_from_replicas"] = True
    body = {"namespace": args.namespace, "name": args.name, "base_model": base, **_limits(args)}
    with _connect(args, admin=True) as client:
        pool = client.create_pool(body)
    return _emit(args, pool, _pool_lines(pool, "created: "))


def update_pool(args: argparse.Namespace) -> int:
    """`pools update NAME`: change the limits given; the others keep their value."""
    limits = _limits(args)
    if not limits:
        flags = ", ".join("--" + f.replace("_", "-") for f in POOL_LIMITS)
        raise UsageError(f"nothing to change: pass at least one of {flags}")
    with _connect(args, admin=True) as client:
        pool = client.update_pool(args.name, args.namespace, limits)
    return _emit(args, pool, _pool_lines(pool, "updated: "))


def delete_pool(args: argparse.Namespace) -> int:
    """`pools delete NAME`: forget a pool; stored adapters are kept."""
    confirm.require(args)
    with _connect(args, admin=True) as client:
        pool = client.get_pool(args.name, args.namespace)  # NotFound before anyone is asked
        confirm.ask(
            args,
            f"Delete pool {_ref(pool)} (base model {pool['base_model']['name']})? Uploads for "
            "that base model are refused unless another pool serves it; stored adapters are "
            "kept.",
        )
        client.delete_pool(args.name, args.namespace)
    document = {"namespace": pool["namespace"], "name": pool["name"], "deleted": True}
    return _emit(args, document, [f"deleted: pool {_ref(pool)}"])
