"""Building the engine a server's settings describe (in the server's process, or in the engine's
own: engine_process.py), with its adapter load times reported to the server's metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplane import fileaccess
from loraplane.adapters.errors import AdapterRejected
from loraplane.dataplane.step_observer import StepRecord

if TYPE_CHECKING:
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
    try:
        engine = Engine(settings.engine_config(), disk=disk, detokenize=detokenize)
    except (ValueError, OSError) as e:
        reason = fileaccess.message(e)
        raise StartupError(f"cannot load model {settings.model}: {reason}") from e
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


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """A step observer: each adapter load of a step's record to `observe(tier, seconds)`
    (the server's loraplane_adapter_load_seconds, here or across the pipe)."""

    observe: Callable[[str, float], None]

    def __call__(self, record: StepRecord) -> None:
        for load in record.loads:
            self.observe(load.tier, load.seconds)
