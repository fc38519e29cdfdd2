"""What a step puts out per request: `RequestOutput`s, formed from the scheduler's sequences.

The `Emitter` keeps each request's output state between steps (its incremental detokenizer,
how many log-probabilities it was sent) and forms, per row a step sampled, the new token, its
text delta (when the engine detokenizes), the log-probabilities not sent yet and the finish
reason; a stop string or a completed grammar ends the request here. A request whose output
cannot be formed fails alone, as does one the engine fails (`fail`): its last output carries
the error. Prompt log-probabilities a step scored are kept on their sequence
(`record_prompt_logprobs`) and sent with the request's first output token.
"""

from __future__ import annotations

import logging

from loraplane.dataplane.detokenizer import IncrementalDetokenizer
from loraplane.dataplane.outputs import RequestOutput, failure_message
from loraplane.dataplane.prompt_logprobs import PromptScores
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.scheduler import ScheduledSeq, Scheduler
from loraplane.dataplane.sequence import FinishReason, Sequence
from loraplane.dataplane.structured import Matcher
from loraplane.dataplane.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def record_prompt_logprobs(seq: Sequence, scores: PromptScores) -> None:
    """Keep the step's scores of prompt tokens scores.first.. (those not kept yet: a
    recomputed prompt is not counted twice)."""
    have = len(seq.prompt_logprobs) + 1  # token 0 has none
    skip = have - scores.first
    if skip < 0 or skip >= len(scores) or seq.params.prompt_logprobs is None:
        return
    seq.prompt_logprobs.extend(scores.entries(skip))


class Emitter:
    """Each live request's output state, and the outputs of its steps (module docstring).

    `detokenize` False: token ids only, no text and no stop strings (the engine process's
    mode: its API server's process makes the text)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, detokenize: bool) -> None:
        self.scheduler = scheduler  # finishes a request a stop string or grammar ends
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # request id -> its text
        self._sent_logprobs: dict[str, int] = {}  # request id -> log-probabilities sent

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Start the output state of a new request."""
        if self.detokenize:
            self.detokenizers[request_id] = IncrementalDetokenizer.for_request(
                self.tokenizer, params
            )
        self._sent_logprobs[request_id] = 0

    def forget(self, request_id: str) -> None:
        """Drop a request's output state (it was aborted or failed)."""
        self.detokenizers.pop(request_id, None)
        self._sent_logprobs.pop(request_id, None)

    def outputs(self, live: list[Sequence]) -> list[RequestOutput]:
        """The step's output of each sequence that got a token this step (a request whose
        output cannot be formed, e.g. its text does not decode or its token left its grammar,
        fails alone)."""
        outputs = []
        for seq in live:
            try:
                if seq.matcher is not None:
                    self._advance_grammar(seq, seq.matcher)
                outputs.append(self.emit(seq))
            except Exception as error:
                log.warning("the output of request %s failed: %r", seq.request_id, error)
                outputs.append(self.fail(seq, failure_message(error)))
        return outputs

    def _advance_grammar(self, seq: Sequence, matcher: Matcher) -> None:
        """Feed the sampled token to the request's grammar; the output ends once the grammar
        is complete (only EOS could follow). Raises if the token left the grammar."""
        if not matcher.accept(seq.token_ids[-1]):
            raise ValueError(f"the output left its grammar: {matcher.error}")
        if matcher.is_done and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)

    def emit(self, seq: Sequence) -> RequestOutput:
        """The step's output of one row (called for every row of every step: its host work
        is kept to what the request asked for)."""
        token = seq.token_ids[-1]
        params = seq.params
        # EOS among the stop token ids, unless ignore_eos (Engine.add_request); as vLLM, a
        # stop token's text is not output (its id and logprob still are)
        stop_token = seq.finish_reason is FinishReason.STOP and token in params.stop_token_ids
        text = ""
        if self.detokenize:
            delta = self.detokenizers[seq.request_id].add_output(
                token, seq.num_output_tokens, stop_token=stop_token, finished=seq.is_finished
            )
            text = delta.text
            if delta.stopped and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP)
            elif delta.stopped:
                seq.finish_reason = FinishReason.STOP
            if seq.is_finished:
                del self.detokenizers[seq.request_id]
        finished = seq.is_finished
        num_output = seq.num_output_tokens
        logprobs = top = prompt = None
        if params.wants_logprobs or params.top_logprobs:  # what was not sent yet
            rid = seq.request_id
            sent = self._sent_logprobs.get(rid, 0)
            if params.wants_logprobs:
                logprobs = seq.output_logprobs[sent:]
            if params.top_logprobs:
                top = seq.output_top_logprobs[sent:]
            if finished:
                self._sent_logprobs.pop(rid, None)
            else:
                self._sent_logprobs[rid] = len(seq.output_logprobs)
        if params.prompt_logprobs is not None and num_output == 1:
            prompt = list(seq.prompt_logprobs)
        reason = seq.finish_reason
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[token],
            text=text,
            finished=finished,
            finish_reason=reason.value if reason else None,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=num_output,
            top_logprobs=top,
            prompt_logprobs=prompt,
            num_cached_tokens=min(seq.num_cached_tokens, seq.num_prompt_tokens),
            stop_token=stop_token,
        )

    def fail(self, seq: Sequence, error: str, code: str | None = None) -> RequestOutput:
        """Finish a request as failed with `error` (its blocks freed); its last output."""
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.forget(seq.request_id)
        return RequestOutput.failed(
            seq.request_id, error, seq.num_prompt_tokens, seq.num_output_tokens, code
        )

    def fail_rows(self, rows: list[ScheduledSeq], error: Exception) -> list[RequestOutput]:
        """Finish the rows' requests with an error (their blocks freed)."""
        message = failure_message(error)
        return [self.fail(row.seq, message) for row in rows if not row.seq.is_finished]
