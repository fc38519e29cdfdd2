"""Gemma 2 and Gemma 3 (text) + LoRA layers + paged cache against HF transformers + PEFT, fp32.

Tiny seeded models that exercise what Gemma does differently: head_dim 32 with hidden 64 over
4 heads, (1 + w) norms with random weights, sliding layers whose 6-token window binds (every
prompt is longer), Gemma 2's soft-caps set low enough to bind (2 on scores, 5 on logits; the
control test shows the logits move without them), Gemma 3's q/k norms, 5 sliding : 1 full
layers and two RoPE tables (full: base 1e6, linear x8; sliding: base 1e4), tied embeddings
(Gemma 2) and untied ones (Gemma 3). Batches mix several adapters (ranks 8 to 64, all modules,
q/v only, MLP only, rank/alpha patterns, rslora) with base-model rows, prefill in chunks,
attend through shuffled blocks and start from a shared cached prefix; decode steps feed back
the greedy token, which must be HF's argmax at every position.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRAPool, install_lora, load_lora
from loraplane.dataplane.models import load_model, read_config
from loraplane.dataplane.models.gemma import GemmaConfig, GemmaForCausalLM
from tests.conftest import ADAPTER_CONFIGS
from tests.dataplane.conftest import Family, LoadedModel, PagedRunner, Seq, hf_logits

KINDS = ["gemma2", "gemma3_text"]
ATOL = 1e-4  # the Llama parity tests' tolerance on fp32 logits
WINDOW = 6
ADAPTERS = ["r64", "r8-qv", "r32-mlp", "r16-rslora", "r8-patterns"]
_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "head_dim": 32,  # != hidden / heads
    "sliding_window": WINDOW,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": {
        **_SHAPE,
        "num_hidden_layers": 4,  # sliding, full, sliding, full
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
    "gemma3_text": {
        **_SHAPE,
        "num_hidden_layers": 6,  # five sliding, then one full
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
}


def _build_model(out: Path, kind: str, seed: int, **overrides: Any) -> Path:
    """A seeded HF Gemma with weights large enough that the window, caps and norms matter."""
    import transformers

    from loraplane.demo.build import build_tokenizer

    vocab = build_tokenizer(out)
    config_cls = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}
    config = config_cls[kind](vocab_size=vocab, **{**CONFIGS[kind], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # norms scale by 1 + w (HF initialises w to 0); scores of a few units, so a cap of
            # 2 binds on about one score in five
            param.normal_(0.0, 0.3 if "norm" in name or "embed" in name else 0.12)
    model.save_pretrained(out)
    return out


def _spec(model_dir: Path) -> BaseModelSpec:
    """The adapter core's view of the base model: its adaptable modules' shapes."""
    return BaseModelSpec.from_dir(model_dir)


@pytest.fixture(scope="module")
def gemma_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    from tests.factories import build_peft_adapter

    root = tmp_path_factory.mktemp("gemma-models")
    out = {}
    for i, kind in enumerate(KINDS):
        model_dir = _build_model(root / kind, kind, seed=11 + i)
        adapters = {
            name: build_peft_adapter(
                model_dir, root / f"{kind}-{name}", seed=200 + j, **dict(ADAPTER_CONFIGS[name])
            )
            for j, name in enumerate(ADAPTERS)
        }
        out[kind] = Family(kind, model_dir, adapters)
    return out


@pytest.fixture(scope="module")
def gemma_reference(gemma_families: dict[str, Family]) -> Callable[[str], torch.nn.Module]:
    """kind -> a PeftModel of that Gemma with all its adapters loaded (fp32)."""
    import peft
    import transformers

    cache: dict[str, torch.nn.Module] = {}

    def get(kind: str) -> torch.nn.Module:
        if kind not in cache:
            fam = gemma_families[kind]
            base = transformers.AutoModelForCausalLM.from_pretrained(fam.model_dir)
            names = list(fam.adapters)
            model = peft.PeftModel.from_pretrained(
                base, fam.adapters[names[0]], adapter_name=names[0]
            )
            for name in names[1:]:
                model.load_adapter(fam.adapters[name], adapter_name=name)
            cache[kind] = model.eval()
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def gemma_models(gemma_families: dict[str, Family]) -> Callable[[str], LoadedModel]:
    cache: dict[str, LoadedModel] = {}

    def get(kind: str) -> LoadedModel:
        if kind not in cache:
            fam = gemma_families[kind]
            spec = _spec(fam.model_dir)
            model = load_model(fam.model_dir, torch.float32, torch.device("cpu"))
            layout = dispatch.b_transposed(torch.float32, torch.device("cpu"))  # the engine's
            pool = LoRAPool(len(fam.adapters), spec, torch.float32, "cpu", b_transposed=layout)
            install_lora(model, pool)
            slots = {}
            for slot, (name, path) in enumerate(fam.adapters.items()):
                pool.load(slot, load_lora(path, spec))
                slots[name] = slot
            cache[kind] = LoadedModel(model, pool, slots)
        return cache[kind]

    return get


def _check(seq: GenSeq, reference: torch.nn.Module, adapter: str | None) -> None:
    """seq's logits equal HF+PEFT's at the same positions, and every token fed back after the
    prompt is HF's greedy choice."""
    expected = hf_logits(reference, seq.tokens[: seq.num_computed], adapter)[seq.first_logit :]
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    generated = seq.tokens[seq.prompt_len :]
    greedy = expected.argmax(-1)[seq.prompt_len - 1 - seq.first_logit :][: len(generated)]
    assert generated == greedy.tolist()


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(length)]


@dataclass
class GenSeq(Seq):
    """A Seq that remembers where its prompt ends (the tokens after it are generated)."""

    prompt_len: int = 0


def _seq(tokens: list[int], slot: int) -> GenSeq:
    return GenSeq(tokens, slot, prompt_len=len(tokens))


def test_config_parses_gemma_layer_types_caps_and_ropes(gemma_families: dict[str, Family]) -> None:
    g2 = read_config(gemma_families["gemma2"].model_dir)
    g3 = read_config(gemma_families["gemma3_text"].model_dir)
    assert isinstance(g2, GemmaConfig) and isinstance(g3, GemmaConfig)
    assert g2.sliding_windows == (WINDOW, None, WINDOW, None)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.qk_norm) == (2.0, 5.0, False)
    assert g2.tie_word_embeddings and g2.head_dim == 32 and g2.query_pre_attn_scalar == 24
    assert g3.sliding_windows == (WINDOW,) * 5 + (None,)
    assert (g3.attn_logit_softcap, g3.final_logit_softcap, g3.qk_norm) == (None, None, True)
    assert not g3.tie_word_embeddings
    assert (g3.rope.theta, g3.rope.rope_type, g3.rope.factor) == (1e6, "linear", 8.0)
    assert (g3.local_rope.theta, g3.local_rope.rope_type) == (1e4, "default")


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_adapters_chunked_prefill_and_greedy_decode_match_hf_peft(
    kind: str,
    gemma_families: dict[str, Family],
    gemma_models: Callable[[str], LoadedModel],
    gemma_reference: Callable[[str], torch.nn.Module],
) -> None:
    engine, rng = gemma_models(kind), random.Random(kind)
    # every adapter, two base rows, one adapter twice in non-adjacent rows; all longer than
    # the window
    names: list[str | None] = [*gemma_families[kind].adapters, None, "r64", None]
    lengths = [9, 14, 7, 11, 16, 8, 21, 10]
    seqs = [
        _seq(_prompt(rng, n), engine.slots[a] if a else -1)
        for a, n in zip(names, lengths, strict=True)
    ]
    runner = PagedRunner(engine.model, num_blocks=160, block_size=4, seed=5)
    long_seq = seqs[-2]
    # step 1: all prompts but one, and that one's first 8-token chunk; step 2: its remaining
    # 13 tokens while the others decode; then 5 decode steps, each token HF's argmax
    runner.step([(s, len(s.tokens)) for s in seqs if s is not long_seq] + [(long_seq, 8)])
    for _ in range(6):
        for seq in seqs:
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(seq.logits[-1].argmax()))
        runner.step([(s, len(s.tokens) - s.num_computed) for s in seqs])
    reference = gemma_reference(kind)
    for seq, name in zip(seqs, names, strict=True):
        assert len(seq.tokens) - seq.prompt_len >= 5
        _check(seq, reference, name)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cached_prefix_longer_than_the_window_is_attended_as_hf_does(
    kind: str,
    gemma_models: Callable[[str], LoadedModel],
    gemma_reference: Callable[[str], torch.nn.Module],
) -> None:
    engine, rng = gemma_models(kind), random.Random(f"{kind}-prefix")
    slot = engine.slots["r16-rslora"]
    prefix = _prompt(rng, 12)  # three blocks of 4, twice the window
    writer = _seq([*prefix, *_prompt(rng, 5)], slot)
    runner = PagedRunner(engine.model, num_blocks=48, block_size=4, seed=7)
    runner.step([(writer, len(writer.tokens))])
    tail, last_token = _seq([*prefix, *_prompt(rng, 9)], slot), _seq([*prefix, 77], slot)
    runner.share_prefix(writer, tail, 3)
    runner.share_prefix(writer, last_token, 3)
    writer.tokens.append(int(writer.logits[-1].argmax()))
    runner.step([(tail, 9), (writer, 1), (last_token, 1)])
    for _ in range(3):
        for seq in (tail, writer, last_token):
            seq.tokens.append(int(seq.logits[-1].argmax()))
        runner.step([(tail, 1), (writer, 1), (last_token, 1)])
    reference = gemma_reference(kind)
    for seq in (tail, last_token, writer):
        _check(seq, reference, "r16-rslora")


def test_gemma2_soft_caps_change_the_logits_so_the_parity_checks_them(
    gemma_families: dict[str, Family],
    gemma_models: Callable[[str], LoadedModel],
    tmp_path: Path,
) -> None:
    """Negative control: the same weights without the caps give other logits, so a model
    that ignored either cap would fail the parity tests above."""
    import transformers

    fam = gemma_families["gemma2"]
    model = gemma_models("gemma2").model
    assert isinstance(model, GemmaForCausalLM)
    rng = random.Random(3)
    tokens = _prompt(rng, 15)
    seq = Seq(list(tokens))
    PagedRunner(model, num_blocks=8, block_size=4).step([(seq, len(tokens))])
    ours = torch.stack(seq.logits)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = transformers.AutoModelForCausalLM.from_pretrained(fam.model_dir, **{cap: None})
        with torch.no_grad():
            other = uncapped(torch.tensor([tokens])).logits[0]
        assert (other - ours).abs().max() > 100 * ATOL, cap


def test_gemma3_image_text_checkpoint_serves_its_text_stack_as_hf_does(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (config `gemma3` with a text_config; weights
    `language_model.model.*` beside a vision tower and projector): the text stack loads and its
    logits on a text-only prompt are HF's, alone and with a PEFT adapter of the text stack."""
    import peft
    import transformers

    from loraplane.demo.build import build_tokenizer

    vocab = build_tokenizer(tmp_path)
    text = {**CONFIGS["gemma3_text"], "vocab_size": vocab, "num_hidden_layers": 3,
            "final_logit_softcapping": 5.0, "tie_word_embeddings": True}  # fmt: skip
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
    )  # fmt: skip
    torch.manual_seed(4)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name or "embed" in name else 0.12)
    hf.save_pretrained(tmp_path)
    # a tenant's adapter of the text stack (PEFT names it model.language_model.layers.N...);
    # SigLIP has no o/gate/down projections, so these names hit the text stack only
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["o_proj", "gate_proj", "down_proj"],
    )  # fmt: skip
    torch.manual_seed(5)
    reference = peft.get_peft_model(hf, lora).eval()
    reference.save_pretrained(tmp_path / "adapter")
    parsed = read_config(tmp_path)
    assert isinstance(parsed, GemmaConfig) and parsed.model_type == "gemma3_text"
    # HF's image-text model never soft-caps its logits (its text-only Gemma3ForCausalLM does)
    assert parsed.final_logit_softcap is None and parsed.sliding_windows == (WINDOW,) * 3
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    spec = _spec(tmp_path)
    pool = LoRAPool(1, spec, torch.float32, "cpu")
    install_lora(model, pool)
    pool.load(0, load_lora(tmp_path / "adapter", spec))
    rng = random.Random(9)
    tokens = [rng.randrange(3, vocab - 3) for _ in range(14)]  # no image/boi/eoi token
    base, adapted = Seq(list(tokens)), Seq(list(tokens), slot=0)
    PagedRunner(model, num_blocks=16, block_size=4).step([(base, 14), (adapted, 14)])
    with torch.no_grad():
        with_adapter = reference(input_ids=torch.tensor([tokens])).logits[0]
        with reference.disable_adapter():
            without = reference(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.stack(base.logits), without, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(adapted.logits), with_adapter, atol=ATOL, rtol=0)
    assert (with_adapter - without).abs().max() > 100 * ATOL  # the adapter does something


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_gemma_and_pool_stay_close_to_hf_peft_fp32(
    kind: str,
    dtype: torch.dtype,
    gemma_families: dict[str, Family],
    gemma_reference: Callable[[str], torch.nn.Module],
) -> None:
    fam, rng = gemma_families[kind], random.Random(7)
    spec = _spec(fam.model_dir)
    model = load_model(fam.model_dir, dtype, torch.device("cpu"))
    pool = LoRAPool(3, spec, dtype, "cpu")
    install_lora(model, pool)
    names: list[str | None] = ["r64", None, "r8-qv", "r32-mlp"]
    for slot, name in enumerate(n for n in names if n):
        pool.load(slot, load_lora(fam.adapters[name], spec))
    slots = iter(range(3))
    seqs = [Seq(_prompt(rng, 11), next(slots) if n else -1) for n in names]
    PagedRunner(model, num_blocks=16, block_size=4).step([(s, 11) for s in seqs])
    reference = gemma_reference(kind)
    for seq, name in zip(seqs, names, strict=True):
        expected = hf_logits(reference, seq.tokens, name)
        # logits of up to ~15 (the Llama test's are < 1): twice its absolute tolerance in fp16;
        # bf16 keeps 8 bits, one step being 0.0625 at 8 to 16, and a CPU with native bf16 dot
        # products (AVX512-BF16: an AMD EPYC here) rounds them otherwise: 0.115 seen there
        atol = 0.2 if dtype == torch.bfloat16 else 0.1
        torch.testing.assert_close(torch.stack(seq.logits), expected, atol=atol, rtol=0.05)


def test_embedding_scale_is_rounded_to_the_weights_dtype_as_transformers_does() -> None:
    """sqrt(72) = 8.485 is 8.5 in bf16: the first layer sees embed * 8.5, as in HF."""
    config = GemmaConfig.from_hf(
        {"model_type": "gemma2", "vocab_size": 40, "hidden_size": 72, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 8}
    )  # fmt: skip
    torch.manual_seed(0)
    model = GemmaForCausalLM(config).to(torch.bfloat16)
    model.allocate_kv_cache(2, 4)
    seen: list[torch.Tensor] = []
    layer = model.model.decoder_layers[0]  # type: ignore[attr-defined]
    layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    ids = torch.tensor([3, 7, 11])
    attn = AttentionMetadata.build([3], [3], [[0]], 4)
    model(ids, query_positions([3], [3]), attn)
    embedded = model.model.embed_tokens(ids)
    assert torch.equal(seen[0], embedded * torch.tensor(8.5, dtype=torch.bfloat16))
    assert not torch.equal(seen[0], (embedded.float() * 72**0.5).to(torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_tokens_and_logprobs_equal_hf_peft_with_chunks_and_prefix_cache(
    kind: str,
    gemma_families: dict[str, Family],
    gemma_reference: Callable[[str], torch.nn.Module],
) -> None:
    """Through the engine: a 16-token budget chunks the prompts, the shared 12-token prefix
    (twice the window) is served from the prefix cache to the later requests."""
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams

    family, rng = gemma_families[kind], random.Random(f"{kind}-engine")
    config = EngineConfig(
        model=str(family.model_dir), device="cpu", dtype="float32", block_size=4,
        num_kv_blocks=96, max_num_batched_tokens=16, enable_prefix_caching=True,
        max_loras=3,
    )  # fmt: skip
    engine = Engine(config)
    refs = {n: engine.register_lora(n, family.adapters[n], "t") for n in ("r64", "r8-qv")}
    shared = _prompt(rng, 12)
    names: list[str | None] = ["r64", "r64", None, "r8-qv"]
    batch = [[*shared, *_prompt(rng, n)] for n in (3, 9, 1)] + [_prompt(rng, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    first = engine.generate(batch[:1], params, [refs["r64"]])  # fills the prefix cache
    rest = engine.generate(batch[1:], params, [refs[n] if n else None for n in names[1:]])
    assert engine.block_manager.cache_hit_tokens >= 12  # the shared prefix came from cache
    reference = gemma_reference(kind)
    for prompt, name, out in zip(batch, names, [*first, *rest], strict=True):
        tokens = [*prompt, *out.token_ids]
        logits = hf_logits(reference, tokens[:-1], name)[len(prompt) - 1 :]
        assert out.token_ids == logits.argmax(-1).tolist(), name
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), expected[:, 0], atol=ATOL, rtol=0)


# config.json as the Hub publishes them (transformers 4 spellings, fields left to defaults)
HUB_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                          "image_size": 896, "intermediate_size": 4304,
                          "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                          "vision_use_head": False},
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "vocab_size": 262144,
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "sliding_window": 4096, "vocab_size": 256000,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_published_configs_parse_as_transformers_reads_them(name: str) -> None:
    import transformers

    raw = HUB_CONFIGS[name]
    ours = GemmaConfig.from_hf(raw)
    hf = transformers.AutoConfig.for_model(**raw)
    text = hf.get_text_config()
    for field, theirs in [
        ("vocab_size", text.vocab_size), ("hidden_size", text.hidden_size),
        ("intermediate_size", text.intermediate_size), ("num_layers", text.num_hidden_layers),
        ("num_heads", text.num_attention_heads), ("num_kv_heads", text.num_key_value_heads),
        ("head_dim", text.head_dim), ("rms_norm_eps", text.rms_norm_eps),
        ("query_pre_attn_scalar", text.query_pre_attn_scalar),
        ("final_logit_softcap", None if raw["model_type"] == "gemma3"
         else text.final_logit_softcapping),
        ("attn_logit_softcap", text.attn_logit_softcapping if raw["model_type"] == "gemma2"
         else None),
    ]:  # fmt: skip
        assert getattr(ours, field) == theirs, field
    windows = tuple(text.sliding_window if t == "sliding_attention" else None
                    for t in text.layer_types)  # fmt: skip
    assert ours.sliding_windows == windows
    params = text.rope_parameters
    full = params.get("full_attention", params)
    local = params.get("sliding_attention", params)
    assert (ours.rope.theta, ours.rope.rope_type) == (full["rope_theta"], full["rope_type"])
    assert (ours.local_rope.theta, ours.local_rope.rope_type) == (
        local["rope_theta"], local["rope_type"],
    )  # fmt: skip
    assert ours.rope.factor == full.get("factor", 1.0)
    assert ours.local_rope.factor == local.get("factor", 1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for gemma2"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["full_attention"]}, "layer_types must list 42"),
        ({"sliding_window": 0}, "sliding_window must be a positive int"),
        ({"attn_logit_softcapping": -1}, "'attn_logit_softcapping' must be null or > 0"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be > 0"),
    ],
)
def test_gemma_configs_the_decoder_cannot_serve_are_refused_naming_why(
    change: dict[str, Any], message: str
) -> None:
    from loraplane.dataplane.models import UnsupportedModelError
    from loraplane.dataplane.models.loader import parse_config

    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        parse_config({**HUB_CONFIGS["gemma-2-9b"], **change})


def test_an_image_text_gemma3_config_without_text_config_is_refused() -> None:
    from loraplane.dataplane.models import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="needs a text_config"):
        GemmaConfig.from_hf({"model_type": "gemma3", "vision_config": {}})
