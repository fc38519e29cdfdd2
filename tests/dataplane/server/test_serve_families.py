"""`loraplane serve` on a base model family the engine does not build: it refuses at start,
naming the family and the ones it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.demo.build import build_tokenizer
from tests.dataplane.server.conftest import spawn
from tests.servers import free_port


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [("gpt2", "GPT2LMHeadModel"), ("falcon", "FalconForCausalLM")],
)
def test_serve_refuses_an_unsupported_family_at_start_naming_it(
    model_type: str, architecture: str, tmp_path: Path
) -> None:
    build_tokenizer(tmp_path)
    config = {"model_type": model_type, "architectures": [architecture], "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    proc = spawn(["--model", str(tmp_path), "--port", str(free_port())])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"model_type {model_type!r} (architectures [{architecture!r}]) is not supported" in err
    assert "supported: llama, mistral, qwen2, qwen3, phi3" in err
