"""IncrementalDetokenizer with the demo's byte-level BPE: streaming, UTF-8, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from loraplane.dataplane.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from loraplane.demo.build import build_tokenizer

TEXTS = [
    "Grüße aus Zürich! 東京 and naïve café: unicode must survive detokenisation.",
    "The quick brown fox jumps over the lazy dog.",
    "東京東京 ü é 🎉 emoji outside the corpus",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(Path(out))
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def stream(tok: Any, ids: list[int], stop: list[str] | None = None) -> list[DetokenizerDelta]:
    detok = IncrementalDetokenizer(tok, stop or [])
    deltas = []
    for token in ids:
        deltas.append(detok.add_token(token))
        if deltas[-1].stopped:
            return deltas
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_concatenates_to_the_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert "".join(d.text for d in stream(tokenizer, ids)) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_multi_byte_characters_are_never_split(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text).ids
    # the tokenizer really splits some characters across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids) or text.isascii()
    for delta in stream(tokenizer, ids):
        assert "\ufffd" not in delta.text
        delta.text.encode("utf-8")  # whole characters only


def test_a_trailing_partial_character_is_released_by_flush(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 東").ids
    partial = ids[:-1] if "\ufffd" in tokenizer.decode(ids[:-1]) else ids
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add_token(t).text for t in partial)
    assert "\ufffd" not in text
    assert text + detok.flush().text == tokenizer.decode(partial)


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    eos = tokenizer.token_to_id("</s>")
    ids = [*tokenizer.encode("hello").ids, eos]
    assert "".join(d.text for d in stream(tokenizer, ids)) == "hello"


def test_a_stop_string_across_token_boundaries_cuts_the_text_before_it(tokenizer: Any) -> None:
    text = "Grüße aus Zürich! 東京 and naïve café"
    ids = tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, stop=["Zürich! 東"])
    assert deltas[-1].stopped and deltas[-1].stop_string == "Zürich! 東"
    assert "".join(d.text for d in deltas) == "Grüße aus "


def test_no_part_of_a_stop_string_is_ever_streamed(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, ["fox jumps", "lazy cat"])
    sent = ""
    for token in ids:
        delta = detok.add_token(token)
        sent += delta.text
        if delta.stopped:
            break
        assert not sent.endswith(("f", "fo", "fox"))  # a possible stop start is held back
    assert sent == "The quick brown " == detok.output_text
    assert detok.stopped and detok.add_token(ids[0]) == DetokenizerDelta("", True, "fox jumps")


def test_held_back_text_that_turns_out_not_to_stop_is_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("lazy dog").ids
    deltas = stream(tokenizer, ids, stop=["lazy cat"])
    assert not any(d.stopped for d in deltas)
    assert "".join(d.text for d in deltas) == "lazy dog"


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("a b c d").ids
    deltas = stream(tokenizer, ids, stop=["c d", "b"])
    assert "".join(d.text for d in deltas) == "a "
    assert deltas[-1].stop_string == "b"


def test_empty_stop_strings_are_rejected(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [""])


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab üéß東京🎉\n")), max_size=30))
def test_any_text_streams_back_exactly(tokenizer: Any, text: str) -> None:
    tok = tokenizer
    ids = tok.encode(text).ids
    assert "".join(d.text for d in stream(tok, ids)) == text


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab üé東")), max_size=25),
    stop=st.text(alphabet=st.sampled_from(list("ab üé東")), min_size=1, max_size=3),
)
def test_streaming_with_a_stop_string_equals_cutting_the_full_text(
    tokenizer: Any, text: str, stop: str
) -> None:
    tok = tokenizer
    ids = tok.encode(text).ids
    deltas = stream(tok, ids, stop=[stop])
    expected = text.split(stop, 1)[0]
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].stopped == (stop in text)
