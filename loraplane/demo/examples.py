"""Ready-to-paste examples for the running demo: real URLs, real keys."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from loraplane.demo.console import say
from loraplane.demo.corpus import QUESTIONS, chat_prompt
from loraplane.demo.provision import Tenant
from loraplane.demo.stack import POOL


def curl_chat(dp_url: str, key: str, model: str, question: str) -> str:
    """A curl command for one chat completion."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 64,
    }
    return (
        f"curl -s {dp_url}/v1/chat/completions \\\n"
        f'  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(json.dumps(body))}"
    )


def completions_body(model: str, question: str) -> dict[str, object]:
    """A completions request the demo's chat-trained model answers: the question in its chat
    format (a bare question gets an empty reply: the model only learnt to answer after
    `<|assistant|>`)."""
    return {"model": model, "prompt": chat_prompt(question), "temperature": 0, "max_tokens": 64}


def curl_completions(dp_url: str, key: str, model: str, question: str) -> str:
    """A curl command for one completion, the prompt in the model's chat format."""
    return (
        f"curl -s {dp_url}/v1/completions \\\n"
        f'  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(json.dumps(completions_body(model, question)))}"
    )


CHAT_HINT = (
    "# the demo's model is chat-trained: ask through /v1/chat/completions (as above); for\n"
    "# /v1/completions write the prompt in its chat format, <|user|>QUESTION</s><|assistant|>\n"
    "# (a bare question gets an empty reply):"
)


def openai_snippet(dp_url: str, key: str, model: str, question: str) -> str:
    """A Python snippet with the openai package."""
    return (
        "python - <<'EOF'\n"
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{dp_url}/v1", api_key="{key}")\n'
        f"reply = client.chat.completions.create(model={json.dumps(model)}, temperature=0,\n"
        f'    messages=[{{"role": "user", "content": {json.dumps(question)}}}])\n'
        "print(reply.choices[0].message.content)\n"
        "EOF"
    )


def show_examples(
    dp_url: str, cp_url: str, admin_token_file: Path, base: str, tenants: dict[str, Tenant],
    *, metrics_url: str,
) -> None:  # fmt: skip
    """Print the tenants' keys and examples for both services (the admin token stays in its
    file: the examples read it there)."""
    first = next(iter(tenants.values()))
    say("  tenants, their API keys (shown once by the control plane) and adapters:")
    for t in tenants.values():
        say(f"    {t.name:<8} {t.key}  ->  {t.adapter} (rank {t.rank}, v{t.version})")
    say(f"  admin token (control plane): in {admin_token_file} (mode 0600); the CLI reads it"
        " there (loraplane tenants list), or export LORAPLANE_ADMIN_TOKEN")  # fmt: skip
    say("  the model knows these questions: " + "; ".join(QUESTIONS))
    say("")
    say(f"# chat with {first.name}'s adapter (try model {base!r} or another key):")
    say(curl_chat(dp_url, first.key, first.adapter, QUESTIONS[1]))
    say("")
    last = list(tenants.values())[-1]
    say(f"# with the openai package, as {last.name}:")
    say(openai_snippet(dp_url, last.key, last.adapter, QUESTIONS[2]))
    say("")
    say(CHAT_HINT)
    say(curl_completions(dp_url, first.key, base, QUESTIONS[1]))
    say("")
    say("# what a tenant's key sees, slot pressure, and the control plane's view:")
    say(f'curl -s {dp_url}/v1/models -H "Authorization: Bearer {first.key}"')
    wanted = "^(vllm:|loraplane_adapter_resident|loraplane_tokens)"
    # per-tenant series: the metrics port (the API port's /metrics has vLLM's gauges only)
    say(f"curl -s {metrics_url}/metrics | grep -E '{wanted}'")
    admin = f"$(cat {shlex.quote(str(admin_token_file))})"
    say(f'curl -s {cp_url}/v1/pools/{POOL} -H "Authorization: Bearer {admin}"')
    say(f'curl -s {cp_url}/v1/adapters -H "Authorization: Bearer {first.key}"')
    say(f"# API docs: {cp_url}/docs  (control plane), {dp_url}/docs (data plane)")
    say("")
    say(console_hint(cp_url, first))


def console_hint(cp_url: str, tenant: Tenant) -> str:
    """Where the tenant console is and what to sign in with (a key never goes in a URL)."""
    return (
        f"# tenant console: {cp_url}/console/\n"
        f"#   sign in with a tenant's key above, e.g. {tenant.name}'s {tenant.key}\n"
        "#   (or the admin token: tenants, keys and pools)"
    )
