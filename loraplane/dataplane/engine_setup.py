"""Building the engine a server's settings describe (in the server's process, or in the engine's
own: engine_process.py), with its adapter load times reported to the server's metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplane import fileaccess
from loraplane.adapters.errors import AdapterRejected
from loraplane.dataplane.step_observer import StepRecord
from loraplane.sizes import format_bytes

if TYPE_CHECKING:
    import torch

    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.server.settings import ServerSettings

log = logging.getLogger(__name__)
DEFAULT_TENANT = "default"  # the standalone server's one tenant (server/catalog.py)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's and the engine's


class StartupError(RuntimeError):
    """The server cannot serve (bad model, rejected static adapter)."""


def build_engine(
    settings: ServerSettings, observe: Callable[[str, float], None], *, detokenize: bool = True
) -> Engine:
    """The engine `settings` describe, with the static `--lora-modules` registered; each
    adapter load's seconds go to `observe(tier, seconds)` (tier "cpu": into host memory,
    "gpu": into a device slot): the static ones' here, the others' from the engine's step
    records (a step observer). Raises StartupError. Runs in the server's process or in the
    engine's (there with `detokenize` False: the server's process makes the text)."""
    from loraplane.dataplane.engine import Engine  # here: the server's process imports this
    # module for StartupError and LOG_FORMAT, without torch when the engine has a process

    disk = None
    if settings.controlplane_url:  # catalog mode: stored versions, through the tiers
        from loraplane.adapters.store import open_store
        from loraplane.dataplane.tiers.disk import DiskTier

        try:
            disk = DiskTier(open_store(settings.store))
            if disk.local:  # read in place: a folder this user cannot read fails at start
                with contextlib.suppress(FileNotFoundError):  # the control plane makes it
                    fileaccess.check_readable(disk.store.url())
        except (ValueError, OSError) as e:
            raise StartupError(f"LORAPLANE_STORE: {fileaccess.message(e, 'write')}") from e
        if settings.usage_spool_dir is not None:
            try:
                fileaccess.check_writable_dir(settings.usage_spool_dir)
            except OSError as e:
                raise StartupError(f"LORAPLANE_USAGE_SPOOL_DIR: {e}") from e
    start = time.perf_counter()
    try:
        engine = Engine(settings.engine_config(), disk=disk, detokenize=detokenize)
    except (ValueError, OSError) as e:
        reason = fileaccess.message(e)
        raise StartupError(f"cannot load model {settings.model}: {reason}") from e
    log.info("%s (%.1f s)", describe(engine), time.perf_counter() - start)
    engine.observers.append(LoadTimes(observe))
    for name, path in settings.adapter_dirs().items():
        start = time.perf_counter()
        try:
            engine.register_lora(name, path, DEFAULT_TENANT)
        except AdapterRejected as e:
            raise StartupError(f"adapter {name} rejected: {e.code.value}: {e.message}") from e
        except OSError as e:
            raise StartupError(f"adapter {name}: {fileaccess.message(e)}") from e
        observe("cpu", time.perf_counter() - start)
    return engine


def weights_form(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """How the model's projections are held: "float32", or the quantized layers by kind
    ("224 fp8 per block of 128x128 ...", "4-bit groups of 128")."""
    from loraplane.dataplane.models.quant import FP8Linear
    from loraplane.dataplane.models.quant_w4 import W4Linear

    kinds: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, FP8Linear):
            kinds[f"fp8 e4m3 {module.scale_form}"] += 1
        elif isinstance(module, W4Linear):
            group = "one group per row" if module.group_size >= module.in_features else (
                f"groups of {module.group_size}")  # fmt: skip
            kinds[f"4-bit, {group}"] += 1
    name = str(dtype).removeprefix("torch.")
    if not kinds:
        return name
    held = ", ".join(f"{count} in {kind}" for kind, count in kinds.most_common())
    return f"projections {held}, the rest {name}"


def describe(engine: Engine) -> str:
    """One line on what the engine loaded, for the log at start: the model, its weights' form
    and bytes, the KV cache and the adapter slots."""
    config, runner = engine.config, engine.runner
    model = runner.model
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if t.device.type
                  != "meta")  # fmt: skip
    split = config.tensor_parallel_size
    per = f" per rank of {split}" if split > 1 else ""
    kv = "fp8" if config.kv_cache_dtype == "fp8" else str(runner.dtype).removeprefix("torch.")
    tokens = runner.num_blocks * config.block_size
    shared = ", inside the KV cache" if config.kv_lora_shared else ""
    return (
        f"model {config.model} ({model.config.model_type}, {model.config.num_layers} layers) on"
        f" {runner.device}: weights {format_bytes(weights)}{per}"
        f" ({weights_form(model, runner.dtype)}); KV cache {runner.num_blocks:,} blocks of"
        f" {config.block_size} tokens ({tokens:,} tokens, {kv}); {runner.pool.num_slots}"
        f" adapter slots of rank <= {config.max_lora_rank}{shared}"
    )


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """A step observer: each adapter load of a step's record to `observe(tier, seconds)`
    (the server's loraplane_adapter_load_seconds, here or across the pipe)."""

    observe: Callable[[str, float], None]

    def __call__(self, record: StepRecord) -> None:
        for load in record.loads:
            self.observe(load.tier, load.seconds)
