"""`loraplane controlplane` stops on SIGINT (Ctrl-C) and SIGTERM (a pod's stop) after its
graceful shutdown, with exit status 0 and no traceback: uvicorn re-raised the signal, so
Ctrl-C printed a KeyboardInterrupt traceback and SIGTERM ended the process by that signal."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.controlplane.conftest import start_command
from tests.servers import free_port


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("internal", [False, True], ids=["one-port", "two-ports"])
def test_a_stop_signal_ends_the_command_with_exit_0_and_no_traceback(
    tmp_path: Path, sig: signal.Signals, internal: bool
) -> None:
    port = free_port()
    more = ["--internal-port", str(free_port())] if internal else []
    proc = start_command(tmp_path, port, *more)
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert "Finished server process" in out, out  # the graceful shutdown ran
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
