"""The API reference in docs/api/, generated from the services' OpenAPI documents.

Regenerate with `python -m tests.api_docs`; `tests/test_api_docs.py` fails when the committed
reference differs from what the code serves.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api"


def _schema_name(ref: dict[str, Any] | None) -> str:
    if not ref:
        return ""
    if "$ref" in ref:
        return "`" + ref["$ref"].rsplit("/", 1)[-1] + "`"
    if ref.get("type") == "array" and "items" in ref:
        return _schema_name(ref["items"]) + "[]"
    return f"`{ref.get('type', 'object')}`"


def render(title: str, intro: str, spec: dict[str, Any]) -> str:
    """Markdown: one table row per operation, then each request/response schema's fields."""
    lines = [f"# {title}", "", intro, "", "| method | path | summary | body | responses |",
             "|---|---|---|---|---|"]  # fmt: skip
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {})
            kinds = ", ".join(
                f"{_schema_name(c.get('schema'))} ({ctype})".strip() for ctype, c in body.items()
            )
            codes = ", ".join(sorted(op.get("responses", {})))
            summary = (op.get("description") or op.get("summary") or "").split("\n")[0]
            lines.append(f"| {method.upper()} | `{path}` | {summary} | {kinds} | {codes} |")
    lines += ["", "## Schemas", ""]
    for name, schema in sorted(spec.get("components", {}).get("schemas", {}).items()):
        props = schema.get("properties", {})
        if not props:
            continue
        required = set(schema.get("required", []))
        lines += [f"### {name}", ""]
        if schema.get("description"):
            lines += [schema["description"].split("\n")[0], ""]
        lines += ["| field | type | required |", "|---|---|---|"]
        for field, value in props.items():
            kind = _schema_name(value) or "`" + json.dumps(value.get("anyOf", ""))[:60] + "`"
            lines.append(f"| `{field}` | {kind} | {'yes' if field in required else ''} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def controlplane_spec() -> dict[str, Any]:
    from loraplane.controlplane.main import create_app
    from tests.controlplane.conftest import make_settings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(make_settings(Path(tmp), f"sqlite:///{tmp}/c.db"))
        try:
            spec: dict[str, Any] = app.openapi()
        finally:
            app.state.ctx.close()
    return spec


def dataplane_spec() -> dict[str, Any]:
    from loraplane.dataplane.server.app import create_app
    from loraplane.dataplane.server.settings import ServerSettings

    spec: dict[str, Any] = create_app(ServerSettings(model="/model")).openapi()
    return spec


def documents() -> dict[str, str]:
    """file name -> generated Markdown."""
    return {
        "controlplane.md": render(
            "Control plane REST API",
            "Generated from the OpenAPI document (`GET /openapi.json`, browsable at `/docs`). "
            'Errors are `{"error": {"code", "message"}}`; see docs/controlplane.md.',
            controlplane_spec(),
        ),
        "dataplane.md": render(
            "Data plane API (OpenAI- and vLLM-compatible)",
            "Generated from the OpenAPI document of `loraplane serve`. Errors are OpenAI-shaped; "
            "see docs/dataplane.md.",
            dataplane_spec(),
        ),
    }


if __name__ == "__main__":
    DOCS.mkdir(parents=True, exist_ok=True)
    for name, text in documents().items():
        (DOCS / name).write_text(text)
        print(f"wrote {DOCS / name}", file=sys.stderr)
