"""The families beyond Llama, end to end as a platform team runs them: `loraplane controlplane`
(SQLite catalog, local store) and one `loraplane serve` per base model (catalog mode), real
processes over real HTTP. Per family (Qwen3, Gemma 3 as text-only and as the vision-language
checkpoint Google publishes, Phi-3, Mixtral, Qwen3-MoE) a tiny seeded HF model with a
tokenizer is registered as a pool; a tenant uploads a real PEFT adapter of that family through
the REST API and gets, from the `openai` client, HF+PEFT's greedy tokens for it and the base
model's for a base request (sent together, so they share engine steps). Uploads that do not
fit the family's config are refused with their reason in words: a projection shaped for the
wrong head layout (ShapeMismatch), LoRA on `lm_head` (pushed with `loraplane adapters push`),
on `embed_tokens` and on Gemma 3's vision tower (UnsupportedTargetModule). Adapters of the
other layout serve as their deltas merged into HF's weights: a split q/k/v, gate/up adapter on
the fused Phi-3 base, and a 4.x per-expert (`experts.N.w1`) adapter on the packed Mixtral."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.numpy import load_file

from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import wait_ready
from tests.factories import (
    FAMILY_LORA_EXTRA,
    FAMILY_TARGETS,
    build_family_adapter,
    build_model,
    build_peft_adapter,
    shrink_projection,
)
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]
KINDS = ["qwen3", "gemma3_text", "gemma3", "phi3", "mixtral", "qwen3_moe"]
TENANT = "acme"
# 17 tokens with the tiny tokenizer: longer than Gemma 3's 6-token sliding window
PROMPT = "Many tenants share one base model; each brings a small LoRA adapter."
MAX_TOKENS = 8
LOGPROB_ATOL = 1e-3  # fp32 on both sides; the engine's logprobs are of its fp32 logits


@dataclass
class Family:
    """One family's base model and the adapters a tenant tries to upload for it."""

    kind: str
    model_dir: Path
    good: Path  # every linear layer (and the packed experts of an MoE), rank 8
    wrong_shape: Path  # the good one with a q/qkv projection shaped for hidden / heads
    lm_head: Path
    embed_tokens: Path

    @property
    def base_name(self) -> str:
        return f"tiny-{self.kind.replace('_', '-')}"

    @property
    def pool(self) -> str:
        return f"pool-{self.kind.replace('_', '-')}"


def _build_family(kind: str, root: Path) -> Family:
    model_dir = build_model(root / kind, kind, seed=11, spread=True)
    good = build_family_adapter(model_dir, root / f"{kind}-good", kind, seed=21)
    first, extra = FAMILY_TARGETS[kind][0], FAMILY_LORA_EXTRA.get(kind, {})
    lm_head = build_peft_adapter(model_dir, root / f"{kind}-lm-head", seed=22, r=4, lora_alpha=8,
                                 target_modules=[first, "lm_head"], **extra)  # fmt: skip
    embed = build_peft_adapter(model_dir, root / f"{kind}-embed", seed=23, r=4, lora_alpha=8,
                               target_modules=[first, "embed_tokens"], **extra)  # fmt: skip
    wrong, _ = shrink_projection(good, root / f"{kind}-wrong-shape")
    return Family(kind, model_dir, good, wrong, lm_head, embed)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra}


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the control plane exited"
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the control plane did not start"
        time.sleep(0.1)


@dataclass
class Stack:
    """The running control plane and data planes, the tenant's key, and how to reach them."""

    controlplane: str
    dataplanes: dict[str, str]  # kind -> base URL
    key: str
    families: dict[str, Family]
    logs: Path

    def tenant(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def upload(self, family: Family, name: str, folder: Path) -> httpx.Response:
        """POST /v1/adapters with the adapter's two files, as a tenant's script does."""
        files = [
            ("files", (f, (folder / f).read_bytes()))
            for f in ("adapter_config.json", "adapter_model.safetensors")
        ]
        form = {"name": name, "base_model": family.base_name}
        return httpx.post(self.controlplane + "/v1/adapters", data=form, files=files,
                          headers=self.tenant(), timeout=60)  # fmt: skip

    def client(self, kind: str) -> openai.OpenAI:
        url = self.dataplanes[kind]
        return openai.OpenAI(base_url=url + "/v1", api_key=self.key, max_retries=0, timeout=120)


def _serve(family: Family, cp: str, store: Path, log: Path) -> tuple[str, subprocess.Popen[str]]:
    """`loraplane serve` of the family's base in catalog mode, on a free port."""
    port = free_port()
    args = [sys.executable, "-m", "loraplane", "serve", "--model", str(family.model_dir),
            "--served-model-name", family.base_name, "--controlplane-url", cp,
            "--port", str(port), "--metrics-port", "0", "--gateway-metrics-port", "0",
            "--dtype", "float32", "--max-loras", "2", "--max-num-seqs", "8",
            "--access-log", "off"]  # fmt: skip
    env = _env(LORAPLANE_SERVICE_TOKEN=SERVICE, LORAPLANE_STORE=str(store),
               LORAPLANE_POOL=family.pool, LORAPLANE_NUM_KV_BLOCKS="64",
               LORAPLANE_RESOLVE_TTL_S="0", OMP_NUM_THREADS="1")  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=store.parent, env=env, stdout=out, stderr=out, text=True)
    return f"http://127.0.0.1:{port}", proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The families this run selects, one pool and one data plane each, one control plane."""
    selected = [kind for kind in KINDS if _selected(request, kind)] or KINDS
    root = tmp_path_factory.mktemp("families")
    families = {kind: _build_family(kind, root / "build") for kind in selected}
    data, logs = root / "run", root / "logs"
    data.mkdir()
    logs.mkdir()
    store = data / "store"
    port = free_port()
    cp = f"http://127.0.0.1:{port}"
    env = _env(LORAPLANE_DATA_DIR=str(data), LORAPLANE_STORE=str(store),
               LORAPLANE_ADMIN_TOKEN=ADMIN, LORAPLANE_SERVICE_TOKEN=SERVICE)  # fmt: skip
    with (logs / "controlplane.log").open("wb") as out:
        control = subprocess.Popen(
            [sys.executable, "-m", "loraplane", "controlplane", "--port", str(port)],
            cwd=data, env=env, stdout=out, stderr=out, text=True,
        )  # fmt: skip
    procs: list[subprocess.Popen[str]] = [control]
    try:
        _wait_healthy(cp, control)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for family in families.values():
            base = {"name": family.base_name, "uri": str(family.model_dir)}
            pool = {"name": family.pool, "base_model": base}
            r = httpx.post(cp + "/v1/pools", json=pool, headers=admin)
            assert r.status_code == 201, r.text
        r = httpx.post(cp + "/v1/tenants", json={"name": TENANT}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(cp + f"/v1/tenants/{TENANT}/keys", json={"name": "k"}, headers=admin)
        key = r.json()["key"]
        urls: dict[str, str] = {}
        started = []
        for kind, family in families.items():  # all start at once: their imports overlap
            url, proc = _serve(family, cp, store, logs / f"{kind}.log")
            procs.append(proc)
            started.append((kind, url, proc))
        for kind, url, proc in started:
            try:
                wait_ready(url, timeout=180, proc=proc)
            except (RuntimeError, TimeoutError) as e:
                log = (logs / f"{kind}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"loraplane serve ({kind}) did not start: {e}\n{log}") from e
            urls[kind] = url
        yield Stack(cp, urls, key, families, logs)
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _selected(request: pytest.FixtureRequest, kind: str) -> bool:
    """Whether a test of this family is collected in this session: a run of one family's
    tests (`-k qwen3`) builds and starts only that family's base model."""
    return any(
        f"[{kind}]" in item.nodeid and getattr(item, "module", None) is request.module
        for item in request.session.items
    )


def _greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """`model`'s greedy continuation of `prompt` (fp32, a full forward per token), with each
    chosen token's log-probability."""
    tokens, logprobs = list(prompt), []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        chosen = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[chosen]))
        tokens.append(chosen)
    return tokens[len(prompt) :], logprobs


def _hf_greedy(family: Family, prompt: list[int]) -> dict[str, tuple[list[int], list[float]]]:
    """HF + PEFT's greedy continuation of `prompt` for the adapter ("adapter") and the base
    model ("base")."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(family.model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, family.good, adapter_name="adapter").eval()
    adapted = _greedy(model, prompt)
    with model.disable_adapter():
        return {"adapter": adapted, "base": _greedy(model, prompt)}


# (parameter of the HF model, index into it, LoRA delta B @ A * scale to add there)
Update = tuple[str, tuple[int | slice, ...], torch.Tensor]


def _hf_merged_greedy(
    model_dir: Path, updates: list[Update], prompt: list[int]
) -> tuple[list[int], list[float]]:
    """The greedy continuation of HF's model with the adapter's deltas merged into its weights:
    the reference for adapters whose layout PEFT cannot load on this model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, index, delta in updates:
            params[name][index] += delta
    return _greedy(model, prompt)  # from_pretrained leaves it in eval mode


def _token_texts(model_dir: Path) -> tuple[Any, list[str]]:
    """The tokenizer and the text of each token id alone (what completions' logprobs show)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [str(tokenizer.decode([i], skip_special_tokens=False)) for i in range(len(tokenizer))]
    return tokenizer, texts


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> Any:
    """A greedy completion of `prompt` (token ids) with each token's log-probability."""
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def _assert_served(
    answer: Any, expected: tuple[list[int], list[float]], tokenizer: Any, texts: list[str],
    what: str,
) -> None:  # fmt: skip
    """The completion is `expected`'s tokens, token for token (each token's text alone and
    the whole text), with its log-probabilities."""
    ids, logprobs = expected
    choice = answer.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [texts[t] for t in ids], what
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True), what
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL), what
    assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS


def _prompt(tokenizer: Any) -> list[int]:
    prompt: list[int] = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert len(prompt) > 6  # Gemma 3's sliding layer sees only part of it
    return prompt


@pytest.mark.parametrize("kind", KINDS)
def test_an_uploaded_adapter_of_the_family_serves_hf_peft_greedy_tokens(
    stack: Stack, kind: str
) -> None:
    family = stack.families[kind]
    r = stack.upload(family, f"{kind.replace('_', '-')}-bot", family.good)
    assert r.status_code == 201, r.text
    stored = r.json()
    version = stored["version"]
    assert (stored["created"], version["version"], version["rank"]) == (True, 1, 8), stored

    tokenizer, texts = _token_texts(family.model_dir)
    prompt = _prompt(tokenizer)
    expected = _hf_greedy(family, prompt)
    assert expected["adapter"][0] != expected["base"][0], "the adapter must change the output"

    client = stack.client(kind)
    models = {"adapter": stored["name"], "base": family.base_name}
    with ThreadPoolExecutor(2) as pool:  # adapter and base rows in the same engine steps
        answers = pool.map(lambda which: _complete(client, models[which], prompt), models)
        for which, answer in zip(models, answers, strict=True):
            _assert_served(answer, expected[which], tokenizer, texts, f"{kind} {which}")
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {family.base_name, stored["name"]}
    assert listed[stored["name"]].parent == family.base_name  # type: ignore[attr-defined]


def _refusal(r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    return error["code"], error["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_uploads_that_do_not_fit_the_family_are_refused_with_their_reason(
    stack: Stack, kind: str, tmp_path: Path
) -> None:
    family = stack.families[kind]
    code, message = _refusal(stack.upload(family, "wrong-shape", family.wrong_shape))
    _, tensor = shrink_projection(family.good, tmp_path / "again")
    rows = load_file(str(family.good / "adapter_model.safetensors"))[tensor].shape[0]
    module = tensor.removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
    assert code == "ShapeMismatch", message
    # the layer, the module, what it is and what the family's config makes it
    assert message.startswith(f"layer 0 {module}: "), message
    assert f"lora_B {rows // 2}x8, but {family.base_name} needs" in message, message
    assert message.endswith(f"and B {rows}x8"), message

    code, message = _refusal(stack.upload(family, "embeddings", family.embed_tokens))
    assert code == "UnsupportedTargetModule", message
    assert "LoRA on `embed_tokens` (the token embeddings) is not supported" in message

    # the tenant CLI, as a user pushes a folder: the refusal is printed in words
    pushed = subprocess.run(
        [sys.executable, "-m", "loraplane", "adapters", "push", str(family.lm_head),
         "--name", "head", "--base-model", family.base_name],
        env=_env(LORAPLANE_URL=stack.controlplane, LORAPLANE_API_KEY=stack.key),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert pushed.returncode == 1, (pushed.stdout, pushed.stderr)
    assert "UnsupportedTargetModule" in pushed.stderr, pushed.stderr
    assert "LoRA on `lm_head` (the output projection) is not supported" in pushed.stderr
    assert stack.key not in pushed.stdout + pushed.stderr

    # nothing refused was stored or is served
    r = httpx.get(stack.controlplane + "/v1/adapters", headers=stack.tenant())
    names = {a["name"] for a in _items(r.json())}
    assert not names & {"wrong-shape", "embeddings", "head"}, names
    with pytest.raises(openai.NotFoundError):
        stack.client(kind).completions.create(model="wrong-shape", prompt="x", max_tokens=1)


def _items(body: Any) -> list[dict[str, Any]]:
    if isinstance(body, list):
        return body
    items: list[dict[str, Any]] = body.get("items", body.get("adapters", []))
    return items


def test_a_pool_of_each_family_reads_its_base_models_config(stack: Stack) -> None:
    """The catalog's pools hold each base's config.json: what uploads are validated against."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for family in stack.families.values():
        r = httpx.get(stack.controlplane + f"/v1/pools/{family.pool}", headers=admin)
        assert r.status_code == 200, r.text
        config = r.json()["base_model_config"]
        assert config is not None
        on_disk = json.loads((family.model_dir / "config.json").read_text())
        assert config["model_type"] == on_disk["model_type"] == family.kind


def _serves_merged(
    stack: Stack, kind: str, name: str, folder: Path, updates: list[Update]
) -> dict[str, Any]:
    """Upload `folder` as `name` (201), then its greedy completion is HF's with `updates`
    merged, and not the base model's; the upload's answer."""
    family = stack.families[kind]
    r = stack.upload(family, name, folder)
    assert r.status_code == 201, r.text
    tokenizer, texts = _token_texts(family.model_dir)
    prompt = _prompt(tokenizer)
    expected = _hf_merged_greedy(family.model_dir, updates, prompt)
    assert expected[0] != _hf_merged_greedy(family.model_dir, [], prompt)[0]
    answer = _complete(stack.client(kind), name, prompt)
    _assert_served(answer, expected, tokenizer, texts, f"{kind} {name}")
    uploaded: dict[str, Any] = r.json()
    return uploaded


@pytest.mark.parametrize("kind", ["phi3"])
def test_a_split_qkv_and_gate_up_adapter_serves_on_the_fused_phi3_base(
    stack: Stack, kind: str, tmp_path: Path
) -> None:
    """A PEFT adapter trained on a Llama of Phi-3's shape (q/k/v and gate/up apart) is served
    on the fused base as the merged deltas of its parts in qkv_proj's and gate_up_proj's rows."""
    import numpy as np

    family = stack.families[kind]
    config = json.loads((family.model_dir / "config.json").read_text())
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")  # fmt: skip
    llama = build_model(tmp_path / "llama", "llama", seed=5, **{f: config[f] for f in fields})
    split = build_peft_adapter(llama, tmp_path / "split", seed=31, r=8, lora_alpha=16)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    rows = {
        "q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
        "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)), "o_proj": ("o_proj", slice(None)),
        "gate_proj": ("gate_up_proj", slice(0, inter)),
        "up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
        "down_proj": ("down_proj", slice(None)),
    }  # fmt: skip
    tensors = load_file(str(split / "adapter_model.safetensors"))
    updates: list[Update] = []
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        stem = key.removesuffix(".lora_A.weight")
        block, module = stem.removeprefix("base_model.model.").rsplit(".", 1)
        fused, index = rows[module]
        delta = 2.0 * np.matmul(tensors[f"{stem}.lora_B.weight"], a)  # alpha / r = 2
        updates.append((f"{block}.{fused}.weight", (index,), torch.from_numpy(delta)))
    assert len(updates) == 7 * config["num_hidden_layers"]
    _serves_merged(stack, kind, "split-bot", split, updates)


@pytest.mark.parametrize("kind", ["mixtral"])
def test_a_per_expert_mixtral_adapter_in_the_4x_layout_serves_as_its_merged_deltas(
    stack: Stack, kind: str, tmp_path: Path
) -> None:
    """An adapter naming each expert's linears as transformers 4.x and its PEFT wrote them
    (`block_sparse_moe.experts.N.w1` gate, `w3` up, `w2` down) on the packed base: each
    expert's delta lands in its rows of `experts.gate_up_proj` / `experts.down_proj`."""
    import numpy as np
    from safetensors.numpy import save_file

    family = stack.families[kind]
    config = json.loads((family.model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    r, rng = 8, np.random.default_rng(7)
    tensors: dict[str, Any] = {}
    updates: list[Update] = []

    def lora(
        stem: str, fan_in: int, fan_out: int, param: str, index: tuple[int | slice, ...]
    ) -> None:
        a = rng.normal(0.0, 0.2, (r, fan_in)).astype(np.float32)
        b = rng.normal(0.0, 0.2, (fan_out, r)).astype(np.float32)
        tensors[f"base_model.model.{stem}.lora_A.weight"] = a
        tensors[f"base_model.model.{stem}.lora_B.weight"] = b
        updates.append((param, index, torch.from_numpy(2.0 * (b @ a))))  # alpha / r = 2

    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}"
        lora(f"{at}.self_attn.q_proj", hidden, hidden, f"{at}.self_attn.q_proj.weight", ())
        for e in range(config["num_local_experts"]):
            expert, packed = f"{at}.block_sparse_moe.experts.{e}", f"{at}.mlp.experts"
            lora(f"{expert}.w1", hidden, inter, f"{packed}.gate_up_proj", (e, slice(0, inter)))
            lora(f"{expert}.w3", hidden, inter, f"{packed}.gate_up_proj",
                 (e, slice(inter, 2 * inter)))  # fmt: skip
            lora(f"{expert}.w2", inter, hidden, f"{packed}.down_proj", (e,))
    out = tmp_path / "per-expert"
    out.mkdir()
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16,
                      "target_modules": ["q_proj", "w1", "w2", "w3"], "bias": "none",
                      "base_model_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _serves_merged(stack, kind, "experts-bot", out, updates)


@pytest.mark.parametrize("kind", ["gemma3"])
def test_lora_on_a_gemma3_checkpoints_vision_tower_is_refused_saying_how_to_train_it(
    stack: Stack, kind: str, tmp_path: Path
) -> None:
    """PEFT's target names alone also adapt the vision tower's q/v projections: refused, and
    the message says what to train instead (the served adapter excluded the tower)."""
    family = stack.families[kind]
    both = build_peft_adapter(family.model_dir, tmp_path / "both", seed=24, r=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj"])  # fmt: skip
    code, message = _refusal(stack.upload(family, "with-vision", both))
    assert code == "UnsupportedTargetModule", message
    assert "vision_tower" in message and "exclude_modules '.*vision_tower.*'" in message, message
