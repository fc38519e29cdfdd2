"""Triton's interpreter (`TRITON_INTERPRET=1`: the kernels on CPU tensors, in tests and in the
benchmarks' CPU smoke runs) without its repeated set-up inside a launch.

A launch in the interpreter swaps the `triton.language` builtins for interpreted ones (Triton's
`_patch_lang`: seven `inspect.getmembers` walks over the language's modules), runs every
program, and swaps them back. Triton 3.x does the same swap again, never undone, each time a
kernel calls a `@triton.jit` helper (`InterpretedFunction.__call__`): once per helper call per
program, while the launch's swap is still in force. Our kernels call helpers inside their loops
(`sgmv_triton._shrink_tile`, `_load_b_t`, `attention_triton`'s tiles), and those walks were a
quarter of an interpreted engine test's time.

`skip_nested_patching` wraps Triton's `_patch_lang`: a launch swaps both language modules
(`triton.language` and `triton.language.core`, which Triton's own helpers such as `tl.sum`
reach), and a helper called within it swaps nothing. What the helper runs is the same: the
modules' builtins are already the interpreted ones, the same objects the walk would install
again; and the launch undoes all of it at its end. Nothing changes where Triton compiles the
kernels (CUDA), or where its interpreter lacks the names this relies on (then the wrapper is
not installed).
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)
_INSTALLED = "_loraplane_skips_nested_patching"


def skip_nested_patching() -> bool:
    """Install the wrapper into Triton's interpreter when the kernels run in it (idempotent;
    the kernel modules call it as they are imported); whether it is installed."""
    try:
        import triton  # type: ignore[import-untyped]  # Triton ships no type information
        import triton.language as tl  # type: ignore[import-untyped]
        from triton.runtime import interpreter  # type: ignore[import-untyped]
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    if not getattr(getattr(knobs, "runtime", None), "interpret", False):
        return False  # compiled kernels: no interpreter to touch
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type(), "restore"):
        log.debug("Triton's interpreter has no _patch_lang scope: left as it is")
        return False
    if getattr(original, _INSTALLED, False):
        return True
    # a function whose globals reach both language modules (Triton swaps the ones a function's
    # globals reach): a launch swaps both, so that Triton's own helpers (tl.sum, tl.max, whose
    # globals reach tl.core only) find them swapped too
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    inside = False  # a launch is in progress: the language is swapped

    def patch_lang(fn: Any) -> Any:
        nonlocal inside
        if inside:
            return scope_type()  # a helper within the launch: nothing to do or undo
        scope = original(both)
        inside = True
        restore = scope.restore

        def restore_and_leave() -> None:
            nonlocal inside
            restore()
            inside = False

        scope.restore = restore_and_leave
        return scope

    setattr(patch_lang, _INSTALLED, True)
    interpreter._patch_lang = patch_lang
    return True
