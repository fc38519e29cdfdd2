"""Routing policies for the simulated fleet: which replica takes a request for an adapter.

- `round_robin`: replica i % N for the i-th request.
- `lora_affinity`: the llm-d / Gateway API Inference Extension endpoint picker (EPP) with its
  `lora-affinity-scorer` (llm-d-router `pkg/epp/framework/plugins/scheduling/scorer/
  loraaffinity`): 1.0 when the adapter is active (has running requests) on the replica, 0.8
  when the replica's active plus waiting adapters are fewer than its `max_lora`, 0.6 when the
  adapter only waits there, 0 otherwise. llm-d's default profile has no LoRA scorer (queue 2,
  KV cache 2, prefix cache 3; a scorer added without a weight gets 1); loraplane's chart adds
  it with weight 10 (`routing.endpointPicker.weights`), KServe with 4: `lora_affinity` is the
  chart's profile, `lora_affinity:W` another weight. Beside it the `queue-scorer` (min-max
  normalised waiting queues, 1 for the shortest) and the `kv-cache-utilization-scorer`
  (1 - KV usage); the `prefix-cache-scorer` scores every replica 0 for prompts that share no
  prefix and is left out. The `max-score-picker` takes the best total, rotating among equal
  ones. Scores read metrics scraped every 50 ms (`--refresh-metrics-interval`), so a burst
  between scrapes sees the same numbers.
- `bounded_k`: llm-d-router issue #709's idea. Each adapter ranks the replicas by rendezvous
  hashing; it is routed to the least loaded of its top k (k starts at 1), and k grows by one
  while even that one is loaded past `threshold` x max_num_seqs (running plus waiting), and
  shrinks back one at a time once load falls below half of that for `cooldown_s`. It reads
  the same scraped metrics plus the requests it sent since the last scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POLICIES = ("round_robin", "lora_affinity", "bounded_k")
CHART_LORA_WEIGHT = 10.0  # charts/loraplane/values.yaml routing.endpointPicker.weights
SCRAPE_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a replica's /metrics said at the last scrape."""

    waiting: int  # vllm:num_requests_waiting
    running: int  # vllm:num_requests_running
    kv_usage: float  # vllm:kv_cache_usage_perc
    active: frozenset[int]  # vllm:lora_requests_info running_lora_adapters
    waiting_adapters: frozenset[int]  # ... waiting_lora_adapters
    max_lora: int  # ... max_lora


class Policy(Protocol):
    """Picks a replica for each request."""

    name: str

    def pick(self, adapter: int, now: float, snaps: list[Snapshot]) -> int:
        """The replica index for a request for `adapter` at `now`."""
        ...

    def scraped(self) -> None:
        """Metrics were just scraped."""
        ...


class RoundRobin:
    """Each replica in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, adapter: int, now: float, snaps: list[Snapshot]) -> int:
        i = self._next % len(snaps)
        self._next += 1
        return i

    def scraped(self) -> None:
        return None


def lora_affinity_score(adapter: int, snap: Snapshot) -> float:
    """The lora-affinity-scorer's value for one replica."""
    if adapter in snap.active:
        return 1.0
    if len(snap.active) + len(snap.waiting_adapters) < snap.max_lora:
        return 0.8
    if adapter in snap.waiting_adapters:
        return 0.6
    return 0.0


class LoraAffinity:
    """The EPP's weighted scorers and max-score picker (see the module docstring)."""

    def __init__(self, lora_weight: float = CHART_LORA_WEIGHT, queue_weight: float = 2.0,
                 kv_weight: float = 2.0) -> None:  # fmt: skip
        self.weights = (lora_weight, queue_weight, kv_weight)
        chart = lora_weight == CHART_LORA_WEIGHT
        self.name = "lora_affinity" if chart else f"lora_affinity:{lora_weight:g}"
        self._rotate = 0

    def pick(self, adapter: int, now: float, snaps: list[Snapshot]) -> int:
        w_lora, w_queue, w_kv = self.weights
        queues = [s.waiting for s in snaps]
        low, high = min(queues), max(queues)
        scores = []
        for s in snaps:
            queue = 1.0 if high == low else (high - s.waiting) / (high - low)
            scores.append(
                w_lora * lora_affinity_score(adapter, s) + w_queue * queue
                + w_kv * (1.0 - s.kv_usage)
            )  # fmt: skip
        best = max(scores)
        ties = [i for i, v in enumerate(scores) if v == best]
        self._rotate += 1
        return ties[self._rotate % len(ties)]

    def scraped(self) -> None:
        return None


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class BoundedK:
    """Rendezvous-hashed placement on k replicas per adapter, k growing under load."""

    name = "bounded_k"

    def __init__(self, num_replicas: int, max_num_seqs: int, threshold: float = 1.0,
                 cooldown_s: float = 5.0, k_min: int = 1) -> None:  # fmt: skip
        self.n = num_replicas
        self.limit = threshold * max_num_seqs
        self.cooldown_s = cooldown_s
        self.k_min = min(k_min, num_replicas)
        self._ranked: dict[int, list[int]] = {}
        self._k: dict[int, int] = {}
        self._grew: dict[int, float] = {}  # adapter -> when its k last grew
        self._sent = [0] * num_replicas  # requests sent since the last scrape

    def ranked(self, adapter: int) -> list[int]:
        """Replicas in the adapter's rendezvous order (highest hash first)."""
        order = self._ranked.get(adapter)
        if order is None:
            key = _mix(adapter)
            order = sorted(range(self.n), key=lambda r: _mix(key ^ _mix(r + 1)), reverse=True)
            self._ranked[adapter] = order
        return order

    def pick(self, adapter: int, now: float, snaps: list[Snapshot]) -> int:
        order = self.ranked(adapter)
        load = [s.waiting + s.running + sent for s, sent in zip(snaps, self._sent, strict=True)]
        k = self._k.get(adapter, self.k_min)
        if (
            k > self.k_min
            and now - self._grew.get(adapter, 0.0) >= self.cooldown_s
            and min(load[r] for r in order[: k - 1]) < self.limit / 2
        ):
            k -= 1
            self._grew[adapter] = now
        best = min(order[:k], key=lambda r: load[r])
        while load[best] >= self.limit and k < self.n:
            k += 1
            self._grew[adapter] = now
            if load[order[k - 1]] < load[best]:
                best = order[k - 1]
        self._k[adapter] = k
        self._sent[best] += 1
        return best

    def scraped(self) -> None:
        self._sent = [0] * self.n


def make_policy(name: str, num_replicas: int, max_num_seqs: int) -> Policy:
    """A policy by name: one of POLICIES, or `lora_affinity:W` (the LoRA scorer weighted W)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "lora_affinity":
        return LoraAffinity()
    if name.startswith("lora_affinity:"):
        try:
            weight = float(name.partition(":")[2])
        except ValueError:
            weight = -1.0
        if not weight >= 0:
            raise ValueError(f"lora_affinity:W needs a weight W >= 0, got {name!r}")
        return LoraAffinity(lora_weight=weight)
    if name == "bounded_k":
        return BoundedK(num_replicas, max_num_seqs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
