"""The text of an engine's id-only outputs, made in the API server's process.

With the engine in a process of its own (engine_process.py) the engine only runs the model: its
outputs carry token ids, log-probabilities and finish reasons, no text, and it never sees a
stop string. `OutputText` holds one detokenizer per request in flight, turns each output into
the output the engine on a thread would have made (`IncrementalDetokenizer.add_output`: the
same rules, so the same text byte for byte) and, when a stop string ends a request's text,
ends its output there (finish_reason "stop", at the token that completed the stop string, so
the token counts match) and says that the engine's sequence must be aborted: it ran on
without knowing, and its KV blocks and seat are still held.

    texts.start(request_id, params)          # before the request goes to the engine
    shown, abort = texts.render(output)      # per output, as each step's message comes
    texts.forget(request_id)                 # the stream ended (a client went away)

Outputs that come after a request's text ended (its sequence stepped on until the abort
arrived) render to None: nobody sees them.
"""

from __future__ import annotations

import dataclasses
import logging

from loraplane.dataplane.detokenizer import Decoder, IncrementalDetokenizer
from loraplane.dataplane.outputs import RequestOutput, failure_message
from loraplane.dataplane.sampling import SamplingParams

log = logging.getLogger(__name__)


class OutputText:
    """Detokenizers of the requests in flight, by request id (started on the event loop,
    rendered on the pipe's reader thread: single dict operations, atomic under the GIL)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def start(self, request_id: str, params: SamplingParams | None) -> None:
        """A request is about to go to the engine: its text starts empty."""
        detok = IncrementalDetokenizer.for_request(self._tokenizer, params or SamplingParams())
        self._detoks[request_id] = detok

    def forget(self, request_id: str) -> None:
        """The request's stream ended: later outputs of it are dropped."""
        self._detoks.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._detoks)

    def render(self, out: RequestOutput) -> tuple[RequestOutput | None, bool]:
        """`out` with its text, or None when nobody waits for it; and whether the engine's
        sequence must be aborted (a stop string ended the text before the engine ended it,
        or the text could not be formed)."""
        detok = self._detoks.get(out.request_id)
        if detok is None:  # an output after the text ended, or of a request not started here
            return None, False
        if out.finished:
            self.forget(out.request_id)
        if not out.token_ids:  # a failed request: no token, no text
            return out, False
        try:
            delta = detok.add_output(
                out.token_ids[-1], out.num_output_tokens, stop_token=out.stop_token,
                finished=out.finished,
            )  # fmt: skip
        except Exception as error:  # this request's text fails alone, as in the engine
            log.warning("the output of request %s failed: %r", out.request_id, error)
            self.forget(out.request_id)
            failed = RequestOutput.failed(out.request_id, failure_message(error),
                                          out.num_prompt_tokens, out.num_output_tokens)  # fmt: skip
            return failed, not out.finished
        if not delta.stopped:
            return dataclasses.replace(out, text=delta.text), False
        self.forget(out.request_id)
        stopped = dataclasses.replace(out, text=delta.text, finished=True, finish_reason="stop")
        return stopped, not out.finished
