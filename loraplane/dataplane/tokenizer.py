"""The base model's tokenizer and chat template, without transformers.

`tokenizer.json` is loaded with the `tokenizers` library; special tokens come from
`tokenizer_config.json`; the chat template (from `chat_template.jinja` or the tokenizer config)
is rendered by jinja2 in an immutable sandbox with the helpers HF templates expect
(`raise_exception`, `tojson`, `strftime_now`, the `{% generation %}` tag). Stop ids combine
`generation_config.json`'s eos_token_id (an int or a list) with the tokenizer's EOS token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from loraplane import fileaccess

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; the
    serving path only needs the text, so the tag renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox that cannot mutate or reach outside its inputs."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _token_text(value: object) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_source(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode, decode and render chats for one base model."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = {k: special_tokens.get(k) for k in SPECIAL_TOKENS}
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        eos = {int(i) for i in extra_eos_ids}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, the chat template and EOS ids."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {root}")
        fileaccess.check_readable(root / "tokenizer.json")  # tokenizers names no path
        tok = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
        eos_ids = _read_json(root / "generation_config.json").get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        if not isinstance(eos_ids, list) or not all(isinstance(i, int) for i in eos_ids):
            eos_ids = []
        return cls(tok, special, _template_source(root, config), eos_ids)

    def _id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        if text is None:
            return None
        found = self._tok.token_to_id(text)
        return None if found is None else int(found)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None when the model declares none."""
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the tokenizer's EOS token (see eos_token_ids for every stop id)."""
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self._id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens tokenizer.json's post-processor adds."""
        # encode_batch releases the GIL while Rust works (encode holds it: an 8 MiB prompt would
        # stop the event loop and every other thread for seconds); same ids
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return [int(i) for i in encoding.ids]

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (grammar engines build their view of it)."""
        return str(self._tok.to_str())

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` (e.g. "Ġhello" in byte-level BPE), "" if none."""
        return str(self._tok.id_to_token(token_id) or "")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the chat template makes of `messages` (OpenAI-style dicts)."""
        if self._template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json)")
        values: dict[str, Any] = {k: v for k, v in self.special_tokens.items() if v is not None}
        values.update(template_kwargs)
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            **values,
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered chat; the template already holds any BOS it wants."""
        text = self.render_chat(messages, add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False)
