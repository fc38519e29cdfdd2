"""Docstrings, comments and docs name only files the repository has (issue 32, point 8).

A path-like name (`lora/arena.py`, `docs/dataplane.md`, `gpu_check.sh`) in any tracked Python
or Markdown file must be a tracked file, or the tail of one's path; names of other projects'
files, and example files a reader writes, are listed below with where they come from. The
design contract the project started from lives outside the repository: the code cites
docs/architecture.md, its living version, instead.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# a name ending in one of these, not part of a longer path, URL, glob or attribute chain
REFERENCE = re.compile(
    r"(?<![\w/.\-~$*])((?:[A-Za-z_][\w.\-]*/)*[A-Za-z_][\w\-]*\.(?:py|md|sh|yaml|toml))(?![\w/])"
)
NOT_OURS = {
    "convert_hf_to_gguf.py": "llama.cpp's converter (benchmarks/peers/llamacpp.py)",
    "convert_lora_to_gguf.py": "llama.cpp's converter (benchmarks/peers/llamacpp.py)",
    "modeling_rope_utils.py": "transformers' RoPE module",
    "models/gemma2/modeling_gemma2.py": "transformers' Gemma 2",
    "models/gemma3/modeling_gemma3.py": "transformers' Gemma 3",
    "modeling_evil.py": "a file a hostile adapter ships (tests/adapters/test_ingest.py)",
    "values-prod.yaml": "a values file the operator writes (docs/helm.md)",
    "support-bot.yaml": "a LoRAAdapter manifest a tenant writes (docs/operations.md)",
    "script.py": "Alembic's script.py.mako template, named in tests/test_packaging.py",
    "_gpu.py": "the *_gpu.py suffix of the GPU benchmarks",
}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def references(text: str) -> list[tuple[int, str]]:
    """(line, name) of each path-like file name in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in REFERENCE.finditer(text)]


def test_every_file_a_docstring_comment_or_doc_names_is_in_the_repository() -> None:
    tracked = _tracked()
    if not tracked:
        pytest.skip("not a git checkout")
    known = set(tracked) | {"/" + t for t in tracked}
    tails = {t[i + 1 :] for t in tracked for i, c in enumerate(t) if c == "/"}
    stale = []
    this = str(Path(__file__).relative_to(REPO))  # its negative control names stale files
    for name in (t for t in tracked if t.endswith((".py", ".md")) and t != this):
        for line, ref in references((REPO / name).read_text(encoding="utf-8")):
            if ref in known or ref in tails or ref in NOT_OURS:
                continue
            stale.append(f"{name}:{line}: {ref}")
    assert stale == [], "names of files the repository does not have:\n" + "\n".join(stale)


def test_the_reference_scan_finds_a_stale_name_and_passes_globs_urls_and_attributes() -> None:
    """The negative control: the scan would catch DESIGN.md, a moved module and a missing
    doc, and leaves alone what is not a file of ours."""
    text = (
        "see DESIGN.md section 7, kernels/gone.py and docs/nowhere.md;\n"
        "tests/dataplane/test_models_*_parity.py, https://example.com/a/b.py, table.c.name,"
        " $OUT/x.py, ~/y.md"
    )
    assert [r for _, r in references(text)] == ["DESIGN.md", "kernels/gone.py", "docs/nowhere.md"]
