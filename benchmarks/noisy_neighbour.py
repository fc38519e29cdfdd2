"""Noisy neighbours: one tenant's flood against another tenant's latency, share and cache.

The whole system over HTTP, as a cluster runs it: the control plane (`loraplane controlplane`,
SQLite, local store) and a data plane in catalog mode (`python -m loraplane.dataplane.server
serve --controlplane-url ...`), each its own process, with the server's default settings
(max_num_seqs 256, queue caps, scheduling, intake pools) except the KV cache's size: on CPU
the default is a quarter of RAM (4 GiB here, a million tokens of this model), which no flood a
2-core machine can run would exhaust, so `--kv-blocks` (default 4352 blocks of 16 tokens)
stands in for a GPU's KV cache. Tenants upload their adapters through the REST API; the client
(this process) speaks raw HTTP/1.1, streaming.

Phases, each on a fresh pair of servers (weights, caches and counters start clean; with --smoke,
whose figures mean nothing, one pair for all, each phase with tenants of its own):
- flood: tenant A opens max_num_seqs + 64 streams of 512 tokens over 32 of its adapters, with
  prompts (256 tokens) long enough to exhaust the KV cache as they grow, plus 32 requests with
  distinct complex JSON schemas and requests over its rate limit (requests_per_minute 400, so
  the last ones are refused). Once A's streams run, tenant B sends one short request at a time
  (16 prompt tokens, 16 generated, its own adapter) for `--window` seconds. Goals: B's p99 time
  to first token <= 4x A's median inter-token latency in the same window, B's median
  inter-token latency <= 1.5x A's, none of B's requests preempted
  (loraplane_tenant_preemptions_total on the metrics port).
- alone: A's flood with nobody else; A's tokens/s over the window, client-side. With
  `--baseline DIR` (a source tree of the code before, e.g. `git worktree add /tmp/base
  2b42fb1`) the same phase runs on that tree's servers too, alternating, `--rounds` times each;
  goal: tokens/s >= 0.97x the baseline's (medians).
- weighted: tenants C (weight 3) and D (weight 1) each flood 256 streams; served tokens per
  tenant from the metrics port over the window after a settling time. Goal: C/D = 3 within 10%.
- side channel: A sends a 1,500-token base-model prompt; then B sends the same prompt, B a fresh
  one, A its own again, A a fresh one (5 prompts; medians). Goals: B's time to first token on
  A's prompt >= 0.8x on a fresh one (no cross-tenant cache hit), A's repeat <= 0.3x its fresh
  one (the cache still works within a tenant).
- intake: B's plain requests' time to first token alone, then while A sends bursts of 200
  requests at once with distinct complex JSON schemas, and, alternating with those, the same
  bursts without schemas (3 rounds each). Goal: B's time with the schema bursts <= 2x its
  time with the plain ones: what A's schemas add (tokenizing, compiling, intake pools) does not
  reach B. Against no A at all the ratio is far higher on this CPU, and is printed
  (`intake_schemas_over_quiet`): 200 admitted requests make every step cost about 200 rows here,
  where a GPU's decode step costs about the same for 1 row as for 200.

Run: .venv/bin/python benchmarks/noisy_neighbour.py [--window 30] [--baseline DIR]
[--rounds 2] [--phases flood,alone,weighted,side,intake] (about 6 minutes; --smoke: a tiny
model, small floods, seconds per phase)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx
from _common import add_smoke_flag, goal, report
from server_http import REPO, free_port, pct
from tiers import qv_adapter

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.demo.build import build_llama

SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
SMOKE_SHAPE = {**SHAPE, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
BASE = "base"
POOL = "bench"
ADMIN, SERVICE = secrets.token_urlsafe(16), secrets.token_urlsafe(16)


@dataclass(frozen=True)
class Sizes:
    """A run's sizes (full or --smoke)."""

    flood: int = 320  # max_num_seqs + 64
    flood_tokens: int = 512
    flood_prompt: int = 256
    adapters: int = 32
    schemas: int = 32
    over_limit: int = 48
    rate_limit: int = 400
    b_prompt: int = 16
    b_tokens: int = 16
    weighted: int = 256
    side_prompt: int = 1500
    side_prompts: int = 5
    intake_schemas: int = 200
    intake_b: int = 12
    intake_rounds: int = 3
    settle_s: float = 10.0


SMOKE = Sizes(
    flood=24,
    flood_tokens=2000,
    flood_prompt=32,
    adapters=4,
    schemas=2,
    over_limit=2,
    rate_limit=28,
    b_tokens=4,
    weighted=12,
    side_prompt=200,
    side_prompts=1,
    intake_schemas=4,
    intake_b=2,
    settle_s=1.0,
)


# -- the client -------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streaming request's chunk times (and how it ended)."""

    start: float
    stamps: list[float] = field(default_factory=list)
    status: int = 0
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.start

    def gaps(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [
            b - a
            for a, b in zip(self.stamps, self.stamps[1:], strict=False)
            if since <= a and b <= until
        ]


async def stream(port: int, key: str, body: dict[str, object], out: Stream | None = None) -> Stream:
    """POST /v1/completions (streaming) with `key`; each SSE chunk's arrival time in `out`.
    A minimal HTTP/1.1 client: on 2 cores the client must cost less than the server."""
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    out = out or Stream(time.perf_counter())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode() + payload)
        first = True
        while data := await reader.read(1 << 16):
            now = time.perf_counter()
            if first:
                out.status = int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else 0
                first = False
            n = data.count(b'"choices": [{') + data.count(b'"choices":[{')
            out.stamps.extend([now] * n)
            out.tokens += n
    finally:
        writer.close()
    return out


def completion(model: str, prompt: list[int], tokens: int, **extra: object) -> dict[str, object]:
    """A completion body; `logprobs: 0` makes every token a chunk of its own (a random model's
    token may decode to no text, and a chunk with no text and no logprobs is not sent)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        **extra,
    }


def schema(i: int) -> dict[str, object]:
    """A distinct, fairly complex JSON schema (nested objects, enums, arrays, bounds)."""
    return {
        "type": "object",
        "properties": {
            f"id_{i}": {"type": "integer", "minimum": 0, "maximum": 10_000 + i},
            f"name_{i}": {"type": "string", "maxLength": 8 + i % 13},
            "kind": {"enum": [f"k{i}", f"q{i}", "other"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "number"}, f"y{i}": {"type": "boolean"}},
                "required": ["x"],
            },
        },
        "required": [f"id_{i}", "kind"],
    }


def json_schema(name: str, i: int) -> dict[str, object]:
    """OpenAI's response_format for `schema(i)`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema(i)}}


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 32000) for _ in range(n)]


# -- the system -------------------------------------------------------------------------------


@dataclass
class System:
    """A control plane and a data plane, running; the tenants' keys."""

    cp: str
    port: int
    metrics_port: int
    procs: list[subprocess.Popen[bytes]]
    keys: dict[str, str] = field(default_factory=dict)
    # a phase's tenants are created as PREFIX + name (--smoke: every phase on one pair of
    # servers, each with tenants of its own); the phases name them without it
    prefix: str = ""

    def admin(self, method: str, path: str, **kw: object) -> httpx.Response:
        r = httpx.request(
            method, self.cp + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kw
        )  # type: ignore[arg-type]
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r

    def tenant(self, name: str, adapters: list[Path], **quota: object) -> list[str]:
        """Create a tenant with `quota`, a key, and its adapters uploaded; their names."""
        unlimited = {"requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000}
        full = self.prefix + name
        self.admin("POST", "/v1/tenants", json={"name": full, **unlimited, **quota})
        self.keys[name] = self.admin("POST", f"/v1/tenants/{full}/keys", json={"name": "k"}).json()[
            "key"
        ]
        names = []
        for i, src in enumerate(adapters):
            files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
            r = httpx.post(
                self.cp + "/v1/adapters",
                data={"name": f"{full}-{i}", "base_model": BASE},
                files=files,
                headers={"Authorization": f"Bearer {self.keys[name]}"},
                timeout=120,
            )
            if r.status_code not in (200, 201):
                raise RuntimeError(f"upload for {name}: {r.status_code} {r.text[:300]}")
            names.append(f"{full}-{i}")
        return names

    def tenant_series(self, family: str) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(family + "{"):
                tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                if tenant.startswith(self.prefix):
                    values[tenant.removeprefix(self.prefix)] = float(line.rsplit(" ", 1)[1])
        return values


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def system(src: Path, model: Path, work: Path, kv_blocks: int) -> Iterator[System]:
    """Both services from the source tree `src`, state under `work`; stopped on exit."""
    work.mkdir(parents=True)
    cp_port, port, metrics_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(src),
        "LORAPLANE_ADMIN_TOKEN": ADMIN,
        "LORAPLANE_SERVICE_TOKEN": SERVICE,
        "LORAPLANE_STORE": str(work / "store"),
        "LORAPLANE_DATA_DIR": str(work),
        "LORAPLANE_DATABASE_URL": f"sqlite:///{work}/c.db",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(work / "cp.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "loraplane",
                        "controlplane",
                        "--port",
                        str(cp_port),
                        "--log-level",
                        "warning",
                    ],
                    env={**env, "OMP_NUM_THREADS": "1"},
                    cwd=work,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        cp = f"http://127.0.0.1:{cp_port}"
        wait_http(cp + "/readyz", procs[0])
        sys_ = System(cp, port, metrics_port, procs)
        sys_.admin(
            "POST",
            "/v1/pools",
            json={
                "name": POOL,
                "max_lora_rank": 64,
                "base_model": {"name": BASE, "uri": str(model)},
            },
        )
        dp_env = {
            **env,
            "OMP_NUM_THREADS": "1",
            "LORAPLANE_POOL": POOL,
            "LORAPLANE_METRICS_PORT": str(metrics_port),
            "LORAPLANE_NUM_KV_BLOCKS": str(kv_blocks),
        }
        with open(work / "dp.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "loraplane.dataplane.server",
                        "serve",
                        "--model",
                        str(model),
                        "--served-model-name",
                        BASE,
                        "--port",
                        str(port),
                        "--controlplane-url",
                        cp,
                    ],
                    env=dp_env,
                    cwd=work,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_http(f"http://127.0.0.1:{port}/ready", procs[1])
        yield sys_
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


# -- the phases -------------------------------------------------------------------------------


async def warm(s: System, tenant: str, names: list[str]) -> None:
    """One request per adapter (resolve, load), so a phase measures serving, not cold loads."""
    rng = random.Random(1)
    await asyncio.gather(
        *(stream(s.port, s.keys[tenant], completion(n, prompt(rng, 4), 1)) for n in names)
    )


async def open_flood(
    s: System, tenant: str, names: list[str], z: Sizes, n: int, prompt_len: int, seed: int
) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    rng = random.Random(seed)
    streams = [Stream(time.perf_counter()) for _ in range(n)]
    tasks = [
        asyncio.create_task(
            stream(
                s.port,
                s.keys[tenant],
                completion(names[i % len(names)], prompt(rng, prompt_len), z.flood_tokens),
                streams[i],
            )
        )
        for i in range(n)
    ]
    return streams, tasks


async def cancel(tasks: list[asyncio.Task[Stream]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def flood_phase(
    s: System, a: list[str], b: list[str], z: Sizes, window: float
) -> dict[str, float]:
    await warm(s, "a", a)
    await warm(s, "b", b)
    streams, tasks = await open_flood(s, "a", a, z, z.flood, z.flood_prompt, seed=2)
    rng = random.Random(3)
    extras = [
        asyncio.create_task(
            stream(
                s.port,
                s.keys["a"],
                completion(
                    a[i % len(a)], prompt(rng, 32), 16, response_format=json_schema(f"s{i}", i)
                ),
            )
        )
        for i in range(z.schemas)
    ]
    extras += [
        asyncio.create_task(stream(s.port, s.keys["a"], completion(a[0], prompt(rng, 8), 4)))
        for _ in range(z.over_limit)
    ]
    await asyncio.sleep(z.settle_s)  # A's streams running, prefilled, the cache filling
    start = time.perf_counter()
    mine: list[Stream] = []
    while time.perf_counter() - start < window:
        mine.append(
            await stream(s.port, s.keys["b"], completion(b[0], prompt(rng, z.b_prompt), z.b_tokens))
        )
    end = time.perf_counter()
    preempted = s.tenant_series("loraplane_tenant_preemptions_total")
    await cancel(tasks + extras)
    refused = sum(1 for t in extras if t.done() and not t.cancelled() and t.result().status == 429)
    # A's streams past its queue cap (256 per tenant) are refused at the door (429) too
    streams_refused = sum(1 for st in streams if st.status == 429)
    ok = [m for m in mine if m.status == 200 and m.stamps]
    a_gaps = [g for st in streams for g in st.gaps(start, end)]
    if not a_gaps or not ok:
        statuses = sorted({st.status for st in streams} | {m.status for m in mine})
        raise RuntimeError(
            f"nothing measured in the window (HTTP statuses seen: {statuses});"
            " the flood ended before it or every request failed"
        )
    b_gaps = [g for m in ok for g in m.gaps()]
    a_itl = median(a_gaps)
    b_ttft = pct([m.ttft for m in ok], 99) if len(ok) > 1 else ok[0].ttft
    return {
        "flood_b_requests": float(len(ok)),
        "flood_b_failed": float(len(mine) - len(ok)),
        "flood_a_itl_median_s": a_itl,
        "flood_b_ttft_p99_s": b_ttft,
        "flood_b_itl_median_s": median(b_gaps),
        "flood_b_ttft_p99_over_a_itl": b_ttft / a_itl,
        "flood_b_itl_over_a_itl": median(b_gaps) / a_itl,
        "flood_b_preemptions": preempted.get("b", 0.0),
        "flood_a_preemptions": preempted.get("a", 0.0),
        "flood_a_extras_refused": float(refused),
        "flood_a_streams_refused": float(streams_refused),
    }


async def alone_phase(s: System, a: list[str], z: Sizes, window: float) -> float:
    """A's flood alone: tokens/s received over the window (client-side)."""
    await warm(s, "a", a)
    streams, tasks = await open_flood(s, "a", a, z, z.flood, z.flood_prompt, seed=2)
    await asyncio.sleep(z.settle_s)
    start = time.perf_counter()
    await asyncio.sleep(window)
    end = time.perf_counter()
    await cancel(tasks)
    tokens = sum(1 for st in streams for t in st.stamps if start <= t <= end)
    return tokens / (end - start)


async def weighted_phase(
    s: System, c: list[str], d: list[str], z: Sizes, window: float
) -> dict[str, float]:
    await warm(s, "c", c)
    await warm(s, "d", d)
    _, tc = await open_flood(s, "c", c, z, z.weighted, 16, seed=4)
    _, td = await open_flood(s, "d", d, z, z.weighted, 16, seed=5)
    await asyncio.sleep(z.settle_s)
    before = s.tenant_series("loraplane_tenant_served_tokens_total")
    await asyncio.sleep(window)
    after = s.tenant_series("loraplane_tenant_served_tokens_total")
    await cancel(tc + td)
    served = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in "cd"}
    return {
        "weighted_c_tokens": served["c"],
        "weighted_d_tokens": served["d"],
        "weighted_ratio_over_3": served["c"] / max(served["d"], 1.0) / 3.0,
    }


async def side_phase(s: System, z: Sizes) -> dict[str, float]:
    rng = random.Random(6)
    ttft: dict[str, list[float]] = {"b_same": [], "b_fresh": [], "a_repeat": [], "a_fresh": []}

    async def one(tenant: str, p: list[int]) -> float:
        out = await stream(s.port, s.keys[tenant], completion(BASE, p, 1))
        if out.status != 200 or not out.stamps:
            raise RuntimeError(f"side channel request of {tenant} failed: {out.status}")
        return out.ttft

    await one("a", prompt(rng, z.side_prompt))  # warm the path
    await one("b", prompt(rng, z.side_prompt))
    for _ in range(z.side_prompts):
        sent = prompt(rng, z.side_prompt)
        await one("a", sent)
        ttft["b_same"].append(await one("b", sent))
        ttft["b_fresh"].append(await one("b", prompt(rng, z.side_prompt)))
        ttft["a_repeat"].append(await one("a", sent))
        ttft["a_fresh"].append(await one("a", prompt(rng, z.side_prompt)))
    m = {k: median(v) for k, v in ttft.items()}
    return {
        "side_b_same_over_fresh": m["b_same"] / m["b_fresh"],
        "side_a_repeat_over_fresh": m["a_repeat"] / m["a_fresh"],
        "side_b_fresh_ttft_s": m["b_fresh"],
    }


async def intake_phase(s: System, a: list[str], b: list[str], z: Sizes) -> dict[str, float]:
    await warm(s, "a", a)
    await warm(s, "b", b)
    rng = random.Random(7)

    async def b_ttfts(until: asyncio.Future[object] | None = None) -> list[float]:
        """B's requests one at a time: `intake_b` of them, or while `until` is pending."""
        got: list[float] = []
        while (len(got) < z.intake_b) if until is None else not until.done():
            out = await stream(s.port, s.keys["b"], completion(b[0], prompt(rng, z.b_prompt), 4))
            got.append(out.ttft)
        return got

    async def burst(offset: int | None) -> tuple[list[float], float, list[int]]:
        """A's `intake_schemas` requests at once (with distinct schemas from `offset` on, or
        none); B's time to first token, one request at a time, for as long as they last."""
        start = time.perf_counter()
        extra = [
            {} if offset is None else {"response_format": json_schema(f"i{i}", offset + i)}
            for i in range(z.intake_schemas)
        ]
        flood = [
            asyncio.create_task(
                stream(s.port, s.keys["a"], completion(a[i % len(a)], prompt(rng, 16), 8, **x))
            )
            for i, x in enumerate(extra)
        ]
        everything = asyncio.gather(*flood)
        busy = await b_ttfts(until=everything)
        statuses = [st.status for st in await everything]
        return busy, time.perf_counter() - start, statuses

    quiet = median(await b_ttfts())
    plain: list[float] = []
    schemas: list[float] = []
    seconds: list[float] = []
    statuses: list[int] = []
    for r in range(z.intake_rounds):  # alternating, so a slow spell falls on both
        plain += (await burst(None))[0]
        busy, took, codes = await burst(1000 + r * z.intake_schemas)
        schemas += busy
        seconds.append(took)
        statuses += codes
    return {
        "intake_b_ttft_quiet_s": quiet,
        "intake_b_ttft_a_plain_s": median(plain),
        "intake_b_ttft_a_schemas_s": median(schemas),
        "intake_schemas_over_plain": median(schemas) / median(plain),
        "intake_schemas_over_quiet": median(schemas) / quiet,
        "intake_b_requests": float(len(schemas)),
        # A's schema bursts: how long one took, and how its requests ended
        "intake_a_burst_seconds": median(seconds),
        "intake_a_ok": float(sum(1 for code in statuses if code == 200)),
        "intake_a_failed": float(sum(1 for code in statuses if code != 200)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured per phase")
    parser.add_argument("--kv-blocks", type=int, default=4352, help="KV cache blocks (16 tokens)")
    parser.add_argument("--baseline", type=Path, help="source tree of the code before (alone A/B)")
    parser.add_argument("--rounds", type=int, default=2, help="alone-phase rounds per tree")
    parser.add_argument("--phases", default="flood,alone,weighted,side,intake")
    add_smoke_flag(parser)
    args = parser.parse_args()
    z = SMOKE if args.smoke else Sizes()
    window = 2.0 if args.smoke else args.window
    kv_blocks = 256 if args.smoke else args.kv_blocks
    phases = set(args.phases.split(","))
    figures: dict[str, float] = {"window_s": window, "kv_blocks": float(kv_blocks)}
    goals = []
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp, contextlib.ExitStack() as shared:
        root = Path(tmp)
        print("building the benchmark model and adapters ...", flush=True)
        model = build_llama(root / "model", **(SMOKE_SHAPE if args.smoke else SHAPE))
        spec = BaseModelSpec.from_dir(model)
        made = [
            qv_adapter(spec, root / "adapters" / str(i), seed=20_000 + i)
            for i in range(z.adapters + 3)
        ]
        a_src, b_src, c_src, d_src = made[: z.adapters], made[-3:-2], made[-2:-1], made[-1:]
        runs = 0
        one: list[System] = []  # --smoke: the pair every phase runs on

        def fresh(src: Path = REPO) -> contextlib.AbstractContextManager[System]:
            """A fresh pair of servers for a phase; with --smoke (whose figures mean nothing)
            one pair for every phase, each phase with tenants of its own (seconds, not a
            minute, of servers starting)."""
            nonlocal runs
            runs += 1
            if not args.smoke:
                return system(src, model, root / f"run{runs}", kv_blocks)
            if not one:
                one.append(shared.enter_context(system(src, model, root / "run1", kv_blocks)))
            return contextlib.nullcontext(dataclasses.replace(one[0], keys={}, prefix=f"p{runs}-"))

        if "flood" in phases:
            print("flood: A's burst against B's short requests ...", flush=True)
            with fresh() as s:
                a = s.tenant("a", a_src, requests_per_minute=z.rate_limit)
                b = s.tenant("b", b_src)
                figures.update(asyncio.run(flood_phase(s, a, b, z, window)))
            goals += [
                goal(figures, "flood_b_ttft_p99_over_a_itl", "<=", 4.0),
                goal(figures, "flood_b_itl_over_a_itl", "<=", 1.5),
                goal(figures, "flood_b_preemptions", "<=", 0.0),
            ]
        if "alone" in phases:
            trees = [("head", REPO)] + ([("baseline", args.baseline)] if args.baseline else [])
            got: dict[str, list[float]] = {name: [] for name, _ in trees}
            for r in range(1 if args.smoke else args.rounds):
                for name, src in trees:
                    print(f"alone: round {r + 1}, {name} ...", flush=True)
                    with fresh(src) as s:
                        a = s.tenant("a", a_src)
                        got[name].append(asyncio.run(alone_phase(s, a, z, window)))
            figures["alone_tokens_per_s"] = median(got["head"])
            if args.baseline:
                figures["alone_baseline_tokens_per_s"] = median(got["baseline"])
                figures["alone_over_baseline"] = median(got["head"]) / median(got["baseline"])
                goals.append(goal(figures, "alone_over_baseline", ">=", 0.97))
        if "weighted" in phases:
            print("weighted: C (3) and D (1) flooding ...", flush=True)
            with fresh() as s:
                c = s.tenant("c", c_src, weight=3)
                d = s.tenant("d", d_src, weight=1)
                figures.update(asyncio.run(weighted_phase(s, c, d, z, window)))
            goals += [
                goal(figures, "weighted_ratio_over_3", ">=", 0.9),
                goal(figures, "weighted_ratio_over_3", "<=", 1.1),
            ]
        if "side" in phases:
            print("side channel: base-model prompts across tenants ...", flush=True)
            with fresh() as s:
                s.tenant("a", [])
                s.tenant("b", [])
                figures.update(asyncio.run(side_phase(s, z)))
            goals += [
                goal(figures, "side_b_same_over_fresh", ">=", 0.8),
                goal(figures, "side_a_repeat_over_fresh", "<=", 0.3),
            ]
        if "intake" in phases:
            print("intake: B's requests while A sends distinct schemas ...", flush=True)
            with fresh() as s:
                a = s.tenant("a", a_src[:4])
                b = s.tenant("b", b_src)
                figures.update(asyncio.run(intake_phase(s, a, b, z)))
            goals.append(goal(figures, "intake_schemas_over_plain", "<=", 2.0))
    return report("noisy_neighbour", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
