"""OutputText (the API server's process makes the text of an engine process's id-only outputs):
an engine that does not detokenize plus OutputText, its stop strings ended by an abort, gives
exactly the outputs of an engine that detokenizes (text, finish reasons, log-probabilities,
token counts), for stop strings, include_stop_str_in_output, min_tokens, stop tokens and
multi-byte UTF-8 split across tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from loraplane.dataplane.engine import Engine, RequestOutput
from loraplane.dataplane.output_text import OutputText
from loraplane.dataplane.sampling import SamplingParams

PROMPT = "the quick brown fox"
MULTI_BYTE = "東京 Grüße naïve café 🎉"  # the tokenizer splits some of these characters
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make(model: Path, detokenize: bool) -> Engine:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", num_kv_blocks=256,
                          block_size=4)  # fmt: skip
    return Engine(config, detokenize=detokenize)


def run_detokenizing(engine: Engine, requests: dict[str, SamplingParams]) -> list[RequestOutput]:
    """Every output, as an engine that detokenizes makes them (the thread mode)."""
    assert engine.detokenize
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    return outputs


def run_split(engine: Engine, requests: dict[str, SamplingParams]) -> list[RequestOutput]:
    """Every output, as the engine process's ids become text in the server's process: each
    request a stop string ended is aborted before the next step."""
    assert not engine.detokenize
    texts = OutputText(engine.tokenizer)
    for request_id, params in requests.items():
        texts.start(request_id, params)
        engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished:
        for raw in engine.step():
            assert raw.text == ""  # ids only from the engine
            shown, abort = texts.render(raw)
            if abort:
                assert engine.abort(raw.request_id)
            if shown is not None:
                outputs.append(shown)
    assert len(texts) == 0  # every request's detokenizer let go
    return outputs


@dataclasses.dataclass
class Reference:
    greedy: RequestOutput  # the whole greedy output (no stop), joined
    sampled: RequestOutput  # the whole sampled output, rich in multi-byte characters, joined
    bias: dict[int, float]  # what pushes the sampling towards multi-byte characters


def sampled(bias: dict[int, float], **overrides: object) -> SamplingParams:
    """Seeded sampling pushed towards the tokens of multi-byte characters."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True,
                            logit_bias=bias)  # fmt: skip
    return dataclasses.replace(params, **overrides)  # type: ignore[arg-type]


def joined(outputs: list[RequestOutput], request_id: str) -> RequestOutput:
    """One request's outputs as one (token ids and text joined, the last one's finish)."""
    mine = [o for o in outputs if o.request_id == request_id]
    ids = [t for o in mine for t in o.token_ids]
    return dataclasses.replace(mine[-1], token_ids=ids, text="".join(o.text for o in mine))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Reference:
    engine = make(tiny_llama_dir, True)
    ids = engine.tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    assert any("\ufffd" in engine.tokenizer.decode([i]) for i in ids)  # split characters
    bias = dict.fromkeys(ids, 4.0)
    outputs = run_detokenizing(engine, {"g": GREEDY, "s": sampled(bias)})
    return Reference(joined(outputs, "g"), joined(outputs, "s"), bias)


def multi_byte_stop(text: str) -> str:
    """Two characters of `text`, after its start, one of them a whole multi-byte character."""
    for i in range(3, len(text) - 1):
        pair = text[i : i + 2]
        if "\ufffd" not in pair and not pair.isascii():
            return pair
    raise AssertionError(f"no multi-byte character in {text!r}")


def completed_at(engine: Engine, tokens: list[int], stop: str) -> int:
    """How many of `tokens` a detokenizer takes to find `stop`."""
    detok = IncrementalDetokenizer(engine.tokenizer, [stop])
    return next(k for k, token in enumerate(tokens, 1) if detok.add_token(token).stopped)


def test_the_server_side_text_is_the_engine_side_text_output_for_output(
    tiny_llama_dir: Path, reference: Reference
) -> None:
    detokenizing, split = make(tiny_llama_dir, True), make(tiny_llama_dir, False)
    greedy, bias = reference.greedy, reference.bias
    stop = greedy.text[5:8]
    multi = multi_byte_stop(reference.sampled.text)
    requests = {
        "whole-multi-byte": sampled(bias),  # a trailing partial character flushed at the end
        "stop-multi-byte": sampled(bias, stop=[multi]),
        "stop-multi-byte-kept": sampled(bias, stop=[multi], include_stop_str_in_output=True),
        "stop-logprobs": dataclasses.replace(GREEDY, stop=[stop], logprobs=True, top_logprobs=2),
        "stop-prompt-logprobs": dataclasses.replace(GREEDY, stop=[stop], prompt_logprobs=1),
        "stop-after-min-tokens": dataclasses.replace(GREEDY, stop=[stop], min_tokens=12),
        # the stop string completes with the last token max_tokens allows: "stop", not "length"
        "stop-at-length": dataclasses.replace(
            GREEDY, stop=[stop], max_tokens=completed_at(detokenizing, greedy.token_ids, stop)
        ),
        "stop-token": dataclasses.replace(GREEDY, stop_token_ids=[greedy.token_ids[6]]),
        "stop-token-kept": dataclasses.replace(
            GREEDY, stop_token_ids=[greedy.token_ids[6]], include_stop_str_in_output=True
        ),
    }
    expected = run_detokenizing(detokenizing, requests)
    got = run_split(split, requests)
    assert got == expected  # every field of every output, in order
    ends = {request_id: joined(got, request_id) for request_id in requests}
    whole = reference.sampled.text
    assert ends["stop-multi-byte"].text == whole[: whole.index(multi)]
    assert ends["stop-multi-byte-kept"].text.endswith(multi)
    for request_id in ("stop-multi-byte", "stop-logprobs", "stop-at-length", "stop-token"):
        assert ends[request_id].finish_reason == "stop", request_id
        assert len(ends[request_id].token_ids) < 40  # the stop came before the length limit
    assert ends["stop-logprobs"].num_output_tokens == len(ends["stop-logprobs"].token_ids)
    assert detokenizing.block_manager.num_free_blocks == split.block_manager.num_free_blocks


def test_outputs_after_a_stop_string_are_dropped_and_the_abort_frees_the_sequence(
    tiny_llama_dir: Path, reference: Reference
) -> None:
    """The engine process steps on until the abort arrives: what it makes meanwhile is not
    shown, and the abort frees the sequence's blocks."""
    engine = make(tiny_llama_dir, False)
    free = engine.block_manager.num_free_blocks
    stop = reference.greedy.text[5:8]
    params = dataclasses.replace(GREEDY, stop=[stop])
    texts = OutputText(engine.tokenizer)
    texts.start("r", params)
    engine.add_request("r", PROMPT, params)
    shown: list[RequestOutput] = []
    abort = False
    while not abort:
        (raw,) = engine.step()
        out, abort = texts.render(raw)
        assert out is not None
        shown.append(out)
    assert shown[-1].finished and shown[-1].finish_reason == "stop"
    for _ in range(2):  # the engine's sequence ran on: nobody sees its tokens
        (raw,) = engine.step()
        assert not raw.finished and texts.render(raw) == (None, False)
    assert engine.has_unfinished and engine.block_manager.num_free_blocks < free
    assert engine.abort("r")
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks == free
    text = "".join(o.text for o in shown)
    assert text == reference.greedy.text[: reference.greedy.text.index(stop)]
    assert shown[-1].num_output_tokens == len(shown)  # counted up to the stop, as the engine's


def test_a_text_that_cannot_be_formed_fails_its_request_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(tiny_llama_dir, False)
    texts = OutputText(engine.tokenizer)
    for request_id in ("bad", "good"):
        texts.start(request_id, GREEDY)
        engine.add_request(request_id, PROMPT, GREEDY)

    def undecodable(token: int, check_stop: bool = True) -> DetokenizerDelta:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    monkeypatch.setattr(texts._detoks["bad"], "add_token", undecodable)
    rendered = [texts.render(raw) for raw in engine.step()]
    (bad, abort), (good, _) = sorted(rendered, key=lambda r: r[0].request_id if r[0] else "")
    assert abort and bad is not None and bad.finish_reason == "error" and bad.finished
    assert bad.error is not None and "UnicodeDecodeError" in bad.error
    assert good is not None and not good.finished and good.error is None
    later = {raw.request_id: texts.render(raw) for raw in engine.step()}  # before the abort
    assert later["bad"] == (None, False) and later["good"][0] is not None
    assert engine.abort("bad")
