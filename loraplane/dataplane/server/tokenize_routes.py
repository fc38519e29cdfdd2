"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

They answer what the engine would see (the base model's tokenizer and chat template; adapters
do not change it) in vLLM's shapes, and are tenant-scoped like every other route: the caller's
key must resolve `model` (401 / 404 otherwise), and `/tokenizer_info` needs a valid key.

    POST /tokenize    {"model", "prompt" | "messages", "add_special_tokens",
                       "add_generation_prompt", "return_token_strs"}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}
    GET  /tokenizer_info -> {"tokenizer_class", the special tokens, "chat_template",
                             "model_max_length", "vocab_size"}
"""

from __future__ import annotations

from typing import Any

import jinja2
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from loraplane.dataplane.server.deps import CallerKeyDep, CatalogDep, RuntimeDep
from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.protocol import ChatMessage

router = APIRouter(tags=["tokenizer"])
MAX_DETOKENIZE = 1 << 20  # token ids per /detokenize request at most


class TokenizeRequest(BaseModel):
    """A text (`prompt`) or a chat (`messages`, rendered with the chat template)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=300)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=300)
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest, runtime: RuntimeDep, catalog: CatalogDep, key: CallerKeyDep
) -> dict[str, Any]:
    """The token ids the engine would run for this prompt or chat."""
    tenant = (await catalog.resolve(key, body.model)).tenant
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send exactly one of prompt and messages", param="prompt")
    tokenizer = runtime.require_engine().tokenizer
    if body.messages is not None:
        messages = [m.to_template() for m in body.messages]
        try:
            tokens = await runtime.tokenize(
                tenant, lambda: tokenizer.encode_chat(messages, body.add_generation_prompt)
            )
        except (jinja2.TemplateError, ValueError) as e:
            raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from None
    else:
        text = body.prompt or ""
        tokens = await runtime.tokenize(
            tenant, lambda: tokenizer.encode(text, body.add_special_tokens)
        )
    return {
        "count": len(tokens),
        "max_model_len": runtime.max_model_len,
        "tokens": tokens,
        "token_strs": await runtime.tokenize(
            tenant, lambda: [tokenizer.id_to_token(t) for t in tokens]
        )
        if body.return_token_strs
        else None,
    }


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest, runtime: RuntimeDep, catalog: CatalogDep, key: CallerKeyDep
) -> dict[str, Any]:
    """The text of these token ids (special tokens included, as vLLM answers)."""
    tenant = (await catalog.resolve(key, body.model)).tenant
    engine = runtime.require_engine()
    vocab, tokenizer, tokens = engine.vocab_size, engine.tokenizer, body.tokens

    def decode() -> str:  # on a worker: a million ids are checked and decoded off the loop
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
        return tokenizer.decode(tokens, skip_special_tokens=False)

    return {"prompt": await runtime.tokenize(tenant, decode)}


@router.get("/tokenizer_info")
async def tokenizer_info(
    runtime: RuntimeDep, catalog: CatalogDep, key: CallerKeyDep
) -> dict[str, Any]:
    """The base model's tokenizer: its special tokens, chat template and limits."""
    await catalog.resolve(key, runtime.base_model)  # any valid key may read it
    tokenizer = runtime.require_engine().tokenizer
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: text for name, text in tokenizer.special_tokens.items() if text is not None},
        "chat_template": tokenizer.chat_template,
        "model_max_length": runtime.max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }
