"""The dashboards are well-formed Grafana JSON whose queries use only metrics loraplane's own
components export (docs/dataplane.md "Metrics: three views", the control plane's and the
operator's metrics): no
kube-state-metrics or other exporter is needed."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboards.dashboards import load, metric_names, panels, queries

BOARDS = load()


def exported_series_names() -> set[str]:
    """Every series name the data plane's, control plane's and operator's registries expose."""
    from loraplane.controlplane.metrics import Metrics
    from loraplane.dataplane.server.metrics import ServerMetrics
    from loraplane.operator.metrics import PoolMetrics

    server = ServerMetrics()
    server.snapshot.cpu_bytes_limit = 1 << 30  # exported when --max-cpu-lora-bytes is set
    names: set[str] = set()
    for text in (server.render(), Metrics().render(), PoolMetrics().render()):
        for family in text_string_to_metric_families(text.decode()):
            suffixes = {
                "counter": ["_total", "_created"],
                "histogram": ["_bucket", "_count", "_sum", "_created"],
            }.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def test_there_are_fleet_adapters_and_autoscaling_dashboards() -> None:
    assert sorted(BOARDS) == ["adapters.json", "autoscaling.json", "fleet.json"]
    uids = [b["uid"] for b in BOARDS.values()]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_is_well_formed(name: str) -> None:
    board = BOARDS[name]
    assert board["title"].startswith("loraplane / ")
    variables = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in variables
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels(board):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__range"}
            assert used <= variables, f"{panel['title']}: unknown variables {used - variables}"


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, pool) (rate(x_bucket{pool=~"$pool"}'
        "[$__rate_interval]))) / on (pool) group_left sum(vllm:y) or vector(0)"
    )
    assert metric_names(expr) == {"x_bucket", "vllm:y"}


def test_the_host_tier_shows_its_adapters_and_their_bytes_against_the_limit() -> None:
    """The adapters dashboard's host tier: the copies per replica beside their bytes and the
    byte limit (`--max-cpu-lora-bytes`), in one panel, as the device pool's memory is shown."""
    host = [q for q in queries() if q.dashboard == "adapters.json" and "Host-tier" in q.panel]
    count = {q.panel for q in host if 'loraplane_adapter_resident{tier="cpu"' in q.expr}
    used = {q.panel for q in host if "loraplane_cpu_adapter_bytes_used" in q.metrics}
    limit = {q.panel for q in host if "loraplane_cpu_adapter_bytes_limit" in q.metrics}
    assert count and used and used == limit and not count & used
    board = BOARDS["adapters.json"]
    rows = [p for p in board["panels"] if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"] == "Host tier"]
    below = [r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > row["gridPos"]["y"]]
    for panel in panels(board):
        if panel["title"] in count | used:  # in the host tier's row
            assert row["gridPos"]["y"] < panel["gridPos"]["y"] < min(below), panel["title"]


def test_queries_use_only_exported_metrics() -> None:
    exported = exported_series_names()
    for query in queries():
        unknown = query.metrics - exported
        assert not unknown, f"{query.name}: {unknown} are not exported by loraplane"
