"""Prebuilt native CPU SGMV kernels: built once (the image's build stage), chosen at run time.

An image runs on CPUs other than the one that built it, so it cannot ship one `-march=native`
build. It ships a folder of portable builds instead, one per instruction-set level and threading
variant, and a `manifest.json` naming each one's file and the CPU flags it needs:

    x86_64:  x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA, F16C), baseline (x86-64: SSE2)
    other:   baseline (the compiler's default for the machine)
    each:    openmp (-fopenmp: joins torch's OpenMP team) and serial (-fopenmp-simd)

`sgmv_cpu.library()` loads the best one this CPU runs (`LORAPLANE_KERNEL_PREBUILT` names the
folder; the image sets it) and compiles on first use only where none fits.

Standard library only, and runnable as a script, so a build stage without torch can make the
folder: `python sgmv_cpu_prebuilt.py OUT_DIR` (`$CC`, else `cc`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

SOURCE = Path(__file__).with_name("sgmv_cpu.c")
MANIFEST = "manifest.json"
COMMON = ("-O3", "-shared", "-fPIC")
THREADING = {"openmp": ("-fopenmp",), "serial": ("-fopenmp-simd",)}

# /proc/cpuinfo's names for what each x86-64 level requires (the psABI's levels; SSE3 is "pni",
# LZCNT "abm")
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Variant:
    """One instruction-set level: its compiler flags and the CPU flags it needs."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]


def variants(machine: str) -> tuple[Variant, ...]:
    """The levels built for `machine` (platform.machine()), best first."""
    if machine in ("x86_64", "AMD64"):
        generic = ("-mtune=generic",)
        return (
            Variant("x86-64-v4", ("-march=x86-64-v4", *generic), _V4),
            Variant("x86-64-v3", ("-march=x86-64-v3", *generic), _V3),
            Variant("baseline", ("-march=x86-64", *generic), frozenset()),
        )
    return (Variant("baseline", (), frozenset()),)


def source_digest() -> str:
    """The sha256 of the kernel's C source: a prebuilt folder from another source is stale."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build(out: Path, compiler: str) -> dict[str, object]:
    """Build every variant and threading into `out` and write its manifest (returned). A
    variant that does not build is left out (said on stderr); none at all raises RuntimeError."""
    out.mkdir(parents=True, exist_ok=True)
    libraries: list[dict[str, object]] = []
    for variant in variants(platform.machine()):
        for threading, extra in THREADING.items():
            name = f"sgmv-{variant.name}-{threading}.so"
            cmd = [compiler, *COMMON, *variant.flags, *extra, "-o", str(out / name), str(SOURCE),
                   "-lm"]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                print(f"skipped {name}: {done.stderr.strip()[-500:]}", file=sys.stderr)
                continue
            libraries.append({"variant": variant.name, "threading": threading, "file": name,
                              "cpu_flags": sorted(variant.cpu_flags)})  # fmt: skip
    if not libraries:
        raise RuntimeError(f"no variant of {SOURCE.name} built with {compiler}")
    manifest: dict[str, object] = {
        "source_sha256": source_digest(),
        "machine": platform.machine(),
        "compiler": _version(compiler),
        "libraries": libraries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return compiler
    return done.stdout.splitlines()[0] if done.stdout else compiler


def main(argv: list[str] | None = None) -> int:
    """`python sgmv_cpu_prebuilt.py OUT_DIR`: the prebuilt folder an image ships."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to fill (created)")
    args = parser.parse_args(argv)
    compiler = os.environ.get("CC") or "cc"
    try:
        manifest = build(args.out, compiler)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for entry in cast("list[dict[str, str]]", manifest["libraries"]):
        print(f"built {args.out / entry['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
