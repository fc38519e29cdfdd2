"""The chart's Grafana dashboards: their queries and the metric names those use."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "loraplane" / "dashboards"

# Grafana's variables, as the live test substitutes them.
SUBSTITUTIONS = {
    "$__rate_interval": "15s",
    "$__range": "1m",
    "$pool": ".*",
    "$tenant": ".*",
}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Query:
    """One panel target."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def name(self) -> str:
        return f"{self.dashboard}: {self.panel} [{self.ref_id}]"

    @property
    def metrics(self) -> set[str]:
        return metric_names(self.expr)

    def promql(self) -> str:
        """The expression with Grafana's variables replaced."""
        return substitute(self.expr)


def substitute(expr: str) -> str:
    """`expr` with Grafana's variables replaced by SUBSTITUTIONS."""
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def load() -> dict[str, dict[str, Any]]:
    """File name -> dashboard."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries() -> list[Query]:
    """Every panel target of every dashboard."""
    out = []
    for name, board in load().items():
        for panel in panels(board):
            for target in panel.get("targets", []):
                out.append(Query(name, panel["title"], target["refId"], target["expr"]))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard, metric selector, label) of every `label_values(...)` variable."""
    out = []
    for name, board in load().items():
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert match, variable["definition"]
            out.append((name, match.group(1), match.group(2)))
    return out
