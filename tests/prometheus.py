"""A real Prometheus for tests: Debian's binary on a free 127.0.0.1 port with a temporary config
and TSDB, scraping every second, and its instant-query API (.ci/install-prometheus.sh installs
the binary)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.servers import free_port

PROMETHEUS = Path("/usr/bin/prometheus")
MISSING = "Debian's prometheus is not installed (run .ci/install-prometheus.sh)"


@contextlib.contextmanager
def running_prometheus(tmp: Path, scrape_configs: list[dict[str, Any]]) -> Iterator[str]:
    """Prometheus scraping `scrape_configs` every second; yields its URL once it is ready."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": scrape_configs,
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("prometheus not ready after 30 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def instant(prom: str, promql: str) -> list[dict[str, Any]]:
    """The result of an instant query (raises on a query error)."""
    r = httpx.get(prom + "/api/v1/query", params={"query": promql}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result
