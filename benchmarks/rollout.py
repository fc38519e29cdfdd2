"""Weighted rollouts: the split a replica serves, and whether the canary meets a request cold.

The control plane (SQLite, local store) and a data plane in catalog mode, each served over real
HTTP by uvicorn from a thread of this process (the data plane's engine on a thread too, so the
benchmark can see, for each request, whether its adapter version was in host memory when the
request asked for it). A tenant pushes two versions of one adapter and holds v1; the replica
serves `--warm` requests on v1; then the tenant sets a 90/10 rollout (`PATCH /v1/adapters/bot`
with `{"rollout": {"1": 90, "2": 10}}`) and, once the replica's resolve cache has expired,
`--requests` requests for the plain name run, `--concurrency` at a time.

Figures: the canary's observed share, read from the metrics port's
`loraplane_adapter_version_requests_total` (per version), its distance from 10% in points,
and `canary_cold_requests`: requests that ran on the canary while it was not in host memory
(a load the shift caused on the request path). Goals: the share within 2 points of 10%, and 0
cold requests on the canary.

With `--sticky K` each request carries the OpenAI `user` field, one of K keys in turn (each
key asked requests/K times): a key's version is then its bucket's (server/rollout.py), so the
canary's requests are exactly those whose key's bucket lies in the top 10%, bar the requests
that came while the canary loaded. Figures beside the split: `sticky_expected_canary` (what
the buckets say) and `sticky_mismatch_requests` (how far the metrics' count is from it);
reported as `rollout_sticky`.

Run: .venv/bin/python benchmarks/rollout.py [--requests 2000] [--concurrency 8] [--sticky 500]
(about 40 s on 2 cores; --smoke: a smaller model, the same 2,000 requests)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import add_smoke_flag, goal, report
from noisy_neighbour import SHAPE, SMOKE_SHAPE
from pydantic import SecretStr
from server_http import REPO
from tiers import qv_adapter

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.controlplane.settings import Settings
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.app import create_app as create_dataplane
from loraplane.dataplane.server.catalog import Resolved
from loraplane.dataplane.server.metrics_port import create_metrics_app
from loraplane.dataplane.server.rollout import bucket
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.demo.build import build_llama

BASE, POOL, TENANT = "base", "bench", "acme"
ADMIN, SERVICE = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
SPLIT = {"1": 90, "2": 10}
TTL_S = 0.5  # the replica's resolve cache: the split reaches it this long after the PATCH


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    sys.path.insert(0, str(REPO))  # the uvicorn-in-a-thread helper lives with the tests
    from tests.servers import serve_in_thread

    with serve_in_thread(app) as url:
        yield url


def versions_served(metrics_url: str) -> dict[str, float]:
    """loraplane_adapter_version_requests_total of adapter bot, by version."""
    counts: dict[str, float] = {}
    for line in httpx.get(metrics_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("loraplane_adapter_version_requests_total{") and 'adapter="bot"' in line:
            version = line.split('version="', 1)[1].split('"', 1)[0]
            counts[version] = float(line.rsplit(" ", 1)[1])
    return counts


def sticky_user(i: int, keys: int) -> str | None:
    """Request `i`'s `user` under `--sticky keys` (None without)."""
    return f"user-{i % keys}" if keys else None


async def load(url: str, key: str, n: int, concurrency: int, keys: int = 0) -> list[int]:
    """`n` completions of `bot` (one token each), `concurrency` at a time, each with its
    sticky `user` when `keys`: their statuses."""
    statuses: list[int] = []
    left = iter(range(n))
    body = {"model": "bot", "prompt": "hello", "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    ) as client:

        async def worker() -> None:
            for i in left:
                user = sticky_user(i, keys)
                sent = body if user is None else {**body, "user": user}
                statuses.append((await client.post("/v1/completions", json=sent)).status_code)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sticky", type=int, default=0, metavar="K",
                        help="each request's `user` one of K keys (sticky versions)")  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollout-") as tmp:
        root = Path(tmp)
        model = build_llama(root / "model", **(SMOKE_SHAPE if args.smoke else SHAPE))
        spec = BaseModelSpec.from_dir(model)
        sources = [qv_adapter(spec, root / f"v{v}", seed=v, rank=8) for v in (1, 2)]
        settings = Settings(
            data_dir=root / "cp", database_url=f"sqlite:///{root / 'c.db'}",
            store=str(root / "store"), admin_token=SecretStr(ADMIN),
            service_token=SecretStr(SERVICE),
        )  # fmt: skip
        cp_app = create_controlplane(settings)
        try:
            with served(cp_app) as cp:
                return run(args, cp, model, sources, root)
        finally:
            cp_app.state.ctx.close()


def run(args: argparse.Namespace, cp: str, model: Path, sources: list[Path], root: Path) -> int:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    pool = {"name": POOL, "max_lora_rank": 64, "base_model": {"name": BASE, "uri": str(model)}}
    httpx.post(cp + "/v1/pools", json=pool, headers=admin).raise_for_status()
    unlimited = {"requests_per_minute": 0, "tokens_per_minute": 0}
    httpx.post(cp + "/v1/tenants", json={"name": TENANT, **unlimited}, headers=admin)
    key = httpx.post(cp + f"/v1/tenants/{TENANT}/keys", json={"name": "k"}, headers=admin).json()[
        "key"
    ]
    auth = {"Authorization": f"Bearer {key}"}
    digests = {}
    for version, src in enumerate(sources, 1):
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        r = httpx.post(cp + "/v1/adapters", data={"name": "bot", "base_model": BASE},
                       files=files, headers=auth, timeout=120)  # fmt: skip
        r.raise_for_status()
        digests[r.json()["version"]["digest"]] = str(version)
    httpx.patch(
        cp + "/v1/adapters/bot", json={"current_version": 1}, headers=auth
    ).raise_for_status()

    config = ServerSettings(
        model=str(model), served_model_name=BASE, controlplane_url=cp, service_token=SERVICE,
        store=str(root / "store"), pool=POOL, num_kv_blocks=512, engine_process=False,
        resolve_ttl_s=TTL_S,
    )  # fmt: skip
    app = create_dataplane(config)
    with served(app) as url:
        deadline = time.monotonic() + 300
        while httpx.get(url + "/ready", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the data plane did not become ready")
            time.sleep(0.1)
        runtime = app.state.runtime
        loras = runtime.engine.engine.loras
        held: list[tuple[str, bool]] = []  # (version, in host memory when its request came)
        hold = runtime._hold

        async def watched(resolved: Resolved, model_name: str) -> Any:
            if resolved.digest is not None and resolved.adapter is not None:
                ref = LoRARef(resolved.adapter, resolved.tenant, resolved.digest)
                held.append((digests.get(resolved.digest, "?"), loras.in_host_memory(ref)))
            return await hold(resolved, model_name)

        runtime._hold = watched
        with served(create_metrics_app(runtime)) as metrics_url:
            warm = asyncio.run(load(url, key, args.warm, 1))
            before = versions_served(metrics_url)
            r = httpx.patch(cp + "/v1/adapters/bot", json={"rollout": SPLIT}, headers=auth)
            if r.status_code != 200:
                raise RuntimeError(f"PATCH rollout: {r.status_code} {r.text[:300]}")
            time.sleep(TTL_S + 0.2)  # the replica's cached answer expires: the next asks anew
            shifted = len(held)
            start = time.perf_counter()
            statuses = asyncio.run(load(url, key, args.requests, args.concurrency, args.sticky))
            seconds = time.perf_counter() - start
            after = versions_served(metrics_url)
    counted = {v: after.get(v, 0.0) - before.get(v, 0.0) for v in ("1", "2")}
    total = sum(counted.values())
    share = 100.0 * counted["2"] / total if total else 0.0
    canary = [warm_ for version, warm_ in held[shifted:] if version == "2"]
    figures = {
        "requests": float(args.requests),
        "ok_requests": float(sum(s == 200 for s in statuses)),
        "warm_requests_ok": float(sum(s == 200 for s in warm)),
        "stable_requests": counted["1"],
        "canary_requests": counted["2"],
        "canary_share_percent": share,
        "split_error_points": abs(share - 100.0 * SPLIT["2"] / 100),
        "canary_requests_watched": float(len(canary)),  # the cold count's denominator
        "canary_cold_requests": float(sum(not w for w in canary)),
        "requests_per_s": args.requests / seconds,
    }
    goals = []
    if args.sticky:
        # v1 (weight 90) first in the split: a key whose bucket is at 0.9 or above gets v2
        users = [sticky_user(i, args.sticky) or "" for i in range(args.requests)]
        expected = sum(bucket(TENANT, "bot", u) >= 0.9 for u in users)
        figures["sticky_keys"] = float(args.sticky)
        figures["sticky_expected_canary"] = float(expected)
        figures["sticky_mismatch_requests"] = abs(counted["2"] - expected)
        # the requests that came while the canary loaded ran on v1: at most 1% of them
        goals.append(goal(figures, "sticky_mismatch_requests", "<=", 0.01 * args.requests))
    cold = figures["canary_cold_requests"]
    print(f"observed split over {total:.0f} requests: v1 {100 - share:.2f}%, v2 {share:.2f}% "
          f"(set 90/10); the canary's cold requests: {cold:.0f}")  # fmt: skip
    goals += [
        goal(figures, "split_error_points", "<=", 2.0),
        goal(figures, "canary_cold_requests", "<=", 0.0),
        goal(figures, "canary_requests_watched", ">=", 1.0),
        goal(figures, "ok_requests", ">=", float(args.requests)),
    ]
    if args.sticky:
        variant = "sticky"
        return report(f"rollout_{variant}", figures, goals, smoke=args.smoke)
    return report("rollout", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
