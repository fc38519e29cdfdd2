"""`loraplane controlplane` stops on SIGINT (Ctrl-C) and SIGTERM (a pod's stop) after its
graceful shutdown, with exit status 0 and no traceback: uvicorn re-raised the signal, so
Ctrl-C printed a KeyboardInterrupt traceback and SIGTERM ended the process by that signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.controlplane.conftest import ADMIN, SERVICE
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("internal", [False, True], ids=["one-port", "two-ports"])
def test_a_stop_signal_ends_the_command_with_exit_0_and_no_traceback(
    tmp_path: Path, sig: signal.Signals, internal: bool
) -> None:
    port = free_port()
    args = ["controlplane", "--port", str(port)]
    if internal:
        args += ["--internal-port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_DATA_DIR": str(tmp_path),
           "LORAPLANE_ADMIN_TOKEN": ADMIN, "LORAPLANE_SERVICE_TOKEN": SERVICE}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the control plane did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert "Finished server process" in out, out  # the graceful shutdown ran
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
