"""The serving process's heap and the garbage collector."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect, then move every object alive now (the model's modules, the tokenizer, the
    libraries' own) into the collector's permanent generation. A full collection walks every
    tracked object, and it runs on whichever thread allocates when it falls due, the engine's
    step included: 360,000 objects after start on the demo-sized model, 87-92 ms a walk,
    which every request in flight would wait. Frozen objects are never walked again (nor freed
    if they become cyclic garbage: fine for what lives as long as the process)."""
    gc.collect()
    gc.freeze()
    log.info("froze %d startup objects out of the garbage collector", gc.get_freeze_count())
