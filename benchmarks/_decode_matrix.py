"""engine_gpu.py's decode matrix: the questions a kind benchmark does not ask (issue 30, point 5).

Each case is a decode step of `rows` sequences (64 and 256 at full size) over `adapters`
distinct adapters (8 and 64; sequence i uses adapter i % adapters), sampling greedily or with
temperature 0.8 and top-p 0.9, on an engine without and with CUDA graphs. Per case:
- decode_step_ms_<case>: median wall time of engine.step() over the timed steps (a step
  returns token ids, so its device work is done when it returns);
- device_ms_<case>: the median time of the step's model work: the forward (or the graph
  replay) and the lm_head, from CUDA events recorded at the start and end of each (perf_counter
  on CPU), so gaps between an eager forward's launches count as device time;
  host_ms_<case> = step - device, the step's work around the model (scheduling, step inputs and
  the graphs' static buffers, sampling and its transfers to the host), and
  host_fraction_<case> = host / step (the issue's goal at 256 rows: <= 0.10);
- roofline_ms_<case>: the bytes the step must move through HBM over --hbm-tbps: every weight but
  the embedding table (the lm_head's vocab x hidden included), the A and B of each distinct
  adapter, each sequence's KV cache at the timed steps' mean context, and the logits: rows x
  vocab fp32 written and read once for greedy (an argmax), three times for sampling
  (temperature, the top-p sort, the draw): LOGIT_PASSES; decode_over_roofline_<case> =
  step / roofline (the issue's goal at 256 rows and 64 adapters: <= 1.5);
- logits_mib_<rows>r_<sampling>: the logits' share of that traffic.
<case> is `<rows>r_<adapters>a_<greedy|sampled>_<eager|graphs>`. On CPU (the --smoke run) the
same cases run at 2 and 4 rows over 2 and 4 adapters: they check the script, not speed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from _gpu_model import adapter_bytes, checkpoint_layout

from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef

SAMPLINGS = {"greedy": (0.0, 1.0), "sampled": (0.8, 0.9)}  # (temperature, top_p)
# fp32 passes over the logits a step makes (written by the lm_head's cast, then read): one for
# an argmax; for temperature + top-p, the scaling, the sort and the draw
LOGIT_PASSES = {"greedy": 2, "sampled": 6}


@dataclass(frozen=True, slots=True)
class Matrix:
    """The cases' sizes: rows per step and distinct adapters (each a tuple, ascending)."""

    rows: tuple[int, ...]
    adapters: tuple[int, ...]
    steps: int  # timed decode steps per case
    prompt_len: int


class DeviceTimer:
    """Time the device spends in a step's model work: the intervals between entering and
    leaving the wrapped calls (nested calls count once), measured with CUDA events on a GPU
    and perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._depth = 0
        self._events: list[tuple[Any, Any]] = []
        self._seconds = 0.0
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str) -> None:
        """Time every call of `owner.name` from now on (until `close`)."""
        inner = getattr(owner, name)
        had = name in vars(owner)  # an instance attribute to put back, else a method
        setattr(owner, name, self._timed(inner))
        self._restore.append(lambda: setattr(owner, name, inner) if had else delattr(owner, name))

    def wrap_items(self, table: dict[Any, Callable[[], Any]]) -> None:
        """Time every call of each value of `table` from now on (until `close`)."""
        saved = dict(table)
        for key, inner in saved.items():
            table[key] = self._timed(inner)
        self._restore.append(lambda: table.update(saved))

    def _timed(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._interval():
                return inner(*args, **kwargs)

        return timed

    @contextmanager
    def _interval(self) -> Iterator[None]:
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        start = time.perf_counter()
        begin = end = None
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
        try:
            yield
        finally:
            self._depth -= 1
            if self.cuda:
                end.record()  # type: ignore[union-attr]
                self._events.append((begin, end))
            else:
                self._seconds += time.perf_counter() - start

    def take(self) -> float:
        """Seconds of device work since the last take (call once the step has returned)."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
            self._seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1e3
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def close(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def timer_for(engine: Engine) -> DeviceTimer:
    """A DeviceTimer around `engine`'s forward, its graph replays and its lm_head (not the
    graphs' host work before a replay: filling the static buffers is host time)."""
    runner = engine.runner
    timer = DeviceTimer(runner.device)
    timer.wrap(runner.model, "forward")
    timer.wrap(runner.model, "compute_logits")
    replays = getattr(getattr(runner, "cuda_graphs", None), "_graphs", None)
    if isinstance(replays, dict):  # (batch size, with LoRA) -> replay
        timer.wrap_items(replays)
    return timer


def decode_case(
    engine: Engine, loras: Sequence[LoRARef | None], prompt_ids: Sequence[list[int]],
    sampling: str, steps: int, timer: DeviceTimer,
) -> tuple[float, float]:  # fmt: skip
    """(median step seconds, median device seconds) of `steps` decode steps of len(loras)
    sequences, after their prefill; the requests are aborted after."""
    budget = engine.config.max_num_batched_tokens
    prefill_steps = -(-sum(len(p) for p in prompt_ids) // budget) + 1
    temperature, top_p = SAMPLINGS[sampling]
    params = SamplingParams(temperature=temperature, top_p=top_p, ignore_eos=True,
                            max_tokens=steps + prefill_steps + 2)  # fmt: skip
    stamp = time.monotonic_ns()
    ids = [f"m{stamp}-{i}" for i in range(len(loras))]
    for rid, p, lora in zip(ids, prompt_ids, loras, strict=True):
        engine.add_request(rid, p, params, lora)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    timer.take()
    walls, device = [], []
    for _ in range(steps):
        if len(engine.scheduler.running) != len(loras):
            raise RuntimeError(f"{len(engine.scheduler.running)} rows decode, not {len(loras)}")
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        device.append(timer.take())
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    return statistics.median(walls), statistics.median(device)


def roofline_parts(
    config: dict[str, Any], rank: int, item: int, rows: int, adapters: int, context: float,
    sampling: str,
) -> dict[str, float]:  # fmt: skip
    """Bytes one decode step moves through HBM, by part (the module docstring's model)."""
    layout = checkpoint_layout(config)
    weights = sum(math.prod(d) for n, d in layout if n != "model.embed_tokens.weight") * item
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * item
    return {
        "weights": float(weights),
        "adapters": float(adapters * adapter_bytes(config, rank, item)),
        "kv": per_token * context * rows,
        "logits": float(rows * config["vocab_size"] * 4 * LOGIT_PASSES[sampling]),
    }


def matrix_phase(
    figures: dict[str, float], engine: Engine, refs: Sequence[LoRARef], matrix: Matrix,
    prompts_for: Callable[[int], list[list[int]]], config: dict[str, Any], rank: int, item: int,
    hbm_tbps: float, graphs: bool, log: Callable[[str], None],
) -> None:  # fmt: skip
    """Every case of the matrix on `engine` (with or without graphs), its figures into
    `figures` as they are measured."""
    mode = "graphs" if graphs else "eager"
    timer = timer_for(engine)
    decode_graphs = getattr(engine.runner, "cuda_graphs", None)
    replays = getattr(decode_graphs, "replays", 0)
    try:
        for rows in matrix.rows:
            prompt_ids = prompts_for(rows)
            context = matrix.prompt_len + 1 + (matrix.steps - 1) / 2  # a rough mean
            for count in matrix.adapters:
                loras: list[LoRARef | None] = [refs[i % count] for i in range(rows)]
                for sampling in SAMPLINGS:
                    case = f"{rows}r_{count}a_{sampling}_{mode}"
                    log(f"decode matrix: {case}")
                    step, device = decode_case(engine, loras, prompt_ids, sampling,
                                               matrix.steps, timer)  # fmt: skip
                    parts = roofline_parts(config, rank, item, rows, min(count, rows), context,
                                           sampling)  # fmt: skip
                    roofline = sum(parts.values()) / (hbm_tbps * 1e12)
                    host = max(0.0, step - device)
                    figures[f"decode_step_ms_{case}"] = step * 1e3
                    figures[f"device_ms_{case}"] = device * 1e3
                    figures[f"host_ms_{case}"] = host * 1e3
                    figures[f"host_fraction_{case}"] = host / step
                    figures[f"roofline_ms_{case}"] = roofline * 1e3
                    figures[f"decode_over_roofline_{case}"] = step / roofline
                    figures[f"logits_mib_{rows}r_{sampling}"] = parts["logits"] / 2**20
                    print(f"  {case}: step {step * 1e3:.2f} ms, roofline {roofline * 1e3:.2f} "
                          f"ms ({step / roofline:.2f}x), host {host * 1e3:.2f} ms "
                          f"({host / step:.0%})", flush=True)  # fmt: skip
    finally:
        timer.close()
    if graphs:  # the timed steps replayed (a capture that failed would leave them eager)
        figures["graph_replays_matrix"] = float(getattr(decode_graphs, "replays", 0) - replays)


# the goals, on the largest case with graphs (the path meant to meet them; the eager
# figures say how far it is without)
MATRIX_GOALS = tuple(
    (f"{figure}_256r_64a_{sampling}_graphs", "<=", target)
    for figure, target in (("decode_over_roofline", 1.5), ("host_fraction", 0.10))
    for sampling in SAMPLINGS
)
