"""Fault isolation: a failure stays with the requests that cause it (issue 32).

A step whose forward pass or sampler raises is run again one adapter at a time (the base
model's rows are a group too): a group that fails alone fails its own requests, the others
are computed in the same step, and a failed adapter's device slot is reloaded from its host
copy next time. When the base model's rows fail, or every adapter fails alone, the fault is
the engine's or the device's (a poisoned CUDA context), not one tenant's: the step is
`broken`. Before a step, waiting requests whose adapter cannot be loaded (its load failed, or
it is still not in host memory `adapter_load_timeout_s` after they arrived) end with an
error; the others go on. One whose adapter can never run here (heavier than the whole host
byte limit) ends with its reason code as `error_code` (`TooLarge`): the server answers a
client error, not a retry.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.adapters.errors import ReasonCode
from loraplane.dataplane.emission import Emitter
from loraplane.dataplane.outputs import ADAPTER_LOAD_TIMEOUT, RequestOutput
from loraplane.dataplane.prompt_logprobs import PromptScores
from loraplane.dataplane.sampler import SamplerOutput
from loraplane.dataplane.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

if TYPE_CHECKING:  # annotations only
    from loraplane.dataplane.lora.manager import LoRAManager

log = logging.getLogger(__name__)

# a step's sampled tokens, and the prompt scores of requests that want prompt log-probabilities
Computed = tuple[SamplerOutput, dict[str, PromptScores]]


@dataclass(slots=True)
class Isolated:
    """A failed step, run again one adapter at a time."""

    parts: list[tuple[SchedulerOutput, Computed]] = field(default_factory=list)  # computed
    failed: list[RequestOutput] = field(default_factory=list)  # the failed groups' requests
    broken: bool = False  # the base model's rows, or every adapter alone, failed


class FaultIsolation:
    """The engine's failure paths over its scheduler, adapters and outputs (module docstring)."""

    def __init__(self, scheduler: Scheduler, loras: LoRAManager, emitter: Emitter) -> None:
        self.scheduler = scheduler
        self.loras = loras
        self.emitter = emitter

    def compute_isolated(
        self, out: SchedulerOutput, error: Exception, compute: Callable[[SchedulerOutput], Computed]
    ) -> Isolated:
        """The step `out` failed with `error`: `compute` its rows again one adapter at a time.
        A group that fails alone fails its requests with the error; the others are computed
        in this step. Nothing was recorded by the failed attempt: its K/V writes are
        rewritten with the same values."""
        groups: dict[str | None, list[ScheduledSeq]] = {}
        for row in out.scheduled:
            groups.setdefault(row.seq.lora_key, []).append(row)
        if len(groups) == 1:
            (key,) = groups
            log.warning("a step of adapter %s failed: %r", key or "(base model)", error)
            failed = self.emitter.fail_rows(out.scheduled, error)
            self._reset_adapter(key)
            # the base model alone failed: no adapter to blame
            return Isolated(failed=failed, broken=key is None)
        isolated = Isolated()
        for key, rows in groups.items():
            keys = frozenset() if key is None else frozenset({key})
            part = dataclasses.replace(out, scheduled=rows, lora_keys=keys)
            try:
                isolated.parts.append((part, compute(part)))
            except Exception as group_error:
                log.warning("a step of adapter %s failed: %r", key or "(base model)", group_error)
                isolated.failed += self.emitter.fail_rows(rows, group_error)
                self._reset_adapter(key)
                isolated.broken |= key is None
        isolated.broken |= not isolated.parts  # every adapter failed alone: not one tenant
        return isolated

    def _reset_adapter(self, key: str | None) -> None:
        """After a failed step: reload the adapter's device slot from its host copy next time,
        unless a running request still uses it."""
        if key is not None and key not in self.scheduler.running_lora_keys:
            self.loras.drop_slot(key)

    def fail_unloadable(self, timeout: float) -> list[RequestOutput]:
        """End waiting requests whose adapter can never run here (`TooLarge`), those whose
        adapter's last load failed, and those whose adapter is still not in host memory
        `timeout` seconds after they arrived (a store that never answers must not hold them
        forever); other requests go on."""
        outputs = []
        horizon = time.monotonic() - timeout
        for seq in list(self.scheduler.waiting):
            if seq.lora is None:
                continue
            refused = self.loras.refusal(seq.lora)
            error = self.loras.failure(seq.lora) if refused is None else None
            if refused is not None:
                outputs.append(self.emitter.fail(seq, refused, ReasonCode.TOO_LARGE.value))
            elif error is not None:
                outputs.append(self.emitter.fail(seq, error))
            elif seq.arrival_time < horizon and not self.loras.in_host_memory(seq.lora):
                late = f"adapter {seq.lora.name} was not loaded within {timeout:g} s"
                outputs.append(self.emitter.fail(seq, late, ADAPTER_LOAD_TIMEOUT))
        return outputs
