"""What every tool-call format shares: the calls (`ToolCall`) and the scanner (`Format`).

A format names where a call may begin (markers anywhere, an opener at a line's start) and reads
what is there (`Format.read`); the scanner does the rest, the same for a whole text and for a
stream scanned again as it grows: content is released up to where a call may begin, a call
once its text is complete and what follows cannot change it, so a stream fed in any pieces
finds what the whole text finds. The formats are in tool_parsers.py.
"""

from __future__ import annotations

import json
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


def skip_ws(text: str, i: int) -> int:
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
