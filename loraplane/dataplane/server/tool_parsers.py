"""Tool-call parsers for tool_choice "auto": each reads one model family's calls out of its text.

`--tool-call-parser` names them as vLLM does:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere.
- `llama3_json` (Llama 3.1/3.2/3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`
  objects ("arguments" accepted too; no other keys but `"type": "function"`), several separated
  by `;`, optionally after `<|python_tag|>`; a call starts at the output's start, a line's start
  or the tag.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v0.3 tokenizer), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizer v11+, `[CALL_ID]id` before `[ARGS]`
  accepted); the array without its marker (a tokenizer that dropped the special token) at the
  start of a line. Call ids are 9 letters and digits, the only ids Mistral's templates accept.
- `pythonic` (Llama 3.2 / Llama 4): a Python list of calls `[f(a=1, b="x"), g()]` at the start
  of a line or after `<|python_start|>` (ending at an optional `<|python_end|>`), read with
  `ast`, never evaluated: keyword arguments with literal values only (str, numbers, bool, None,
  lists, tuples, dicts with str keys, nested).

Text that is not a complete, well-formed call of the format stays content, as the model wrote
it. Each format is read by tool_scan.py's scanner, for the whole text and for the stream alike.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from typing import Any

from loraplane.dataplane.server.tool_scan import (
    Calls,
    Format,
    Read,
    ToolCall,
    call_id,
    compact,
    skip_ws,
)


class Hermes(Format):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def read(self, text: str, start: int, final: bool) -> Read:
        close = text.find(self.CLOSE, start)
        if close == -1:
            return len(self.OPEN) if final else None
        try:
            data = json.loads(text[start + len(self.OPEN) : close])
        except ValueError:
            return len(self.OPEN)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return len(self.OPEN)
        call = ToolCall(data["name"], compact(data.get("arguments", {})), self.new_id())
        return Calls([call], close + len(self.CLOSE))


class Llama3Json(Format):
    """`[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`."""

    TAG = "<|python_tag|>"
    markers = (TAG,)
    opener = "{"
    _KEYS = frozenset({"name", "parameters", "arguments", "type"})

    def read(self, text: str, start: int, final: bool) -> Read:
        tagged = text.startswith(self.TAG, start)
        i = start + len(self.TAG) if tagged else start
        calls: list[ToolCall] = []
        end = start
        while True:
            j = skip_ws(text, i)
            if j == len(text) and not final:
                return None
            if j == len(text) or text[j] != "{":
                break
            found = self.json_at(text, j, final)
            if found is None:
                return None
            call = None if isinstance(found, int) else self._call(found[0])
            if call is None or isinstance(found, int):
                break
            calls.append(call)
            end = found[1]
            k = skip_ws(text, end)
            if k == len(text) and not final:
                return None  # a `;` and another call may follow
            if k == len(text) or text[k] != ";":
                break
            i = end = k + 1
        if not calls:
            return len(self.TAG) if tagged else 1
        return Calls(calls, end)

    def _call(self, data: Any) -> ToolCall | None:
        if not isinstance(data, dict) or not set(data) <= self._KEYS:
            return None
        name, kind = data.get("name"), data.get("type", "function")
        args = data.get("parameters", data.get("arguments", {}))
        if not isinstance(name, str) or not name or kind != "function":
            return None
        if ("parameters" in data and "arguments" in data) or not isinstance(args, dict):
            return None
        return ToolCall(name, compact(args), self.new_id())


class Mistral(Format):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`."""

    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (MARK,)
    opener = "["  # the array whose marker the detokenizer dropped
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")
    _ID = re.compile(r"[A-Za-z0-9]+")

    def new_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def read(self, text: str, start: int, final: bool) -> Read:
        if not text.startswith(self.MARK, start):
            return self._array(text, start, final, 1)
        skip = len(self.MARK)
        i = skip_ws(text, start + skip)
        if i == len(text):
            return skip if final else None
        if text[i] == "[":
            return self._array(text, i, final, skip)
        return self._named(text, i, final, skip)

    def _array(self, text: str, i: int, final: bool, skip: int) -> Read:
        found = self.json_at(text, i, final)
        if found is None:
            return None
        if not isinstance(found, tuple) or not isinstance(found[0], list) or not found[0]:
            return skip
        calls = [self._call(item) for item in found[0]]
        if any(c is None for c in calls):
            return skip
        return Calls([c for c in calls if c is not None], found[1])

    def _call(self, data: Any) -> ToolCall | None:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        args = data.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not data["name"] or not isinstance(args, dict):
            return None
        given = data.get("id")
        if not (isinstance(given, str) and self._ID.fullmatch(given)):
            given = self.new_id()
        return ToolCall(data["name"], compact(args), str(given))

    def _named(self, text: str, i: int, final: bool, skip: int) -> Read:
        name = self._NAME.match(text, i)
        if name is None:
            return skip
        pos, given = name.end(), None
        if pos == len(text):
            return skip if final else None
        if text.startswith(self.CALL_ID, pos):
            id_at = pos + len(self.CALL_ID)
            found_id = self._ID.match(text, id_at)
            if found_id is None:
                return None if not final and id_at == len(text) else skip
            if found_id.end() == len(text):
                return skip if final else None  # the id may go on
            pos, given = found_id.end(), found_id.group()
        if text.startswith(self.ARGS, pos):
            pos += len(self.ARGS)
        elif not final and any(m.startswith(text[pos:]) for m in (self.ARGS, self.CALL_ID)):
            return None
        pos = skip_ws(text, pos)
        if pos == len(text):
            return skip if final else None
        if text[pos] != "{":
            return skip
        found = self.json_at(text, pos, final)
        if found is None:
            return None
        if not isinstance(found, tuple) or not isinstance(found[0], dict):
            return skip
        call = ToolCall(name.group(), compact(found[0]), given or self.new_id())
        return Calls([call], found[1])


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal (str, number, bool, None, list, tuple, dict with str keys)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = node.operand
        if isinstance(inner, ast.Constant) and type(inner.value) in (int, float):
            number = _literal(inner)
            return -number if isinstance(node.op, ast.USub) else number
        raise _NotLiteral
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral  # `**x` or a key JSON cannot hold
            out[key.value] = _literal(item)
        return out
    raise _NotLiteral


def pythonic_calls(source: str) -> list[ToolCall] | None:
    """The calls of a Python list `[f(a=1), g()]`; None if it is anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    try:
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            args = {}
            for keyword in node.keywords:
                if keyword.arg is None:  # **kwargs
                    return None
                args[keyword.arg] = _literal(keyword.value)
            calls.append(ToolCall(node.func.id, compact(args), call_id()))
    except (_NotLiteral, RecursionError):
        return None
    return calls


class Pythonic(Format):
    """`[f(a=1, b="x"), g()]`, optionally inside `<|python_start|>...<|python_end|>`."""

    START, END = "<|python_start|>", "<|python_end|>"
    markers = (START,)
    opener = "["

    def read(self, text: str, start: int, final: bool) -> Read:
        tagged = text.startswith(self.START, start)
        skip = len(self.START) if tagged else 1
        i = skip_ws(text, start + len(self.START)) if tagged else start
        if i == len(text):
            return skip if final else None
        if text[i] != "[":
            return skip
        close = self.closing(text, i, python=True)
        if close is None:
            return skip if final else None
        calls = pythonic_calls(text[i:close])
        if calls is None:
            return skip
        end = close
        if tagged:
            k = skip_ws(text, close)
            if text.startswith(self.END, k):
                end = k + len(self.END)
            elif not final and self.END.startswith(text[k:]):
                return None  # `<|python_end|>` may follow
        return Calls(calls, end)


FORMATS: dict[str, type[Format]] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "pythonic": Pythonic,
}
PARSERS = tuple(FORMATS)


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content (stripped; None when empty) and the calls of a whole text."""
    items, _ = FORMATS[parser]().scan(text, final=True)
    content = "".join(i for i in items if isinstance(i, str)).strip()
    return (content or None), [i for i in items if isinstance(i, ToolCall)]


class CallStream:
    """A streamed text read with one format: `feed` each piece, get the content that may be
    shown now and the calls completed by it."""

    def __init__(self, parser: str) -> None:
        self._format = FORMATS[parser]()
        self._buffer = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Content to send now and the calls completed by `text`."""
        self._buffer += text
        items, used = self._format.scan(self._buffer, final)
        self._format.advance(used)
        self._buffer = self._buffer[used:]
        content = "".join(i for i in items if isinstance(i, str))
        return content, [i for i in items if isinstance(i, ToolCall)]
