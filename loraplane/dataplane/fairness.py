"""Tenant shares of one replica: weights, virtual token counters, seats, who gives way.

Each tenant has a `weight` (the catalog's quota field, default 1). Two measures of what a
tenant gets from the replica, both divided by its weight:

- served tokens (VTC, Sheng et al., OSDI 2024): every token a step computes for a tenant,
  prompt chunk or decode, adds 1/weight to its virtual counter. Admission serves the waiting
  tenant with the lowest counter first, so contended tokens are shared in proportion to the
  weights. A tenant that was idle comes back at the lowest counter of the tenants that are
  busy, never below it: idle time banks no credit (VTC's lift), and the work-conserving rule
  holds: a tenant alone takes every free seat whatever its counter.
- seats (running sequences): when a tenant with admissible waiting work finds no seat, KV
  block or adapter memory, the tenant with the most seats per weight gives one way (its
  least advanced sequence is preempted) if, after the swap, it still has at least as many
  seats per weight as the taker. That condition is the hysteresis: a swap can never be
  undone by the reverse swap, so two tenants never thrash (test_fairness.py).

With equal weights and B tenants contending, each ends within one seat of max_num_seqs / B;
and a tenant with work has at least one seat whenever there are seats for every such tenant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_WEIGHT = 1.0


@dataclass(slots=True)
class TenantShare:
    """One tenant's standing on this replica."""

    weight: float = DEFAULT_WEIGHT
    counter: float = 0.0  # served tokens / weight, lifted on return from idle
    running: int = 0
    waiting: int = 0
    served_tokens: int = 0  # cumulative, for loraplane_tenant_served_tokens_total
    preemptions: int = 0  # cumulative, for loraplane_tenant_preemptions_total

    @property
    def active(self) -> bool:
        """True while the tenant has a running or waiting sequence."""
        return self.running > 0 or self.waiting > 0

    @property
    def seats(self) -> float:
        """Running sequences per unit of weight."""
        return self.running / self.weight


def check_weight(weight: object) -> float:
    """A tenant weight as a float; ValueError unless it is a finite number > 0."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"tenant weight must be a number, got {weight!r}")
    w = float(weight)
    if not 0 < w < float("inf"):
        raise ValueError(f"tenant weight must be > 0 and finite, got {weight!r}")
    return w


class Shares:
    """The tenants of one scheduler and their shares."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantShare] = {}

    def get(self, tenant: str) -> TenantShare:
        """The tenant's standing (created at weight 1 on first use)."""
        share = self.tenants.get(tenant)
        if share is None:
            share = self.tenants[tenant] = TenantShare()
        return share

    def set_weight(self, tenant: str, weight: float) -> None:
        """Give `tenant` a new weight (ValueError unless > 0); its counter keeps its tokens."""
        w = check_weight(weight)
        share = self.get(tenant)
        if w != share.weight:
            share.counter *= share.weight / w  # the same served tokens, at the new weight
            share.weight = w

    def _floor(self, exclude: str) -> float | None:
        counters = [s.counter for t, s in self.tenants.items() if s.active and t != exclude]
        return min(counters) if counters else None

    def arrive(self, tenant: str) -> None:
        """A sequence of `tenant` starts waiting (new, not a preempted one)."""
        share = self.get(tenant)
        if not share.active:
            floor = self._floor(tenant)
            if floor is not None and share.counter < floor:
                share.counter = floor
        share.waiting += 1

    def admit(self, tenant: str) -> None:
        """A waiting sequence of `tenant` got a seat."""
        share = self.get(tenant)
        share.waiting -= 1
        share.running += 1

    def preempt(self, tenant: str) -> None:
        """A running sequence of `tenant` went back to waiting."""
        share = self.get(tenant)
        share.running -= 1
        share.waiting += 1
        share.preemptions += 1

    def leave(self, tenant: str, running: bool) -> None:
        """A sequence of `tenant` finished or was aborted."""
        share = self.get(tenant)
        if running:
            share.running -= 1
        else:
            share.waiting -= 1

    def serve(self, tenant: str, tokens: int) -> None:
        """A step computes `tokens` tokens for `tenant`."""
        share = self.get(tenant)
        share.served_tokens += tokens
        share.counter += tokens / share.weight

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (lower: served first)."""
        return self.get(tenant).counter

    def gives_way(self, victim: str, taker: str, taken: int = 0) -> bool:
        """Should `victim` give a seat to `taker` (who has `taken` seats more than it has
        running, given to it earlier in this step)? Only if the victim keeps at least as many
        seats per weight as the taker then has: the hysteresis. And a taker with no seat at all
        gets one from a victim with two or more, whatever the weights: a tenant with work is
        never shut out by a heavier one (the reverse swap then never holds either)."""
        if victim == taker:
            return False
        v, t = self.get(victim), self.get(taker)
        seats = t.running + taken
        if seats == 0 and v.running >= 2:
            return True
        return v.running >= 1 and (v.running - 1) / v.weight >= (seats + 1) / t.weight

    def most_seated(self, tenants: Iterable[str], exclude: str | None = None) -> str | None:
        """Of `tenants`, the one with the most seats per weight (ties: the higher counter)."""
        best: tuple[float, float] | None = None
        found = None
        for tenant in tenants:
            if tenant == exclude:
                continue
            share = self.get(tenant)
            rank = (share.seats, share.counter)
            if best is None or rank > best:
                best, found = rank, tenant
        return found

    def giver(self, tenants: Iterable[str], taker: str, taken: int = 0) -> str | None:
        """Of `tenants` (those with running sequences), the one that gives a seat to `taker`:
        the most seated per weight (ties: the higher counter) among those that give way."""
        ranked = sorted(
            (t for t in tenants if t != taker),
            key=lambda t: (self.get(t).seats, self.get(t).counter),
            reverse=True,
        )
        return next((t for t in ranked if self.gives_way(t, taker, taken)), None)
