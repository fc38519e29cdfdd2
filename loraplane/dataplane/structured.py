"""Structured outputs: compile a request's constraint, then mask the tokens it forbids.

A constraint comes from OpenAI's `response_format` or vLLM's `structured_outputs` (read by
server/structured_fields.py, the API's side) and is one of:
- `json`: a JSON Schema; properties are generated in the schema's order, compact (no free
  whitespace between tokens unless the schema's `x-guidance` sets `whitespace_flexible`: a small
  model could spend its tokens on blanks), `x-guidance` options inside the schema are honoured;
- `json_object`: any JSON object;
- `regex`: the whole output matches the pattern (Rust `regex` syntax);
- `choice`: the output is exactly one of the strings;
- `grammar`: a Lark grammar in llguidance's dialect, or a GBNF grammar.

llguidance compiles it against the model's tokenizer (`GrammarCompiler.compile`, CPU work that
releases the GIL: call it from a worker thread, never on the engine loop; a constraint that
cannot be compiled raises GrammarError with llguidance's reason, for a 400). Each sequence then
owns a `Matcher`: before a step it writes the tokens that may come next into its row of an int32
bitmask, bit j of word w standing for token 32*w + j:

    allowed(row, t) = (bitmask[row, t // 32] >> (t % 32)) & 1

and after the step it accepts the sampled token. `apply_bitmask` sets every forbidden logit of
the constrained rows to -inf; the other logits of the batch keep their values bit for bit. EOS is
allowed only where the grammar is complete; once nothing can follow (`is_done`), only EOS is.
Ids past the tokenizer's vocabulary (the model's padded logits) are never allowed.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import llguidance

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

from loraplane.dataplane.tokenizer import Tokenizer

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(Kind)
_ANY_OBJECT = '{"type": "object"}'
# JSON without free whitespace between tokens unless the schema's x-guidance asks for it: a
# small or fine-tuned model can otherwise spend its max_tokens on blanks (vLLM offers the same
# choice as disable-any-whitespace)
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_EXPONENT_BITS = 0x7F800000  # of a float32: with the sign bit, -inf
_SIGN_BIT = -(2**31)  # of a float32 seen as int32: alone, -0.0


class GrammarError(ValueError):
    """A request's constraint cannot be parsed or compiled; the message is the reason."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What one request's output must match.

    `spec` is text for every kind, so that a Constraint is hashable and is its own cache key:
    json: the schema as compact JSON (key order kept: it is the order of generated properties);
    json_object: ""; regex: the pattern; choice: a JSON array of the strings; grammar: its text.
    """

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise GrammarError(f"constraint spec must be text, got {type(self.spec).__name__}")


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint (not yet checked: LLMatcher does that)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else _ANY_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            # a JSON string literal is a Lark string literal
            choices = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llguidance.grammar_from("grammar", spec)  # Lark as is, GBNF converted to Lark
    except ValueError as exc:
        raise GrammarError(f"invalid {kind}: {exc}") from None


class CompiledGrammar:
    """A constraint compiled for one tokenizer; shared by every request with that constraint."""

    __slots__ = ("_template", "constraint", "vocab_size")

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher, vocab_size: int):
        self.constraint = constraint
        self.vocab_size = vocab_size  # bits per bitmask row: the logits' width
        self._template = template  # never advanced: each Matcher starts from a copy


class GrammarCompiler:
    """Compiles constraints against one tokenizer, with a bounded, thread-safe LRU cache.

    `source` is the base model's Tokenizer or its directory. `vocab_size` is the width of the
    model's logits (default: the tokenizer's vocabulary); ids past the tokenizer's are padding
    and never allowed. Evicting a grammar does not affect the Matchers made from it.
    """

    def __init__(
        self,
        source: Tokenizer | Path | str,
        vocab_size: int | None = None,
        cache_size: int = 256,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        tokenizer = source if isinstance(source, Tokenizer) else Tokenizer.from_dir(source)
        # Tokenizer has no public serialisation yet; padding and truncation would change how
        # llguidance's copy tokenizes, so they are dropped from that copy
        spec = json.loads(tokenizer.to_json())
        spec["padding"] = spec["truncation"] = None
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            json.dumps(spec),
            n_vocab=self.vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids) or None,
        )
        self._cache_size = cache_size
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint`, from the cache or compiled now (GrammarError
        when it cannot be). Blocks for up to about a second on a very complex grammar."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        # compiled outside the lock: one slow grammar must not hold up the others
        template = llguidance.LLMatcher(self._tokenizer, _grammar(constraint), log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {template.get_error()}")
        compiled = CompiledGrammar(constraint, template, self.vocab_size)
        with self._lock:
            # a racing thread may have compiled it too: everyone gets the first one cached
            compiled = self._cache.setdefault(constraint, compiled)
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    import torch  # here: the API server's process compiles grammars without torch

    width = (vocab_size + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    if bitmask.shape[1] != width or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask rows must be {width} contiguous words, got {bitmask.shape[1]}")


class Matcher:
    """The state of one sequence's output in its grammar: which tokens may come next."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._matcher = grammar._template.deep_copy()
        self.vocab_size = grammar.vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` [B, ceil(V/32)] int32, CPU.
        (`fill_bitmasks` does a batch's matchers in one call, in parallel.)"""
        _check_bitmask(bitmask, self.vocab_size)
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False when the grammar did not allow it (the matcher
        then stays in error, allowing only EOS)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return self._matcher.is_accepting()

    @property
    def is_done(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, EOS was accepted, or error)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher is in error (a token it did not allow), or None."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "the matcher is in error"


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmasks(rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """For each (matcher, row), `matcher.fill_bitmask(bitmask, row)`, in parallel on
    llguidance's threads without the GIL. Rows must be distinct."""
    if not rows:
        return
    vocab_size = rows[0][0].vocab_size
    _check_bitmask(bitmask, vocab_size)
    if not bitmask.is_contiguous():
        raise ValueError("bitmask must be contiguous")
    batch = bitmask.shape[0]
    pairs: list[tuple[llguidance.LLMatcher, int]] = []
    for matcher, row in rows:
        if matcher.vocab_size != vocab_size or not 0 <= row < batch:
            raise ValueError(f"matcher for row {row} does not fit a bitmask {bitmask.shape}")
        pairs.append((matcher._matcher, row))
    _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, batch)


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A CPU bitmask [rows, ceil(vocab_size/32)] int32 with every token allowed; `pin` puts it
    in pinned memory (the sampler's, on CUDA), so `apply_bitmask` copies it without a sync."""
    import torch

    shape = (rows, (vocab_size + 31) // 32)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)


def apply_bitmask(
    logits: torch.Tensor,  # [B, V] float
    bitmask: torch.Tensor,  # [R, W] int32, on any device
    rows: torch.Tensor,  # [R] long: the logits row of each bitmask row, distinct
) -> None:
    """In place, for finite logits:

        for r, row in enumerate(rows):
            for t in range(V):
                if t >= 32 * W or not allowed(r, t): logits[row, t] = -inf

    Allowed logits and the rows not in `rows` keep their values bit for bit. One copy of the
    bitmask to the logits' device (non-blocking from a pinned bitmask), no loop over rows;
    the masking itself runs on that device.
    """
    import torch

    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be [B, V] float, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [R, W] int32, got {bitmask.dtype} {bitmask.shape}")
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows must be [R] with R={bitmask.shape[0]}, got {tuple(rows.shape)}")
    if rows.numel() == 0:
        return
    device, vocab = logits.device, logits.shape[1]
    mask = bitmask.to(device, non_blocking=True)  # [R, W]
    index = rows.to(device=device, dtype=torch.long, non_blocking=True)  # [R]
    # bit j moved to the sign and spread over the word: -1 where allowed, 0 where not
    shifts = 31 - torch.arange(32, device=device, dtype=torch.int32)  # [32]
    keep = (mask.unsqueeze(-1) << shifts).bitwise_right_shift_(31).flatten(1)  # [R, 32W]
    # added, not filled (masked_fill is several times slower on CPU): -0.0 where allowed,
    # since x + -0.0 == x for every x, signed zeros included; -inf where not
    bias = keep.bitwise_not_().bitwise_and_(_EXPONENT_BITS).bitwise_or_(_SIGN_BIT)
    bias_f = bias.view(torch.float32).to(logits.dtype)  # [R, 32W]
    if bias_f.shape[1] >= vocab:
        bias_f = bias_f[:, :vocab]
    else:  # logits wider than the mask: the extra ids are not in the grammar's vocabulary
        bias_f = torch.nn.functional.pad(bias_f, (0, vocab - bias_f.shape[1]), value=-math.inf)
    if device.type == "cpu":
        logits.index_add_(0, index, bias_f)
    else:  # CUDA's index_add_ adds atomically, which flushes subnormal logits to zero
        logits.index_copy_(0, index, logits.index_select(0, index).add_(bias_f))
