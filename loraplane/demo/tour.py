"""`loraplane demo --once`: a scripted tour of the running system, over real HTTP.

Clients are the `openai` package's, pointed at the data plane with each tenant's API key;
set-up and refusals go through the control plane's REST API with httpx.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai

from loraplane.demo.build import build_adapter
from loraplane.demo.console import one_line, say
from loraplane.demo.corpus import QUESTIONS, STYLES
from loraplane.demo.errors import DemoError
from loraplane.demo.pressure import Peaks, PeakWatch, show_controlplane, show_metrics
from loraplane.demo.provision import ADAPTER_FILES, Tenant, upload
from loraplane.demo.stack import MAX_LORA_RANK, MAX_LORAS

BATCH = 12
MAX_TOKENS = 64


class TourFailed(DemoError):
    """The system did not behave as the tour expects."""


@dataclass(frozen=True, slots=True)
class Call:
    """One chat request: who sends it, to which model, what it asks."""

    tenant: Tenant
    model: str
    question: str

    @property
    def label(self) -> str:
        """`tenant / model`."""
        return f"{self.tenant.name} / {self.model}"


def clients(dp_url: str, tenants: dict[str, Tenant]) -> dict[str, openai.OpenAI]:
    """One OpenAI client per tenant, each with the tenant's own key."""
    return {
        t.name: openai.OpenAI(base_url=dp_url + "/v1", api_key=t.key, max_retries=0, timeout=120)
        for t in tenants.values()
    }


def ask(client: openai.OpenAI, model: str, question: str) -> tuple[str, int]:
    """A greedy chat completion: (reply, completion tokens)."""
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    tokens = reply.usage.completion_tokens if reply.usage else 0
    return reply.choices[0].message.content or "", tokens


def same_prompt(
    base: str, tenants: dict[str, Tenant], api: dict[str, openai.OpenAI], question: str
) -> dict[str, str]:
    """One question to the base model and to each tenant's adapter; the replies must differ."""
    first = next(iter(tenants.values()))
    calls = [Call(first, base, question)] + [Call(t, t.adapter, question) for t in tenants.values()]
    replies: dict[str, str] = {}
    say(f"    Q: {question}")
    for call in calls:
        reply, _ = ask(api[call.tenant.name], call.model, question)
        who = f"{base} (base)" if call.model == base else call.label
        replies[who] = reply
        say(f"    {who:<28} {one_line(reply)}")
    if len(set(replies.values())) != len(replies):
        raise TourFailed(f"some replies are the same: {replies}")
    say(f"    -> {len(replies)} distinct replies from one base model")
    return replies


def chat_format_completion(base: str, client: openai.OpenAI, question: str) -> str:
    """A plain completion (`/v1/completions`) with the question in the model's chat format,
    as the serving examples show it; TourFailed if the reply is empty."""
    from loraplane.demo.examples import completions_body

    body = completions_body(base, question)
    reply = client.completions.create(
        model=base, prompt=str(body["prompt"]), temperature=0, max_tokens=MAX_TOKENS
    )
    text = reply.choices[0].text
    say("    the model is chat-trained: /v1/completions answers a prompt in its chat format")
    say(f"    {body['prompt']!r} -> {one_line(text, 64)}")
    if not text.strip():
        raise TourFailed(f"a chat-format completion came back empty: {reply}")
    return text


def batch_calls(base: str, tenants: dict[str, Tenant]) -> list[Call]:
    """BATCH calls: every fourth to the base model, the rest to the tenants' adapters in turn."""
    people = list(tenants.values())
    calls = []
    for i in range(BATCH):
        if i % 4 == 0:  # the base model, asked with each tenant's key in turn
            owner, model = people[(i // 4) % len(people)], base
        else:
            owner = people[(i % 4 - 1) % len(people)]
            model = owner.adapter
        calls.append(Call(owner, model, QUESTIONS[i % len(QUESTIONS)]))
    return calls


def mixed_batch(
    base: str, tenants: dict[str, Tenant], api: dict[str, openai.OpenAI], metrics_url: str
) -> Peaks:
    """BATCH concurrent requests over every adapter and the base model, with the metrics
    port's /metrics watched."""
    calls = batch_calls(base, tenants)
    with PeakWatch(metrics_url) as peaks, ThreadPoolExecutor(BATCH) as pool:
        start = time.perf_counter()
        futures = [pool.submit(ask, api[c.tenant.name], c.model, c.question) for c in calls]
        results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    exact = 0
    for i, (call, (reply, _)) in enumerate(zip(calls, results, strict=True), start=1):
        style = "base" if call.model == base else call.tenant.name
        exact += reply.strip() == STYLES[style][QUESTIONS.index(call.question)]
        say(f"    #{i:02d} {call.label:<26} {call.question[:26]:<26} -> {one_line(reply, 52)}")
    tokens = sum(n for _, n in results)
    say(f"    {BATCH} concurrent requests, {len({c.model for c in calls})} models, "
        f"{len(tenants)} tenants: {elapsed:.2f} s, {tokens} completion tokens "
        f"({tokens / elapsed:.0f} tokens/s on CPU)")  # fmt: skip
    say(f"    {exact}/{BATCH} replies are word for word what their adapter (or the base) "
        "was trained to say")  # fmt: skip
    return peaks


def models_isolation(base: str, tenants: dict[str, Tenant], api: dict[str, openai.OpenAI]) -> None:
    """Each tenant's /v1/models lists the base model and its own adapter only."""
    for t in tenants.values():
        ids = sorted(m.id for m in api[t.name].models.list().data)
        if ids != sorted([base, t.adapter]):
            raise TourFailed(f"{t.name} sees {ids}, expected {base} and {t.adapter}")
        say(f"    {t.name:<8} GET /v1/models -> {', '.join(ids)}")
    first, other = list(tenants.values())[:2]
    try:
        ask(api[first.name], other.adapter, QUESTIONS[0])
    except openai.NotFoundError as e:
        say(f"    {first.name} asks for {other.name}'s {other.adapter}: {e.status_code} {e.code}")
    else:
        raise TourFailed(f"{first.name} could use {other.name}'s adapter")
    say("    -> each tenant sees and uses only its own adapter (and the base model)")


def rejections(
    cp_url: str, base: str, model_dir: Path, tenant: Tenant, good: Path, scratch: Path
) -> list[str]:
    """Upload the same adapter again (200, the existing version), then two bad ones: each
    answers 422 with its reason code."""
    huge = build_adapter(model_dir, scratch / "rank64", r=2 * MAX_LORA_RANK, lora_alpha=16)
    config = json.loads((good / "adapter_config.json").read_text())
    bias = {
        "adapter_config.json": json.dumps({**config, "bias": "all"}).encode(),
        "adapter_model.safetensors": (good / ADAPTER_FILES[1]).read_bytes(),
    }
    cases: list[tuple[str, Path, dict[str, bytes] | None]] = [
        (f"rank {2 * MAX_LORA_RANK} (pool max {MAX_LORA_RANK})", huge, None),
        ('trained biases (bias: "all")', good, bias),
    ]
    same = upload(cp_url, tenant.key, tenant.adapter, base, good)
    v = same.json().get("version", {})
    if same.status_code != 200 or v.get("version") != tenant.version:
        raise TourFailed(f"re-upload: expected 200 v{tenant.version}, got {same.text[:200]}")
    say(f"    {tenant.name} uploads {tenant.adapter} again, unchanged: 200, the existing "
        f"v{v['version']} (same digest {v['digest'][:12]}...)")  # fmt: skip
    codes = []
    for what, folder, files in cases:
        r = upload(cp_url, tenant.key, "helpdesk-bad", base, folder, files)
        if r.status_code != 422:
            raise TourFailed(f"{what}: expected 422, got {r.status_code}: {r.text[:200]}")
        err = r.json()["error"]
        codes.append(err["code"])
        say(f"    {tenant.name} uploads {what}: 422 {err['code']}: {err['message']}")
    say("    -> refused before anything is stored; the tenant's serving adapter is untouched")
    return codes


def preview(dp_url: str, base: str, tenants: dict[str, Tenant], question: str) -> None:
    """`question` to the base model and each tenant's adapter (TourFailed if they agree)."""
    try:
        same_prompt(base, tenants, clients(dp_url, tenants), question)
    except openai.OpenAIError as e:
        raise TourFailed(f"the OpenAI API answered {type(e).__name__}: {e}") from e


def run_tour(
    dp_url: str, metrics_url: str, cp_url: str, admin_token: str, base: str,
    tenants: dict[str, Tenant],
    model_dir: Path, adapters: dict[str, Path], scratch: Path,
    step: Callable[[str], None],
) -> None:  # fmt: skip
    """The scripted tour; TourFailed when something is not as it should be."""
    try:
        _tour(dp_url, metrics_url, cp_url, admin_token, base, tenants, model_dir, adapters,
              scratch, step)  # fmt: skip
    except openai.OpenAIError as e:
        raise TourFailed(f"the OpenAI API answered {type(e).__name__}: {e}") from e


def _tour(
    dp_url: str, metrics_url: str, cp_url: str, admin_token: str, base: str,
    tenants: dict[str, Tenant],
    model_dir: Path, adapters: dict[str, Path], scratch: Path,
    step: Callable[[str], None],
) -> None:  # fmt: skip
    api = clients(dp_url, tenants)
    step("one prompt, four replies: the base model and each tenant's adapter")
    same_prompt(base, tenants, api, QUESTIONS[0])
    chat_format_completion(base, api[next(iter(tenants))], QUESTIONS[1])
    step(f"a mixed batch: {BATCH} concurrent requests over three adapters and the base model")
    peaks = mixed_batch(base, tenants, api, metrics_url)
    step("isolation: what each tenant's key can see and use")
    models_isolation(base, tenants, api)
    step("uploads through the REST API: identical content again, then bad adapters")
    first = next(iter(tenants.values()))
    rejections(cp_url, base, model_dir, first, adapters[first.name], scratch)
    step("slot pressure and usage, as the data plane and the control plane report them")
    tokens = show_metrics(metrics_url, peaks, MAX_LORAS, say)
    keys = {t.name: t.key for t in tenants.values()}
    if not show_controlplane(cp_url, admin_token, keys, tokens, say):
        raise TourFailed("the data plane's usage did not all reach the control plane")
