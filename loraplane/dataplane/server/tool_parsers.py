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
it. One scanner serves the whole text and the stream: the stream is scanned as it grows, content
is released up to where a call may begin, and a call is released once its text is complete and
what follows cannot change it; so a stream fed in any pieces finds what the whole text finds.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def body(self, index: int | None = None) -> dict[str, Any]:
        """The call in OpenAI's shape (with `index` inside a stream delta)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def call_id() -> str:
    """A fresh tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def compact(value: Any) -> str:
    """Arguments as compact JSON text (text that is not JSON is passed on as it is)."""
    if isinstance(value, str):
        text: str = value
        try:
            value = json.loads(text)
        except ValueError:
            return text
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Calls:
    """Calls read at a position of the text, and where their text ends."""

    calls: list[ToolCall]
    end: int


# what `Format.read` finds: calls, the number of characters that are content, or None (the
# text so far does not decide)
Read = Calls | int | None
Item = str | ToolCall
_WS = " \t\r\n"
# what matters to find a closing bracket: outside strings the brackets and quotes, inside a
# string its quote and backslashes
_JSON_SIGNS = re.compile(r'["{}\[\]]')
_PY_SIGNS = re.compile(r"[\"'\[\](){}]")
_IN_STRING = {'"': re.compile(r'[\\"]'), "'": re.compile(r"[\\']")}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Format(ABC):
    """One format's scanner. Calls begin at one of `markers` anywhere, or at `opener` at the
    start of a line (blanks before it allowed); `read` decides what is there. The scanner
    remembers whether the text consumed so far ends at the start of a line."""

    markers: tuple[str, ...] = ()
    opener: str | None = None

    def __init__(self) -> None:
        self.line_start = True  # the output's start is a line's start
        # a stream's text is scanned again as it grows: where the search for a closing
        # bracket stopped, by the bracket's offset in the stream ({offset: (resume, depth)})
        self._base = 0  # the stream offset of the text scanned now
        self._closing: dict[int, tuple[int, int, str]] = {}

    def advance(self, used: int) -> None:
        """The stream's first `used` characters are done with: the next text starts after."""
        self._base += used
        self._closing = {k: v for k, v in self._closing.items() if k >= self._base}

    def new_id(self) -> str:
        """A fresh id for a call of this format."""
        return call_id()

    @abstractmethod
    def read(self, text: str, start: int, final: bool) -> Read:
        """At `start` (a marker or the opener): the calls found there, or how many characters
        are content, or None while the text so far cannot tell (never None when `final`)."""

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        """Content and calls, in order, of `text[:used]`, and `used`: the rest may begin a
        call (all of it is used when `final`)."""
        items: list[Item] = []
        i = 0
        while i < len(text):
            start, hold = self._next(text, i)
            stop = start if start is not None else len(text) - (0 if final else hold)
            if stop > i:
                self._content(items, text[i:stop])
                i = stop
            if start is None:
                break
            found = self.read(text, start, final)
            if found is None:
                break
            if isinstance(found, int):
                self._content(items, text[start : start + found])
                i = start + found
            else:
                items.extend(found.calls)
                i, self.line_start = found.end, False
        return items, i

    def _next(self, text: str, i: int) -> tuple[int | None, int]:
        """Where the next call may begin, else how many characters at the end may begin a
        marker."""
        best: int | None = None
        for marker in self.markers:
            p = text.find(marker, i)
            if p != -1 and (best is None or p < best):
                best = p
        if self.opener is not None:
            limit = len(text) if best is None else best
            p = text.find(self.opener, i, limit)
            while p != -1:
                if self._at_line_start(text, i, p):
                    best = p
                    break
                p = text.find(self.opener, p + 1, limit)
        if best is not None:
            return best, 0
        hold = max((_partial_tail(text, m) for m in self.markers), default=0)
        return None, min(hold, len(text) - i)

    def closing(self, text: str, start: int, python: bool = False) -> int | None:
        """Index just past the bracket that closes the one at `start` (None: not in `text`
        yet); brackets in strings do not count (JSON's, or with `python` Python's, triple
        quotes included). Resumes where the last search in this stream stopped: each
        character of a growing text is looked at once."""
        key = self._base + start
        at, depth, quote = self._closing.get(key, (key, 0, ""))
        i, n = at - self._base, len(text)
        signs = _PY_SIGNS if python else _JSON_SIGNS
        while True:
            found = (_IN_STRING[quote[0]] if quote else signs).search(text, i)
            if found is None:
                i = n
                break
            j, sign = found.start(), found.group()
            if quote and sign == "\\":
                if j + 1 == n:
                    i = j  # what it escapes is not here yet
                    break
                i = j + 2
            elif quote or sign in "\"'":
                if python and n - j < 3 and text[j:] == sign * (n - j):
                    i = j  # one or two quotes at the end may still be three
                    break
                triple = python and text.startswith(sign * 3, j)
                if not quote:
                    quote, i = (sign * 3 if triple else sign), j + (3 if triple else 1)
                elif len(quote) == 1 or triple:
                    quote, i = "", j + len(quote)
                else:
                    i = j + 1  # a lone quote inside a triple-quoted string
            else:
                depth += 1 if sign in "[({" else -1
                if depth == 0:
                    return j + 1
                i = j + 1
        self._closing[key] = (self._base + i, depth, quote)
        return None

    def json_at(self, text: str, i: int, final: bool) -> tuple[Any, int] | int | None:
        """The JSON object or array at `text[i]` and its end; -1: it is not valid JSON; None:
        not complete yet."""
        close = self.closing(text, i)
        if close is None:
            return -1 if final else None
        try:
            return json.loads(text[i:close]), close
        except ValueError:
            return -1

    def _at_line_start(self, text: str, i: int, p: int) -> bool:
        k = p
        while k > i and text[k - 1] in " \t\r":
            k -= 1
        return self.line_start if k == i else text[k - 1] == "\n"

    def _content(self, items: list[Item], text: str) -> None:
        items.append(text)
        body = text.rstrip(" \t\r")
        if body:
            self.line_start = body.endswith("\n")


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
            j = _skip_ws(text, i)
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
            k = _skip_ws(text, end)
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
        i = _skip_ws(text, start + skip)
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
        pos = _skip_ws(text, pos)
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
        i = _skip_ws(text, start + len(self.START)) if tagged else start
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
            k = _skip_ws(text, close)
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
