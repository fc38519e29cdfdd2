"""Incremental detokenization with stop strings, for streaming one request's output.

Byte-level BPE tokens are bytes, and a character may span tokens: decoding a prefix that ends
inside a character gives U+FFFD. So text is released only when the decoded tail does not end in
U+FFFD, and only the tokens after the last release point are decoded again (a short window
starting at a character boundary), which keeps each step O(window) rather than O(output).

Stop strings may span tokens too. Text that could be the start of a stop string is held back
until the next token settles it, so a client never sees any part of a stop string; when one
appears the text is cut just before it and the detokenizer reports that it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (a `tokenizers.Tokenizer` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of a list of token ids."""
        ...


@dataclass(frozen=True, slots=True)
class DetokenizerDelta:
    """Text to send after a token, and whether a stop string ended the output there."""

    text: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one request's output tokens, given one at a time, into text deltas."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop  # a matched stop string stays in the text
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a character boundary
        self._read_offset = 0  # tokens up to here are released as text
        self._text = ""  # text decoded so far (without a pending partial character)
        self._sent = 0  # characters of _text already returned
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All text released so far, or (once stopped) the final text."""
        return self._text[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int, check_stop: bool = True) -> DetokenizerDelta:
        """Take the next output token; return the text it completes (maybe empty). With
        `check_stop` False (min_tokens not reached yet) new text is not searched for stop
        strings: a stop string that appears then does not stop the output."""
        if self.stopped:
            return DetokenizerDelta("", True, self.stop_string)
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return DetokenizerDelta("")  # a partial character (or nothing new) so far
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(full[len(prefix) :], final=False, check_stop=check_stop)

    def flush(self) -> DetokenizerDelta:
        """At the end of the output: release what was held back (a trailing partial character
        decodes as U+FFFD, as a full decode would give it)."""
        if self.stopped:
            return DetokenizerDelta("", True, self.stop_string)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(full[len(prefix) :], final=True)

    def _release(self, new_text: str, final: bool, check_stop: bool = True) -> DetokenizerDelta:
        """Append decoded text; cut at a stop string; return what may be sent now."""
        start = max(self._sent, len(self._text) - self._max_stop + 1)
        self._text += new_text
        if self._stop and check_stop:
            hits = [(i, s) for s in self._stop if (i := self._text.find(s, start)) != -1]
            if hits:
                cut, stop = min(hits)
                self._text = self._text[: cut + (len(stop) if self._include_stop else 0)]
                self.stopped, self.stop_string = True, stop
                return self._send(len(self._text), stop)
        if final or not check_stop:
            end = len(self._text)
        else:
            end = len(self._text) - self._pending_stop_prefix()
        return self._send(end, None)

    def _send(self, end: int, stop: str | None) -> DetokenizerDelta:
        text = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return DetokenizerDelta(text, stop is not None, stop)

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text) - self._sent), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
