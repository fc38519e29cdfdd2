"""Sequence, LoRARef and finish reasons: token bookkeeping, prefill state, stop checks."""

from __future__ import annotations

import pytest

from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import (
    BASE_SALT,
    FinishReason,
    LoRARef,
    Sequence,
    SequenceStatus,
    blocks_for,
)


def test_lora_key_names_tenant_adapter_and_version() -> None:
    ref = LoRARef(name="sql", tenant="acme", digest="ab12")
    assert ref.key == "acme/sql@ab12"
    assert LoRARef("sql", "acme", "cd34").key != ref.key


def test_lora_salt_depends_on_tenant_and_digest_and_differs_from_base() -> None:
    ref = LoRARef("sql", "acme", "ab12")
    assert ref.salt != LoRARef("sql", "other", "ab12").salt
    assert ref.salt != LoRARef("sql", "acme", "ffff").salt
    assert ref.salt != BASE_SALT
    # same weights under another name of the same tenant: same K/V, so the same salt
    assert ref.salt == LoRARef("sql-alias", "acme", "ab12").salt


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "", "tenant": "t", "digest": "d"}, "name"),
        ({"name": "n", "tenant": "", "digest": "d"}, "tenant"),
        ({"name": "n", "tenant": "t", "digest": ""}, "digest"),
        ({"name": "n", "tenant": "a/b", "digest": "d"}, "tenant"),
        ({"name": "n", "tenant": "t", "digest": "d@e"}, "digest"),
    ],
)
def test_lora_ref_rejects_bad_fields(kwargs: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoRARef(**kwargs)


def test_lora_ref_is_frozen_and_hashable() -> None:
    ref = LoRARef("n", "t", "d")
    assert {ref: 1}[LoRARef("n", "t", "d")] == 1
    with pytest.raises(AttributeError):
        ref.name = "x"  # type: ignore[misc]


def test_new_sequence_counts_tokens_and_starts_waiting() -> None:
    seq = Sequence("r1", [1, 2, 3])
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.last_token_id == 3
    assert seq.is_prefill
    assert seq.lora_key is None and seq.cache_salt == BASE_SALT
    seq.append_token(9, logprob=-0.5)
    assert seq.output_token_ids == [9]
    assert seq.output_logprobs == [-0.5]
    assert seq.token_ids == [1, 2, 3, 9]
    assert seq.prompt_token_ids == [1, 2, 3]


def test_prompt_list_is_copied() -> None:
    prompt = [1, 2]
    seq = Sequence("r", prompt)
    prompt.append(3)
    assert seq.num_prompt_tokens == 2


def test_tenant_defaults_to_the_adapters_tenant() -> None:
    assert Sequence("r", [1], lora=LoRARef("n", "acme", "d")).tenant == "acme"
    assert Sequence("r", [1]).tenant == ""
    assert Sequence("r", [1], tenant="bob").tenant == "bob"


def test_is_prefill_until_all_but_the_newest_token_are_computed() -> None:
    seq = Sequence("r", [1, 2, 3, 4])
    seq.num_computed_tokens = 2  # a chunk done
    assert seq.is_prefill and seq.num_uncomputed_tokens == 2
    seq.num_computed_tokens = 4
    seq.append_token(7)
    assert not seq.is_prefill and seq.num_uncomputed_tokens == 1  # decoding
    seq.append_token(8)
    seq.num_computed_tokens = 0  # preempted: everything so far is recomputed as a prompt
    assert seq.is_prefill and seq.num_uncomputed_tokens == 6


def test_blocks_needed_round_up() -> None:
    assert blocks_for(0, 4) == 0
    assert blocks_for(4, 4) == 1
    assert blocks_for(5, 4) == 2
    assert Sequence("r", list(range(9))).num_blocks_needed(4) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "r", "prompt_token_ids": []}, "prompt_token_ids"),
        ({"request_id": "r", "prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"request_id": "r", "prompt_token_ids": [1], "params": {}}, "params"),
        ({"request_id": "r", "prompt_token_ids": [1], "lora": "x"}, "lora"),
    ],
)
def test_sequence_rejects_bad_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Sequence(**kwargs)  # type: ignore[arg-type]


def test_finish_reasons_map_to_finished_statuses() -> None:
    assert FinishReason.STOP.status is SequenceStatus.FINISHED_STOPPED
    assert FinishReason.LENGTH.status is SequenceStatus.FINISHED_LENGTH
    assert FinishReason.ABORT.status is SequenceStatus.FINISHED_ABORTED
    assert all(r.status.is_finished for r in FinishReason)
    assert not SequenceStatus.RUNNING.is_finished
    assert FinishReason.LENGTH.value == "length" and f"{FinishReason.ABORT}" == "abort"


def _after(token: int, **params: object) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(**params))  # type: ignore[arg-type]
    seq.append_token(token)
    return seq


def test_eos_stops_unless_ignore_eos() -> None:
    assert _after(2).stop_reason(2, eos_token_id=2, max_len=None) is FinishReason.STOP
    assert _after(2, ignore_eos=True).stop_reason(2, 2, None) is None
    assert _after(2).stop_reason(2, eos_token_id=None, max_len=None) is None


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    seq = _after(11, stop_token_ids=[11], ignore_eos=True)
    assert seq.stop_reason(11, 2, None) is FinishReason.STOP


def test_max_tokens_and_max_len_cut_with_length() -> None:
    assert _after(5, max_tokens=1).stop_reason(5, 2, None) is FinishReason.LENGTH
    assert _after(5, max_tokens=9).stop_reason(5, 2, max_len=3) is FinishReason.LENGTH
    assert _after(5, max_tokens=9).stop_reason(5, 2, max_len=4) is None
