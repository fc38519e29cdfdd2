"""How the Triton tests run, decided once: imported by each of them before Triton is.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, which
tests/conftest.py sets before anything imports Triton, and this module too when imported alone);
with CUDA and TRITON_INTERPRET unset, the compiled kernels run on CUDA tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


def require_triton() -> None:
    """Skip the calling test module unless its kernels can run here (interpreted or on CUDA)."""
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
    pytest.importorskip("triton")
