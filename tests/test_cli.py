"""The `loraplane` command as a user runs it: exit codes, output, --json, --help, the demo."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.adapters.test_bad_corpus import BASE


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loraplane", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_validate_valid_adapter_prints_a_summary_and_exits_0(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    out = run(
        "adapters",
        "validate",
        str(peft_adapters["r8-patterns"]),
        "--base-model",
        str(tiny_llama_dir),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("valid: ")
    for field in ("rank        12 (per module: 4, 8, 12)", "alpha", "q_proj", "digest      sha256:",
                  "shapes checked"):  # fmt: skip
        assert field in out.stdout


def test_validate_rejected_adapter_exits_1_with_reason(peft_adapters: dict[str, Path]) -> None:
    out = run("adapters", "validate", str(peft_adapters["r64"]), "--max-rank", "16")
    assert out.returncode == 1
    assert out.stdout.strip() == "rejected: RankTooLarge: rank 64 exceeds max_lora_rank 16"


def test_validate_json_is_one_object_for_valid_and_rejected(tmp_path: Path) -> None:
    good = write_adapter(tmp_path / "good", lora_config(), lora_tensors(BASE, 8))
    archive = tmp_path / "good.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(good, arcname="my-adapter")
    ok = run("adapters", "validate", str(archive), "--json")
    assert ok.returncode == 0
    body = json.loads(ok.stdout)
    assert body["valid"] is True and body["code"] is None
    assert body["rank"] == 8 and len(body["digest"]) == 64
    bad = write_adapter(tmp_path / "bad", lora_config(use_dora=True), lora_tensors(BASE, 8))
    rejected = run("adapters", "validate", str(bad), "--json")
    assert rejected.returncode == 1
    assert json.loads(rejected.stdout) == {
        "valid": False,
        "code": "ShapeMismatch",
        "message": "layer 0 q_proj has no lora_magnitude_vector, but use_dora is"
        " true: a DoRA adapter carries one per adapted module",
    }


def test_validate_refuses_a_tensor_the_config_does_not_target(tmp_path: Path) -> None:
    """The adapter core's rule through the command: k_proj weights, but the config targets
    q_proj and v_proj only (vLLM refuses such an adapter too)."""
    tensors = lora_tensors(BASE, 8, modules=("q_proj", "k_proj", "v_proj"))
    bad = write_adapter(tmp_path / "bad", lora_config(), tensors)
    out = run("adapters", "validate", str(bad))
    assert out.returncode == 1
    assert out.stdout.startswith(
        "rejected: UnsupportedTargetModule: tensor "
        "'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight' adapts "
        "model.layers.0.self_attn.k_proj, which the config does not target"
    )
    body = json.loads(run("adapters", "validate", str(bad), "--json").stdout)
    assert (body["valid"], body["code"]) == (False, "UnsupportedTargetModule")


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run("adapters", "validate").returncode == 2
    missing = run("adapters", "validate", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad_rank = run("adapters", "validate", str(tmp_path), "--max-rank", "0")
    assert bad_rank.returncode == 2 and "not positive" in bad_rank.stderr
    bad_base = run("adapters", "validate", str(tmp_path), "--base-model", str(tmp_path))
    assert bad_base.returncode == 2 and "no config.json" in bad_base.stderr


def test_help_explains_exit_codes() -> None:
    out = run("adapters", "validate", "--help")
    assert out.returncode == 0
    assert "Exit 0: valid" in out.stdout and "--base-model" in out.stdout


def test_controlplane_help_lists_every_setting_with_its_default() -> None:
    from loraplane.controlplane.settings import Settings

    out = run("controlplane", "--help")
    assert out.returncode == 0
    for name in Settings.model_fields:
        assert f"LORAPLANE_{name.upper()} (default: " in out.stdout, name
    assert "LORAPLANE_DB_POOL_SIZE (default: 10)" in out.stdout


def test_ctrl_c_during_a_command_exits_130_saying_interrupted_without_a_traceback() -> None:
    """A control plane that accepts the connection and never answers: the tenant CLI waits in
    its request, and Ctrl-C (SIGINT) ends it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "loraplane", "adapters", "list", "--url", url,
             "--api-key", "lp_" + "k" * 40],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            conn, _ = silent.accept()  # the request has been sent: the CLI waits for an answer
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().endswith("interrupted"), err
    assert "Traceback" not in err, err
