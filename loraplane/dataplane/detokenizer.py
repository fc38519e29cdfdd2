"""Incremental detokenization with stop strings, for streaming one request's output.

Byte-level BPE tokens are bytes, and a character may span tokens: decoding a prefix that ends
inside a character gives U+FFFD. So text is released only when the decoded tail does not end in
U+FFFD, and only the tokens after the last release point are decoded again (a short window
starting at a character boundary), which keeps each step O(window) rather than O(output).

Stop strings may span tokens too. Text that could be the start of a stop string is held back
until the next token settles it, so a client never sees any part of a stop string; when one
appears the text is cut just before it and the detokenizer reports that it stopped.

`add_output` applies the engine's rules on top (min_tokens, a stop token's hidden text, the
flush at the end): the one place they live, whichever process detokenizes (the engine's on a
thread, the API server's with the engine in a process of its own, engine_process.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraplane.dataplane.sampling import SamplingParams

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
        min_tokens: int = 0,
    ):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop  # a matched stop string (or stop token) stays
        self._min_tokens = min_tokens  # stop strings count from this many output tokens on
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a character boundary
        self._read_offset = 0  # tokens up to here are released as text
        self._text = ""  # text decoded so far (without a pending partial character)
        self._sent = 0  # characters of _text already returned
        self.stopped = False
        self.stop_string: str | None = None

    @classmethod
    def for_request(cls, tokenizer: Decoder, params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request's output: its stop strings, special tokens and
        min_tokens as `params` set them."""
        return cls(
            tokenizer,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

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

    def add_output(
        self, token_id: int, num_output_tokens: int, *, stop_token: bool, finished: bool
    ) -> DetokenizerDelta:
        """The text of the engine's output token `token_id`, its `num_output_tokens`-th.
        `stop_token`: the token is a stop token that ended the output; as vLLM, its text is
        not output (special or not) unless include_stop_str_in_output. `finished`: the engine
        ended the output with this token; what was held back is released. The delta says
        whether a stop string ended the output here (then the engine's sequence must end
        too, with finish_reason "stop", whatever ended it otherwise)."""
        if stop_token and not self._include_stop:
            delta = DetokenizerDelta("")
        else:
            delta = self.add_token(token_id, check_stop=num_output_tokens >= self._min_tokens)
        if finished and not delta.stopped:
            return DetokenizerDelta(delta.text + self.flush().text)
        return delta

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
