"""Tokenizer without transformers: encode/decode, special tokens, chat templates, EOS ids.

transformers' PreTrainedTokenizerFast on the same files is the oracle where one applies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import SecurityError

from loraplane.dataplane.tokenizer import Tokenizer

TEXT = "Grüße aus Zürich! 東京 and naïve café: LoRA adds B(A x).\n  def f(): pass"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, Zürich?"},
]


@pytest.fixture
def tok_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny model's tokenizer files."""
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, out / name)
    return out


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def test_encode_then_decode_round_trips_unicode_text_and_matches_transformers(
    tok_dir: Path,
) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert ids == _hf(tok_dir).encode(TEXT)
    assert tok.vocab_size == 384


def test_special_tokens_are_read_from_strings_or_content_dicts(tok_dir: Path) -> None:
    _edit_config(
        tok_dir,
        bos_token={"content": "<s>", "lstrip": False},
        eos_token={"__type": "AddedToken", "content": "</s>"},
        pad_token="<unk>",
    )
    tok = Tokenizer.from_dir(tok_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.special_tokens["eos_token"] == "</s>"


def test_decode_skips_special_tokens_unless_asked_to_keep_them(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = [1, *tok.encode("hi there", add_special_tokens=False), 2]
    assert tok.decode(ids) == "hi there"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi there</s>"


def test_chat_template_renders_with_and_without_the_generation_prompt_like_transformers(
    tok_dir: Path,
) -> None:
    tok, hf = Tokenizer.from_dir(tok_dir), _hf(tok_dir)
    prompt = tok.render_chat(CHAT, add_generation_prompt=True)
    assert prompt == "<|system|>Be brief.</s><|user|>Hello, Zürich?</s><|assistant|>"
    assert prompt == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    plain = tok.render_chat(CHAT, add_generation_prompt=False)
    assert plain == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert not plain.endswith("<|assistant|>")
    hf_ids = hf.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tok.encode_chat(CHAT) == list(hf_ids)


def test_chat_template_jinja_file_wins_and_templates_get_bos_tojson_and_kwargs(
    tok_dir: Path,
) -> None:
    (tok_dir / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}[{{ persona }}]{% endif %}"
    )
    tok = Tokenizer.from_dir(tok_dir)
    out = tok.render_chat([{"role": "user", "content": "é"}], persona="bot")
    assert out == '<s>{"role": "user", "content": "é"}[bot]'


def test_template_raise_exception_surfaces_as_a_template_error(tok_dir: Path) -> None:
    _edit_config(tok_dir, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        Tokenizer.from_dir(tok_dir).render_chat(CHAT)


def test_templates_run_in_a_sandbox_that_blocks_unsafe_attribute_access(tok_dir: Path) -> None:
    _edit_config(tok_dir, chat_template="{{ messages.__class__.__subclasses__() }}")
    with pytest.raises(SecurityError):
        Tokenizer.from_dir(tok_dir).render_chat(CHAT)
    _edit_config(tok_dir, chat_template="{% set _ = messages.append(1) %}")
    with pytest.raises(SecurityError):
        Tokenizer.from_dir(tok_dir).render_chat(CHAT)


def test_named_template_lists_use_the_default_entry(tok_dir: Path) -> None:
    _edit_config(
        tok_dir,
        chat_template=[
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default:{{ messages | length }}"},
        ],
    )
    assert Tokenizer.from_dir(tok_dir).render_chat(CHAT) == "default:2"


def test_eos_ids_combine_generation_config_int_or_list_with_the_tokenizer_eos(
    tok_dir: Path,
) -> None:
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {2}
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {2, 7, 9}
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {2, 11}
    (tok_dir / "generation_config.json").unlink()
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {2}


def test_a_model_without_a_chat_template_says_so(tok_dir: Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tok_dir).render_chat(CHAT)


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
