"""The request fields that ask for structured outputs, read into a `Constraint` (the API's side;
compiling it and masking tokens is structured.py's): OpenAI's `response_format` and vLLM's
`structured_outputs`. A field that is malformed raises GrammarError naming it (a 400)."""

from __future__ import annotations

import json

from loraplane.dataplane.structured import Constraint, GrammarError

# the vLLM structured_outputs keys served; other keys are refused unless null or false (clients
# that serialise every field send the unset ones so)
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(schema: object, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def from_response_format(obj: object) -> Constraint | None:
    """OpenAI's `response_format`: `text` is None; `json_object`; `json_schema` (a missing
    `schema` means any JSON object; `strict` is checked to be a bool, the schema is enforced
    either way)."""
    if not isinstance(obj, dict):
        raise GrammarError("response_format must be an object")
    kind = obj.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise GrammarError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    spec = obj.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema must be an object")
    if not isinstance(spec.get("name", ""), str):
        raise GrammarError("response_format.json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise GrammarError("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        return Constraint("json_object")
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON Schema object")
    return Constraint("json", _schema_text(schema, "response_format.json_schema.schema"))


def from_structured_outputs(obj: object) -> Constraint | None:
    """vLLM's `structured_outputs`: at most one of `json` (a schema, as an object or JSON text),
    `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF), `json_object: true`."""
    if not isinstance(obj, dict):
        raise GrammarError("structured_outputs must be an object")
    given = {k: v for k, v in obj.items() if v is not None and v is not False}
    unsupported = sorted(k for k in given if k not in _STRUCTURED_OUTPUTS_KEYS)
    if unsupported:
        raise GrammarError(f"structured_outputs does not support {', '.join(unsupported)}")
    if len(given) > 1:
        raise GrammarError(
            "structured_outputs takes one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(sorted(given))}"
        )
    if not given:
        return None
    ((key, value),) = given.items()
    if key == "json":
        return Constraint("json", _schema_text(value, "structured_outputs.json"))
    if key == "json_object":
        if value is not True:
            raise GrammarError("structured_outputs.json_object must be a boolean")
        return Constraint("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("structured_outputs.choice must be a non-empty list of strings")
        return Constraint("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise GrammarError(f"structured_outputs.{key} must be a non-empty string")
    return Constraint("regex" if key == "regex" else "grammar", value)
