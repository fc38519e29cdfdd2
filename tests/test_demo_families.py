"""`loraplane demo --family NAME`: the demo on another family's base model. Fast: each family's
recipe is a config the adapter core and the engine read as that family, with the adapters'
targets those modules; the default (Llama) build is the one it always was. Slow: `loraplane
demo --once --family qwen3` as a user runs it builds a Qwen3 and tours the running system."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.cli import build_parser
from loraplane.demo.families import FAMILIES, family
from loraplane.demo.train import MODEL_SHAPE
from loraplane.demo.workspace import BASE_NAME, Workspace, fingerprint

REPO = Path(__file__).resolve().parents[1]
# the Llama build's fingerprint before --family existed: a cached `make demo` build stays valid
LLAMA_FINGERPRINT = "a17bbaa61a91fedf19a78b2f7465df56e633f1dd45a228849fa891355a4d7fe2"


def test_the_default_family_is_the_demo_as_it_was() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.family == "llama"
    llama = FAMILIES["llama"]
    assert (llama.base_name, BASE_NAME, Workspace(Path("w")).base_name) == ("demo-llama",) * 3
    assert llama.shape == MODEL_SHAPE == {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    }  # fmt: skip
    assert fingerprint() == fingerprint(llama) == LLAMA_FINGERPRINT
    others = {fingerprint(f) for name, f in FAMILIES.items() if name != "llama"}
    assert len(others) == len(FAMILIES) - 1 and LLAMA_FINGERPRINT not in others


def test_an_unknown_family_is_refused_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["demo", "--family", "gpt2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "gpt2" in err and all(name in err for name in FAMILIES), err
    with pytest.raises(ValueError, match="family: unknown 'gpt2' \\(one of llama, qwen3"):
        family("gpt2")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_recipe_is_read_as_that_family_with_its_adapter_targets(name: str) -> None:
    """The config transformers writes for the recipe is the family to the adapter core and
    the engine, and every module the adapters target exists in it."""
    import transformers

    from loraplane.dataplane.models.loader import parse_config

    demo = FAMILIES[name]
    config = getattr(transformers, demo.config_class)(
        vocab_size=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **demo.shape
    ).to_dict()
    assert config["model_type"] == name
    spec = BaseModelSpec.from_config(config, demo.base_name)
    assert spec.model_type == name
    assert set(demo.target_modules) <= set(spec.modules), spec.modules
    for param in demo.target_parameters:  # the packed experts, on every sparse layer
        assert all(spec.has_module(layer, param) for layer in range(spec.num_layers)), param
    engine = parse_config(config)
    assert (engine.model_type, engine.num_layers, engine.hidden_size) == (name, 4, 128)


@pytest.mark.slow
def test_demo_once_on_a_qwen3_base_builds_it_and_tours_the_system(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "LORAPLANE_DATA_DIR": str(tmp_path / "state")}  # fmt: skip
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane", "demo", "--once", "--workdir", str(workdir),
         "--family", "qwen3", "--port", "0", "--controlplane-port", "0", "--access-log", "off"],
        capture_output=True, text=True, timeout=400, cwd=REPO, env=env,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "base model: Qwen3, 4 layers, hidden 128" in out
    config = json.loads((workdir / "qwen3" / "model" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == ("qwen3", 64)
    assert "POST /v1/pools demo: base model demo-qwen3" in out
    assert "-> 4 distinct replies from one base model" in out
    assert "12/12 replies are word for word what their adapter (or the base) was trained" in out
    assert "acme     GET /v1/models -> demo-qwen3, helpdesk-pirate" in out
    assert "422 RankTooLarge" in out and "422 BiasNotSupported" in out
    assert "tour done." in out
    assert not (workdir / "model").exists()  # the Llama build's folder is left alone
