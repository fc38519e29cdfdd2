"""The built images, run as the chart runs them: a real Docker engine, containers on the host's
network (loopback only), uid 10001, a read-only root file system, a writable /tmp, no
capabilities. `.ci/image.sh` builds the images and names them in LORAPLANE_TEST_IMAGE (full)
and LORAPLANE_TEST_IMAGE_SLIM; without those the tests skip, saying so."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# the pod's securityContext in the chart, as `docker run` flags
AS_THE_CHART = ["--network", "host", "--read-only", "--tmpfs", "/tmp", "--user", "10001",
                "--cap-drop", "ALL"]  # fmt: skip
LABEL = "loraplane.test=image"  # .ci/image.sh removes any container left with it
NOT_BUILT = "{} is not set: the image tests run from .ci/image.sh (a Docker engine, built images)"


def docker() -> str:
    """The Docker client: LORAPLANE_TEST_DOCKER, else the one on PATH."""
    return os.environ.get("LORAPLANE_TEST_DOCKER") or shutil.which("docker") or "docker"


def _image(var: str) -> str:
    image = os.environ.get(var, "").strip()
    if not image:
        pytest.skip(NOT_BUILT.format(var))
    return image


@pytest.fixture(scope="session")
def full_image() -> str:
    """The full image (every component, torch, the prebuilt kernels)."""
    return _image("LORAPLANE_TEST_IMAGE")


@pytest.fixture(scope="session")
def slim_image() -> str:
    """The slim image (control plane and operator, no torch)."""
    return _image("LORAPLANE_TEST_IMAGE_SLIM")


@pytest.fixture(params=["full", "slim"])
def any_image(request: pytest.FixtureRequest) -> str:
    """Each image in turn (what both must do)."""
    return str(request.getfixturevalue(f"{request.param}_image"))


def readable_copy(src: Path, dst: Path) -> Path:
    """A copy of `src` that uid 10001 can read (save_pretrained leaves files 0600), for a
    read-only bind mount."""
    shutil.copytree(src, dst)
    dst.chmod(0o755)
    for path in dst.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def _run_flags(env: Mapping[str, str], mounts: Mapping[Path, str]) -> list[str]:
    name = f"loraplane-test-{uuid.uuid4().hex[:12]}"
    flags = ["--name", name, "--label", LABEL, *AS_THE_CHART]
    for host, inside in mounts.items():
        flags += ["-v", f"{host}:{inside}:ro"]
    for key, value in env.items():
        flags += ["-e", f"{key}={value}"]
    return flags


@dataclass
class Container:
    """A running container, by name."""

    name: str

    def logs(self) -> str:
        done = subprocess.run([docker(), "logs", self.name], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        return done.stdout + done.stderr

    def running(self) -> bool:
        done = subprocess.run([docker(), "inspect", "-f", "{{.State.Running}}", self.name],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        return done.stdout.strip() == "true"

    def wait_http(self, url: str, timeout: float = 120.0) -> None:
        """Until `url` answers 200; fails with the container's log when it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if not self.running():
                pytest.fail(f"{self.name} exited before {url} answered:\n{self.logs()[-4000:]}")
            time.sleep(0.2)
        pytest.fail(f"{url} did not answer 200 in {timeout} s:\n{self.logs()[-4000:]}")


@contextlib.contextmanager
def container(
    image: str,
    args: list[str],
    env: Mapping[str, str] | None = None,
    mounts: Mapping[Path, str] | None = None,
) -> Iterator[Container]:
    """`image ARGS` started detached as the chart runs it; always removed afterwards."""
    flags = _run_flags(env or {}, mounts or {})
    name = flags[1]
    try:
        subprocess.run([docker(), "run", "-d", *flags, image, *args], check=True,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
        yield Container(name)
    finally:
        subprocess.run([docker(), "rm", "-f", name], capture_output=True, timeout=60)


def run_once(
    image: str,
    args: list[str],
    env: Mapping[str, str] | None = None,
    entrypoint: str | None = None,
    timeout: float = 180.0,
) -> subprocess.CompletedProcess[str]:
    """`image ARGS` run to its end as the chart runs it (removed afterwards)."""
    flags = _run_flags(env or {}, {})
    if entrypoint:
        flags += ["--entrypoint", entrypoint]
    try:
        return subprocess.run([docker(), "run", *flags, image, *args], capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    finally:
        subprocess.run([docker(), "rm", "-f", flags[1]], capture_output=True, timeout=60)
