"""The wheel (what the container image installs) is complete: built from this checkout and
unpacked away from it, it imports, migrates a catalog with the revisions it carries, and
its CLI parses the commands the Helm chart runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")

CHECK = """
import sys
from pathlib import Path
site = Path(sys.argv[1])
import loraplane
assert Path(loraplane.__file__).is_relative_to(site), loraplane.__file__
from loraplane.controlplane import db
assert db.MIGRATIONS_DIR.is_relative_to(site), db.MIGRATIONS_DIR
engine = db.make_engine(f"sqlite:///{site.parent / 'catalog.db'}")
db.upgrade(engine)
assert db.current_revision(engine) == db.head_revision() is not None
print("migrated to", db.current_revision(engine))
from loraplane.cli import build_parser
for argv in (["controlplane", "migrate"], ["operator", "-A", "--metrics-port", "8080"]):
    build_parser().parse_args(argv)
from loraplane.controlplane.console import app as console
assert Path(console.__file__).is_relative_to(site), console.__file__
console.create_console_app(dataplane_url=None)  # reads every page from the installed package
print("console pages:", len(console.FILES))
"""


@pytest.mark.slow
def test_the_wheel_carries_its_migrations_and_runs_installed(tmp_path: Path) -> None:
    # Built from a copy of what the image's build stage copies, so no stale build/ folder
    # of the checkout can add files, and nothing is written into the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "loraplane", src / "loraplane", ignore=CACHES)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = out.glob("loraplane-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    migrations = "loraplane/controlplane/migrations/"
    assert f"{migrations}env.py" in names and f"{migrations}script.py.mako" in names
    assert any(n.startswith(f"{migrations}versions/0001_") for n in names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    console = ROOT / "loraplane/controlplane/console"
    pages = sorted(p.name for p in console.iterdir() if p.suffix in (".html", ".css", ".js"))
    assert pages and {f"loraplane/controlplane/console/{p}" for p in pages} <= set(names)
    # the native CPU kernel's source: it is compiled where the package is installed
    assert "loraplane/dataplane/kernels/sgmv_cpu.c" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(site)],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "migrated to" in done.stdout and "console pages:" in done.stdout


def _dockerfile() -> dict[str, list[str]]:
    """The Dockerfile's stages by name, as instruction lines (continuations joined, comments
    dropped)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
    ends = [*starts[1:], len(lines)]
    return {lines[i].split()[-1]: lines[i:j] for i, j in zip(starts, ends, strict=True)}


def test_the_image_runs_what_the_chart_expects() -> None:
    """The Dockerfile checked against the chart, the Makefile and the package (the wheel test
    above builds exactly what its build stage copies; tests/image runs the built images)."""
    import tomllib

    import yaml

    stages = _dockerfile()
    assert list(stages) == ["kernels", "build", "runtime", "slim", "full"]  # full: the default
    assert all(ln.startswith("FROM ${BASE} ") for ln in (stages["build"][0], stages["runtime"][0]))
    build, final = stages["build"], stages["full"]
    copied = [src for ln in build if ln.startswith("COPY ") for src in ln.split()[1:-1]]
    assert sorted(copied) == ["README.md", "loraplane", "pyproject.toml"]
    args = dict(ln.removeprefix("ARG ").split("=", 1) for ln in final if ln.startswith("ARG "))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert (
        set(args["EXTRAS"].split(",")) == {"controlplane", "operator", "dataplane"} <= set(extras)
    )
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= {args['TORCH_SPEC']}" in makefile  # one pinned torch
    values = yaml.safe_load((ROOT / "charts/loraplane/values.yaml").read_text())
    uid = f"USER {values['controlplane']['podSecurityContext']['runAsUser']}"
    assert uid == f"USER {values['operator']['podSecurityContext']['runAsUser']}"
    assert uid in final and uid in stages["slim"]
    assert 'ENTRYPOINT ["loraplane"]' in stages["slim"]  # full is built on slim
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert {"*", "!pyproject.toml", "!README.md", "!loraplane/"} <= set(dockerignore)
