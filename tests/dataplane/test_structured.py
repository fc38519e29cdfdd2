"""Structured outputs: request parsing, compilation and its cache, matchers, the logits mask.

The oracles: constrained "decoding" from random logits through the real Sampler must end in an
accepted state with text that satisfies the constraint (checked in plain Python), and
apply_bitmask must equal a reference built bit by bit in Python. The tokenizer is the tiny
models' byte-level BPE (the one tiny_llama_dir holds), built here without the model.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from loraplane.dataplane.sampler import Sampler
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.server.structured_fields import (
    from_response_format,
    from_structured_outputs,
)
from loraplane.dataplane.structured import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from loraplane.dataplane.tokenizer import Tokenizer
from loraplane.demo.build import build_tokenizer

PADDED_VOCAB = 400  # the model's logits are wider than the tokenizer's 384 tokens
EOS = 2
PROPERTIES = {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
}
PERSON = {
    "type": "object",
    "properties": PROPERTIES,
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=PADDED_VOCAB)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab) if (words[t // 32] & 0xFFFFFFFF) >> (t % 32) & 1}


def decode(
    compiler: GrammarCompiler,
    tokenizer: Tokenizer,
    constraint: Constraint,
    seed: int,
    closing_bias: float = 0.0,
    max_steps: int = 400,
) -> str:
    """Sample from random logits under the mask until EOS or is_done; return the text.

    `closing_bias` favours tokens holding `"`, `}` or `]`: without it, free-form JSON strings
    from uniform logits run for hundreds of tokens.
    """
    matcher = Matcher(compiler.compile(constraint))
    sampler = Sampler(seed=seed)
    noise = torch.Generator().manual_seed(seed)
    bias = torch.zeros(PADDED_VOCAB)
    if closing_bias:
        for t in range(tokenizer.vocab_size):
            if set(tokenizer.decode([t])) & set('"}]'):
                bias[t] = closing_bias
    bitmask = allocate_bitmask(3, PADDED_VOCAB)
    tokens: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(3, PADDED_VOCAB, generator=noise) + bias  # [3, V]
        fill_bitmasks([(matcher, 1)], bitmask)  # the constrained row sits between free ones
        apply_bitmask(logits, bitmask[1:2], torch.tensor([1]))
        token = sampler(logits, [SamplingParams()] * 3).token_ids[1]
        assert token < tokenizer.vocab_size  # padded ids are never sampled
        assert matcher.accept(token), matcher.error
        if token == EOS:
            assert matcher.is_done
            break
        tokens.append(token)
        if matcher.is_done:
            break
    else:
        pytest.fail(f"no end after {max_steps} tokens: {tokenizer.decode(tokens)!r}")
    assert matcher.is_accepting
    return tokenizer.decode(tokens)


# --- (a)-(c): decoding under each kind of constraint ---


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_decoding_always_satisfies_the_schema(
    compiler: GrammarCompiler, tokenizer: Tokenizer, seed: int
) -> None:
    constraint = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    )
    assert constraint is not None
    value = json.loads(decode(compiler, tokenizer, constraint, seed))
    assert list(value) == ["name", "age", "color"]  # the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["color"] in ("red", "green", "blue")


def test_json_schema_given_as_text_compiles_like_the_object(compiler: GrammarCompiler) -> None:
    as_text = from_structured_outputs({"json": json.dumps(PERSON, indent=2)})
    as_object = from_structured_outputs({"json": PERSON})
    assert as_text is not None and as_object is not None and as_text == as_object
    assert compiler.compile(as_text) is compiler.compile(as_object)


@pytest.mark.parametrize("seed", range(4))
def test_regex_decoding_matches_the_whole_pattern(
    compiler: GrammarCompiler, tokenizer: Tokenizer, seed: int
) -> None:
    pattern = r"[a-z]{3}-[0-9]{2,4}( ok)?"
    constraint = from_structured_outputs({"regex": pattern})
    assert constraint is not None
    assert re.fullmatch(pattern, decode(compiler, tokenizer, constraint, seed))


@pytest.mark.parametrize("seed", range(6))
def test_choice_decoding_gives_exactly_one_of_the_choices(
    compiler: GrammarCompiler, tokenizer: Tokenizer, seed: int
) -> None:
    choices = ["red", "green", "blue sky", 'say "café"']
    constraint = from_structured_outputs({"choice": choices, "regex": None})
    assert constraint is not None
    assert decode(compiler, tokenizer, constraint, seed) in choices


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/',  # Lark
        'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]? [0-9]?',  # GBNF
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_decoding_follows_lark_and_gbnf(
    compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: str
) -> None:
    constraint = from_structured_outputs({"grammar": grammar})
    assert constraint is not None
    for seed in range(3):
        text = decode(compiler, tokenizer, constraint, seed)
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text)


@pytest.mark.parametrize("seed", range(6))
def test_json_object_decoding_gives_a_json_object(
    compiler: GrammarCompiler, tokenizer: Tokenizer, seed: int
) -> None:
    constraint = from_response_format({"type": "json_object"})
    assert constraint == Constraint("json_object")
    text = decode(compiler, tokenizer, constraint, seed, closing_bias=4.0)
    assert isinstance(json.loads(text), dict)


# --- matcher semantics ---


def test_eos_is_allowed_only_once_the_output_is_complete(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = Matcher(compiler.compile(Constraint("choice", '["ab", "abc"]')))
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS not in allowed_ids(bitmask, 0, PADDED_VOCAB) and not matcher.is_accepting
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS in allowed_ids(bitmask, 0, PADDED_VOCAB)  # "ab" may end or go on to "abc"
    assert matcher.is_accepting and not matcher.is_done
    for token in tokenizer.encode("c", add_special_tokens=False):
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, PADDED_VOCAB) == {EOS}
    assert matcher.is_done and matcher.error is None


def test_every_eos_id_of_the_model_ends_a_complete_output(tok_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    compiler = GrammarCompiler(tmp_path)  # from a directory, at the tokenizer's own width
    assert compiler.vocab_size == 384
    matcher = Matcher(compiler.compile(Constraint("regex", "x?")))
    bitmask = allocate_bitmask(1, 384)
    matcher.fill_bitmask(bitmask, 0)
    assert {2, 7} <= allowed_ids(bitmask, 0, 384)


def test_a_token_the_grammar_forbids_is_refused_and_leaves_only_eos(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = Matcher(compiler.compile(Constraint("regex", "[0-9]+")))
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not matcher.accept(letter)
    assert matcher.error is not None and matcher.is_done
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, PADDED_VOCAB) <= {EOS}
    assert not matcher.accept(tokenizer.encode("1", add_special_tokens=False)[0])


def test_padded_and_special_ids_are_never_allowed(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = Matcher(compiler.compile(Constraint("json_object")))
    for token in tokenizer.encode('{"a":"', add_special_tokens=False):
        assert matcher.accept(token)
    bitmask = allocate_bitmask(2, PADDED_VOCAB)  # all ones until filled
    matcher.fill_bitmask(bitmask, 1)
    allowed = allowed_ids(bitmask, 1, 32 * bitmask.shape[1])
    assert len(allowed) > 200  # inside a string most tokens fit
    assert max(allowed) < tokenizer.vocab_size
    assert not allowed & {0, 1, 2}  # <unk>, <s>, </s>
    assert allowed_ids(bitmask, 0, PADDED_VOCAB) == set(range(PADDED_VOCAB))  # row 0 untouched


def test_matchers_of_one_grammar_are_independent(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    grammar = compiler.compile(Constraint("choice", '["yes", "no"]'))
    first, second = Matcher(grammar), Matcher(grammar)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert first.accept(token)
    assert first.is_done and not second.is_accepting
    bitmask = allocate_bitmask(4, PADDED_VOCAB)
    fill_bitmasks([(first, 3), (second, 0)], bitmask)
    assert allowed_ids(bitmask, 3, PADDED_VOCAB) == {EOS}
    alone = allocate_bitmask(1, PADDED_VOCAB)
    Matcher(grammar).fill_bitmask(alone, 0)
    assert torch.equal(bitmask[0], alone[0])  # the batch fill equals the single one
    assert allowed_ids(bitmask, 1, PADDED_VOCAB) == set(range(PADDED_VOCAB))  # unlisted rows


def test_a_bitmask_of_the_wrong_shape_or_type_is_refused(compiler: GrammarCompiler) -> None:
    matcher = Matcher(compiler.compile(Constraint("regex", "a")))
    with pytest.raises(ValueError, match="13 contiguous words"):
        matcher.fill_bitmask(allocate_bitmask(1, 384), 0)  # 12 words: the tokenizer's width
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(allocate_bitmask(1, PADDED_VOCAB).long(), 0)
    with pytest.raises(ValueError, match="row 2"):
        matcher.fill_bitmask(allocate_bitmask(2, PADDED_VOCAB), 2)
    with pytest.raises(ValueError, match="row 5"):
        fill_bitmasks([(matcher, 5)], allocate_bitmask(2, PADDED_VOCAB))


def test_a_vocab_narrower_than_the_tokenizer_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="vocab size too small"):
        GrammarCompiler(tokenizer, vocab_size=100)


# --- (d): requests that cannot be served are GrammarErrors with the reason ---


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (Constraint("json", '{"type": "foo"}'), "Invalid type: foo"),
        (Constraint("json", '{"$ref": "#/defs/x"}'), "/defs/x' does not exist"),
        (Constraint("json", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength"),
        (Constraint("json", '{"type": "string", "pattern": "a(b"}'), "unclosed group"),
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("grammar", "start: foo"), 'unknown name: "foo"'),
        (Constraint("grammar", "root ::= ((("), "GBNF"),
    ],
    ids=["type", "ref", "unsatisfiable", "pattern", "regex", "lark", "gbnf"],
)
def test_a_constraint_that_does_not_compile_is_a_GrammarError_with_the_reason(
    compiler: GrammarCompiler, constraint: Constraint, reason: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)) as caught:
        compiler.compile(constraint)
    assert str(caught.value).startswith(f"invalid {constraint.kind}: ")


@pytest.mark.parametrize(
    ("response_format", "reason"),
    [
        ("json_object", "response_format must be an object"),
        ({}, "response_format.type must be"),
        ({"type": "json"}, "got 'json'"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": 3}}, "json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"strict": "yes"}}, "strict must be a boolean"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "schema must be a JSON Schema"),
    ],
)
def test_a_malformed_response_format_is_a_GrammarError_naming_the_field(
    response_format: object, reason: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)):
        from_response_format(response_format)


@pytest.mark.parametrize(
    ("structured_outputs", "reason"),
    [
        (["regex"], "structured_outputs must be an object"),
        ({"regex": "a", "choice": ["a"]}, "got choice, regex"),
        ({"structural_tag": "x"}, "does not support structural_tag"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON Schema object, got list"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
        ({"regex": 3}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
        ({"json_object": "yes"}, "json_object must be a boolean"),
    ],
)
def test_malformed_structured_outputs_are_a_GrammarError_naming_the_field(
    structured_outputs: object, reason: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)):
        from_structured_outputs(structured_outputs)


def test_requests_without_a_constraint_parse_to_None() -> None:
    assert from_response_format({"type": "text"}) is None
    assert from_structured_outputs({}) is None
    # clients that serialise every field send the unset ones as null or false
    assert from_structured_outputs({"json": None, "disable_fallback": False}) is None
    assert from_structured_outputs({"json_object": True}) == Constraint("json_object")
    no_schema = {"type": "json_schema", "json_schema": {"name": "any"}}
    assert from_response_format(no_schema) == Constraint("json_object")


def test_an_unknown_constraint_kind_is_refused() -> None:
    with pytest.raises(GrammarError, match="constraint kind must be one of"):
        Constraint("xml", "<a/>")  # type: ignore[arg-type]


# --- (e): apply_bitmask against a reference built bit by bit ---


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    for r, row in enumerate(rows):
        words = bitmask[r].tolist()
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words) or not (words[w] & 0xFFFFFFFF) >> (t % 32) & 1:
                expected[row, t] = float("-inf")
    return expected


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor: torch.equal takes -0.0 for 0.0."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("batch", "vocab", "words", "rows"),
    [
        (6, 100, 4, [4, 0, 2]),  # vocab not a multiple of 32
        (5, 96, 3, [1]),  # an exact multiple
        (4, 130, 4, [3, 1]),  # logits wider than the mask: the extra ids are disallowed
        (64, 1000, 32, list(range(0, 64, 8))),  # 8 constrained rows in a batch of 64
        (3, 50, 2, []),  # no constrained row: nothing changes
    ],
)
def test_apply_bitmask_masks_exactly_the_disallowed_ids_of_the_listed_rows(
    device: str, batch: int, vocab: int, words: int, rows: list[int]
) -> None:
    g = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=g)  # [B, V]
    logits[:, :6] = torch.tensor([0.0, -0.0, -0.0, 0.0, -1e30, 1e-40])  # zeros, extremes
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)  # [R, W], random bits, negative words included
    if rows:
        bitmask[0, 0] = 0x5  # tokens 0 and 2 (0.0 and -0.0) allowed, 1 and 3 not
        bitmask[-1, -1] = -1  # a word with everything allowed
    expected = reference(logits, bitmask, rows)
    on_device = logits.to(device)
    apply_bitmask(on_device, bitmask, torch.tensor(rows, dtype=torch.long))
    assert on_device.device.type == device
    assert torch.equal(bits(on_device.cpu()), bits(expected))  # signed zeros, -inf included


def test_apply_bitmask_keeps_the_logits_dtype() -> None:
    logits = torch.randn(3, 70).to(torch.bfloat16)
    logits[1, 0] = -0.0
    bitmask = torch.tensor([[1, -1, 0]], dtype=torch.int32)  # token 0 and 32..63 allowed
    expected = reference(logits, bitmask, [1])
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert logits.dtype == torch.bfloat16
    assert torch.equal(bits(logits), bits(expected))


def test_apply_bitmask_checks_its_arguments() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows must be"):
        apply_bitmask(logits, allocate_bitmask(2, 64), torch.tensor([0]))
    with pytest.raises(ValueError, match="logits must be"):
        apply_bitmask(torch.zeros(64), allocate_bitmask(1, 64), torch.tensor([0]))


# --- (f): the compile cache ---


def test_the_same_spec_gives_the_same_compiled_grammar(compiler: GrammarCompiler) -> None:
    first = from_response_format({"type": "json_schema", "json_schema": {"schema": PERSON}})
    again = from_structured_outputs({"json": json.loads(json.dumps(PERSON))})
    assert first is not None and again is not None
    assert compiler.compile(first) is compiler.compile(again)
    reordered = {**PERSON, "properties": dict(reversed(PROPERTIES.items()))}
    other = from_structured_outputs({"json": reordered})
    assert other is not None and other != first  # property order is part of the spec
    assert compiler.compile(other) is not compiler.compile(first)


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, cache_size=2)
    a, b, c = (Constraint("regex", p) for p in ("a+", "b+", "c+"))
    compiled_a, compiled_b = compiler.compile(a), compiler.compile(b)
    assert compiler.compile(a) is compiled_a  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.compile(a) is compiled_a
    assert compiler.compile(b) is not compiled_b
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompiler(tokenizer, cache_size=0)


def test_concurrent_compiles_of_one_spec_share_one_grammar(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer)
    constraint = Constraint("json", json.dumps(PERSON))
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: compiler.compile(constraint), range(32)))
    assert all(r is results[0] for r in results)
