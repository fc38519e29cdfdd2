"""Slot pressure as the system reports it: the data plane's /metrics and the control plane's view.

`/metrics` is parsed with prometheus_client's own text parser. A `PeakWatch` scrapes it on a
thread while a batch runs, because running and waiting adapters are gauges: after the batch
they are back to zero, and the peaks are what shows the adapter slots being contended for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loraplane.demo.stack import POOL

Say = Callable[[str], None]
BASE = "(base model)"


def scrape(dp_url: str) -> dict[str, list[Sample]]:
    """The data plane's samples, by sample name (`..._total` for counters)."""
    text = httpx.get(dp_url + "/metrics", timeout=5).text
    samples: dict[str, list[Sample]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def adapter_names(samples: dict[str, list[Sample]], label: str) -> list[str]:
    """The adapters named in `vllm:lora_requests_info`'s `label` (comma-joined)."""
    for s in samples.get("vllm:lora_requests_info", []):
        return [n for n in s.labels.get(label, "").split(",") if n]
    return []


@dataclass(slots=True)
class Peaks:
    """The highest readings seen while watching."""

    running_adapters: set[str] = field(default_factory=set)
    most_running: int = 0
    most_waiting_adapters: int = 0
    most_deferred: int = 0
    most_waiting: int = 0
    kv_usage: float = 0.0
    scrapes: int = 0

    def add(self, samples: dict[str, list[Sample]]) -> None:
        """Fold one scrape in."""
        running = adapter_names(samples, "running_lora_adapters")
        self.running_adapters.update(running)
        self.most_running = max(self.most_running, len(running))
        waiting = adapter_names(samples, "waiting_lora_adapters")
        self.most_waiting_adapters = max(self.most_waiting_adapters, len(waiting))
        deferred = value(samples, "vllm:num_requests_waiting_by_reason", reason="deferred")
        self.most_deferred = max(self.most_deferred, int(deferred))
        self.most_waiting = max(self.most_waiting, int(value(samples, "vllm:num_requests_waiting")))
        self.kv_usage = max(self.kv_usage, value(samples, "vllm:kv_cache_usage_perc"))
        self.scrapes += 1


class PeakWatch:
    """Scrape /metrics every `interval` seconds on a thread, inside a `with` block."""

    def __init__(self, dp_url: str, interval: float = 0.02) -> None:
        self.dp_url, self.interval = dp_url, interval
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-watch", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                self.peaks.add(scrape(self.dp_url))
            self._stop.wait(self.interval)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self.peaks

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(10)


def show_metrics(dp_url: str, peaks: Peaks, max_loras: int, say: Say) -> dict[str, int]:
    """Print the data plane's slot pressure, residency and tokens per tenant; return the
    completion tokens per tenant."""
    s = scrape(dp_url)
    say(f"    during the batch ({peaks.scrapes} scrapes of /metrics):")
    say(f"      running adapters at once: at most {peaks.most_running} of {max_loras} slots "
        f"(seen running: {', '.join(sorted(peaks.running_adapters)) or 'none'})")  # fmt: skip
    say(f"      waiting adapters: at most {peaks.most_waiting_adapters}; waiting requests: at "
        f"most {peaks.most_waiting}, of which deferred (adapter slots full): "
        f"{peaks.most_deferred}")  # fmt: skip
    say(f"      KV cache usage: at most {peaks.kv_usage:.1%}")
    deferred = int(value(s, "loraplane_requests_deferred_total"))
    loads = int(value(s, "loraplane_adapter_loads_total", tier="gpu", result="ok"))
    evictions = int(value(s, "loraplane_adapter_evictions_total", tier="gpu"))
    say(f"    now: requests deferred in total {deferred}; adapter loads into slots {loads}, "
        f"evictions {evictions}; KV usage {value(s, 'vllm:kv_cache_usage_perc'):.1%}")  # fmt: skip
    tiers: dict[str, list[str]] = defaultdict(list)
    for sample in s.get("loraplane_adapter_resident", []):
        if sample.value > 0:
            tiers[sample.labels["tier"]].append(
                f"{sample.labels['tenant']}/{sample.labels['adapter']}"
            )
    for tier in sorted(tiers):
        where = {"gpu": "device slots", "cpu": "host copies"}.get(tier, tier)
        say(f"    resident ({tier}: {where}): {', '.join(sorted(tiers[tier]))}")
    tokens: dict[str, dict[str, int]] = defaultdict(dict)
    for sample in s.get("loraplane_tokens_total", []):
        tokens[sample.labels["tenant"]][sample.labels["kind"]] = int(sample.value)
    for tenant in sorted(tokens):
        t = tokens[tenant]
        say(f"    tokens {tenant:<8} prompt {t.get('prompt', 0):>5}  "
            f"completion {t.get('completion', 0):>5}")  # fmt: skip
    return {tenant: t.get("completion", 0) for tenant, t in tokens.items()}


def _completion(rows: list[dict[str, Any]]) -> int:
    return sum(int(row["completion_tokens"]) for row in rows)


def show_controlplane(
    cp_url: str, admin_token: str, keys: dict[str, str], expected: dict[str, int], say: Say,
    timeout: float = 15.0,
) -> bool:  # fmt: skip
    """Print the pool's last pressure report and each tenant's usage as the control plane has
    them, once the data plane's reports have brought every tenant's `expected` completion
    tokens (or `timeout` passed); whether they all arrived."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    deadline = time.monotonic() + timeout
    while True:
        pool = httpx.get(f"{cp_url}/v1/pools/{POOL}", headers=admin, timeout=5).json()
        usage: dict[str, list[dict[str, Any]]] = {
            t: httpx.get(
                f"{cp_url}/v1/usage", headers={"Authorization": f"Bearer {k}"}, timeout=5
            ).json()
            for t, k in keys.items()
        }
        arrived = all(_completion(usage[t]) >= expected.get(t, 0) for t in keys)
        if (arrived and pool.get("pressure")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    replicas = (pool.get("pressure") or {}).get("replicas", {})
    for name, r in replicas.items():
        say(f"    control plane, pool {POOL}, replica {name} reported at {r.get('time')}:")
        say(f"      deferred {r['deferred']}, running adapters {r['running_adapters']}, waiting "
            f"adapters {r['waiting_adapters']}, slots used {r['slots_used']}, adapter bytes "
            f"{r['gpu_bytes'] / 1024:.0f} KiB, KV usage {r['kv_usage']:.1%}")  # fmt: skip
    for tenant, rows in usage.items():
        parts = [
            f"{row['adapter'] or BASE}: {row['requests']} requests, "
            f"{row['completion_tokens']} completion tokens"
            for row in rows
        ]
        say(f"    usage {tenant:<8} {'; '.join(parts) or 'none yet'}")
    return arrived
