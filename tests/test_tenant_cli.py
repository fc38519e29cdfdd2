"""The tenant CLI against a real control plane over HTTP (uvicorn in a thread, SQLite, a local
store): the admin makes a tenant and keys, the tenant pushes, lists and reads versions; bad
adapters are refused before any request; big uploads wait for their background job."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter
from loraplane.cli import main
from loraplane.controlplane.main import create_app
from loraplane.tenant_cli.multipart import MultipartBody
from loraplane.tenant_cli.progress import Progress
from tests.adapters.crafting import TINY_BASE, lora_config, lora_tensors, write_adapter
from tests.controlplane.conftest import ADMIN, make_settings
from tests.servers import free_port, serve_in_thread

BASE_NAME = "tiny-base"
# peft_adapters["r16"] (~130 KB) is ingested at once; ["r64"] (~520 KB) in the background
BACKGROUND_BYTES = 300_000


@dataclass
class Run:
    """What one `loraplane ...` invocation did."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture(scope="module")
def controlplane(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[str]:
    """The control plane over HTTP, with a pool serving the tiny Llama as `tiny-base`."""
    tmp = tmp_path_factory.mktemp("controlplane")
    settings = make_settings(
        tmp, f"sqlite:///{tmp / 'catalog.db'}", background_ingest_bytes=BACKGROUND_BYTES
    )
    app = create_app(settings)
    try:
        with serve_in_thread(app) as url:
            pool = {"name": "pool-a", "base_model": {"name": BASE_NAME, "uri": str(tiny_llama_dir)}}
            r = httpx.post(
                url + "/v1/pools", json=pool, headers={"Authorization": f"Bearer {ADMIN}"}
            )
            assert r.status_code == 201, r.text
            yield url
    finally:
        app.state.ctx.close()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, controlplane: str) -> pytest.MonkeyPatch:
    """The CLI's environment: the control plane's URL and the admin token, no tenant key."""
    monkeypatch.setenv("LORAPLANE_URL", controlplane)
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)
    return monkeypatch


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> Run:
    """Run `loraplane ARGS` in this process (its requests go over HTTP)."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse: usage errors and --help
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def new_tenant(capsys: pytest.CaptureFixture[str], name: str) -> str:
    """Create a tenant and a key through the CLI; the key."""
    assert cli(capsys, "tenants", "create", name).code == 0
    made = cli(capsys, "keys", "create", "--tenant", name, "--label", "ci", "--json")
    assert made.code == 0, made.err
    key: str = made.json()["key"]
    return key


def local_digest(path: Path) -> str:
    with open_adapter_source(path, AdapterLimits()) as files:
        adapter = validate_adapter(files, None, AdapterLimits())
        try:
            return canonical_digest(adapter)
        finally:
            adapter.close()


def test_admin_makes_a_tenant_and_key_and_the_tenant_pushes_lists_and_reads_versions(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], peft_adapters: dict[str, Path]
) -> None:
    env.setenv("LORAPLANE_API_KEY", new_tenant(capsys, "acme"))
    tenants = cli(capsys, "tenants", "list", "--json")
    assert "acme" in {t["name"] for t in tenants.json()}

    src = peft_adapters["r16"]
    pushed = cli(
        capsys, "adapters", "push", str(src), "--name", "support", "--base-model", BASE_NAME
    )
    assert pushed.code == 0, pushed.err
    digest = local_digest(src)
    assert pushed.out.startswith("pushed: support v1 (new version)\n")
    assert f"  digest      sha256:{digest}\n" in pushed.out
    assert "  rank        16 (alpha 32)" in pushed.out and pushed.err == ""

    again = cli(capsys, "adapters", "push", str(src), "--name", "support",
                "--base-model", BASE_NAME, "--json")  # fmt: skip
    assert again.code == 0
    body = again.json()
    assert (body["created"], body["version"]["version"], body["version"]["digest"]) == (
        False, 1, digest,
    )  # fmt: skip
    second = cli(capsys, "adapters", "push", str(peft_adapters["r4"]), "--name", "support",
                 "--base-model", BASE_NAME, "--json")  # fmt: skip
    assert (second.code, second.json()["version"]["version"]) == (0, 2)

    listed = cli(capsys, "adapters", "list", "--json").json()
    assert [(a["name"], a["current_version"], a["latest_version"]) for a in listed] == [
        ("support", 2, 2)
    ]
    table = cli(capsys, "adapters", "list").out.splitlines()
    assert table[0].split() == [
        "NAME", "SERVING", "LATEST", "RANK", "BASE", "MODEL", "DIGEST", "MODE",
    ]  # fmt: skip
    assert table[1].split()[:4] == ["support", "v2", "v2", "4"]
    assert table[1].split()[-1] == "follow-latest"
    versions = cli(capsys, "adapters", "versions", "support", "--json").json()
    assert [(v["version"], v["rank"]) for v in versions] == [(1, 16), (2, 4)]
    assert versions[0]["digest"] == digest
    human = cli(capsys, "adapters", "versions", "support").out
    assert f"sha256:{digest[:12]}" in human and "tenant:acme/key:lp_" in human
    missing = cli(capsys, "adapters", "versions", "nope")
    assert missing.code == 1 and missing.err.startswith("error: NotFound: ")


def test_an_invalid_adapter_is_refused_locally_and_nothing_is_sent(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Nothing listens at this URL: a request would end in ConnectionFailed (exit 2).
    env.setenv("LORAPLANE_URL", f"http://127.0.0.1:{free_port()}")
    env.setenv("LORAPLANE_API_KEY", "lp_not-needed")
    dora = write_adapter(tmp_path / "dora", lora_config(use_dora=True), lora_tensors(TINY_BASE, 8))
    run = cli(capsys, "adapters", "push", str(dora), "--name", "x", "--base-model", BASE_NAME)
    assert (run.code, run.out) == (1, "")
    # DoRA is served, but each module needs its magnitude vector: these weights have none
    assert run.err == (
        "rejected: ShapeMismatch: layer 0 q_proj has no lora_magnitude_vector, but use_dora is"
        " true: a DoRA adapter carries one per adapted module\n"
    )
    as_json = cli(capsys, "adapters", "push", str(dora), "--name", "x", "--base-model", BASE_NAME,
                  "--json")  # fmt: skip
    assert as_json.code == 1 and as_json.err == ""
    assert as_json.json() == {
        "error": {
            "code": "ShapeMismatch",
            "message": "layer 0 q_proj has no lora_magnitude_vector, but use_dora is"
            " true: a DoRA adapter carries one per adapted module",
        }
    }
    # the intake rule: weights for a module the config does not target
    extra = lora_tensors(TINY_BASE, 8, modules=("q_proj", "k_proj", "v_proj"))
    untargeted = write_adapter(tmp_path / "untargeted", lora_config(), extra)
    run = cli(capsys, "adapters", "push", str(untargeted), "--name", "x", "--base-model", "b")
    assert run.code == 1 and run.err.startswith("rejected: UnsupportedTargetModule: tensor ")
    # the negative control: a valid adapter does try to connect
    good = write_adapter(tmp_path / "good", lora_config(), lora_tensors(TINY_BASE, 8))
    run = cli(capsys, "adapters", "push", str(good), "--name", "x", "--base-model", "b", "--json")
    assert run.code == 2 and run.json()["error"]["code"] == "ConnectionFailed"


def test_a_big_push_waits_for_its_background_job(
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    peft_adapters: dict[str, Path],
    controlplane: str,
    tmp_path: Path,
) -> None:
    key = new_tenant(capsys, "bigco")
    env.setenv("LORAPLANE_API_KEY", key)
    src = peft_adapters["r64"]
    assert sum(p.stat().st_size for p in src.iterdir()) > BACKGROUND_BYTES
    run = cli(capsys, "adapters", "push", str(src), "--name", "big", "--base-model", BASE_NAME,
              "--json")  # fmt: skip
    assert run.code == 0, run.out
    assert run.json()["version"]["digest"] == local_digest(src)
    jobs = httpx.get(controlplane + "/v1/uploads", headers={"Authorization": f"Bearer {key}"})
    assert [(j["name"], j["status"]) for j in jobs.json()] == [("big", "succeeded")]
    # valid here, refused by the job: shapes of another base model (checked on the server)
    other = BaseModelSpec.from_config(
        {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4}, "other",
    )  # fmt: skip
    wrong = write_adapter(tmp_path / "wrong", lora_config(r=64), lora_tensors(other, 64))
    assert sum(p.stat().st_size for p in wrong.iterdir()) > BACKGROUND_BYTES
    run = cli(capsys, "adapters", "push", str(wrong), "--name", "wrong", "--base-model", BASE_NAME)
    assert run.code == 1
    assert run.err.startswith("rejected: ShapeMismatch: layer 0 q_proj: ")
    jobs = httpx.get(controlplane + "/v1/uploads", headers={"Authorization": f"Bearer {key}"})
    assert {j["name"]: j["status"] for j in jobs.json()} == {"big": "succeeded", "wrong": "failed"}


def test_a_wrong_key_gets_the_401_message_and_exit_1(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.setenv("LORAPLANE_API_KEY", "lp_" + "x" * 43)  # a key's shape, but no key
    run = cli(capsys, "adapters", "list")
    assert (run.code, run.out) == (1, "")
    assert run.err == "error: Unauthorized: invalid or revoked API key\n"
    run = cli(capsys, "adapters", "list", "--json")
    assert run.json() == {
        "error": {"code": "Unauthorized", "message": "invalid or revoked API key"}
    }
    wrong_admin = cli(capsys, "tenants", "list", "--admin-token", "not-the-token")
    assert wrong_admin.code == 1
    assert wrong_admin.err == "error: Unauthorized: this route needs the admin token\n"


def test_a_revoked_key_stops_working(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = new_tenant(capsys, "initech")
    listed = cli(capsys, "keys", "list", "--tenant", "initech", "--json").json()
    assert [(k["name"], k["revoked_at"]) for k in listed] == [("ci", None)]
    assert key.startswith(listed[0]["prefix"])
    assert cli(capsys, "adapters", "list", "--api-key", key, "--json").json() == []

    revoked = cli(capsys, "keys", "revoke", "--tenant", "initech", str(listed[0]["id"]), "--yes")
    assert revoked.code == 0
    assert revoked.out == f"revoked: key {listed[0]['id']} of initech\n"
    run = cli(capsys, "adapters", "list", "--api-key", key)
    assert run.code == 1 and "Unauthorized: invalid or revoked API key" in run.err
    table = cli(capsys, "keys", "list", "--tenant", "initech").out.splitlines()
    assert table[1].split()[-1] == "revoked"
    again = cli(capsys, "keys", "revoke", "--tenant", "nobody", "1", "--yes")
    assert again.code == 1 and again.err.startswith("error: NotFound: ")


def test_the_admin_sets_a_tenants_weight_and_quotas_at_create_and_by_update(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], controlplane: str
) -> None:
    made = cli(capsys, "tenants", "create", "heavy", "--weight", "2.5", "--max-rank", "8")
    assert made.code == 0, made.err
    lines = made.out.splitlines()
    assert lines[0] == "created: tenant heavy"
    assert "  weight                2.5" in lines and "  max_rank              8" in lines
    plain = cli(capsys, "tenants", "create", "light", "--json").json()
    assert plain["weight"] == 1.0

    updated = cli(capsys, "tenants", "update", "heavy", "--weight", "4", "--json")
    assert updated.code == 0, updated.err
    assert (updated.json()["weight"], updated.json()["max_rank"]) == (4.0, 8)  # rank kept
    run = cli(capsys, "tenants", "update", "heavy", "--requests-per-minute", "30")
    assert run.code == 0 and run.out.splitlines()[0] == "updated: tenant heavy"
    assert "  weight                4" in run.out.splitlines()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    stored = httpx.get(controlplane + "/v1/tenants/heavy", headers=admin).json()
    assert (stored["weight"], stored["requests_per_minute"], stored["max_rank"]) == (4.0, 30, 8)

    table = cli(capsys, "tenants", "list").out.splitlines()
    assert table[0].split()[:2] == ["NAME", "WEIGHT"]
    rows = {line.split()[0]: line.split()[1] for line in table[1:]}
    assert (rows["heavy"], rows["light"]) == ("4", "1")


def test_a_bad_weight_or_update_is_refused_with_a_clear_error(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], controlplane: str
) -> None:
    assert cli(capsys, "tenants", "create", "bounded").code == 0
    for bad in ("0", "-1", "heavy", "nan", "inf"):
        run = cli(capsys, "tenants", "update", "bounded", "--weight", bad)
        assert run.code == 2 and "argument --weight: " in run.err, (bad, run.err)
    # past the control plane's bound: its refusal, naming the field
    run = cli(capsys, "tenants", "update", "bounded", "--weight", "1001")
    assert (run.code, run.out) == (1, "")
    assert run.err == (
        "error: InvalidRequest: weight: must be a number greater than 0 and at most 1000 "
        "(got 1001.0)\n"
    )
    as_json = cli(capsys, "tenants", "create", "toobig", "--weight", "5000", "--json")
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "InvalidRequest"
    nothing = cli(capsys, "tenants", "update", "bounded", "--json")
    assert nothing.code == 2
    assert nothing.json()["error"]["message"].startswith("nothing to change: pass at least one")
    missing = cli(capsys, "tenants", "update", "nobody", "--weight", "2")
    assert missing.code == 1 and missing.err == "error: NotFound: tenant 'nobody' not found\n"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    names = {t["name"] for t in httpx.get(controlplane + "/v1/tenants", headers=admin).json()}
    assert "toobig" not in names
    assert httpx.get(controlplane + "/v1/tenants/bounded", headers=admin).json()["weight"] == 1.0


def test_usage_errors_exit_2(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    no_key = cli(capsys, "adapters", "list")
    assert no_key.code == 2
    assert (
        no_key.err == "error: InvalidUsage: no API key: set LORAPLANE_API_KEY or pass --api-key\n"
    )
    env.setenv("LORAPLANE_API_KEY", "lp_x")
    missing = cli(capsys, "adapters", "push", str(tmp_path / "nope"), "--name", "a",
                  "--base-model", "b", "--json")  # fmt: skip
    assert missing.code == 2 and missing.json()["error"]["code"] == "InvalidUsage"
    assert cli(capsys, "adapters", "push", str(tmp_path), "--name", "a").code == 2  # argparse
    env.delenv("LORAPLANE_ADMIN_TOKEN")
    assert cli(capsys, "keys", "list", "--tenant", "acme").code == 2
    assert cli(capsys, "keys", "revoke", "--tenant", "acme", "zero").code == 2


@pytest.mark.parametrize(
    "command",
    [
        ["adapters", "push"], ["adapters", "list"], ["adapters", "versions"],
        ["keys", "create"], ["keys", "list"], ["keys", "revoke"],
        ["tenants", "create"], ["tenants", "update"], ["tenants", "list"],
    ],
    ids=lambda c: "-".join(c),
)  # fmt: skip
def test_every_command_help_says_what_it_does_the_env_vars_an_example_and_exit_codes(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    run = cli(capsys, *command, "--help")
    assert run.code == 0
    env_var = "LORAPLANE_ADMIN_TOKEN" if command[0] != "adapters" else "LORAPLANE_API_KEY"
    for text in ("LORAPLANE_URL", env_var, f"example:\n  loraplane {' '.join(command)}",
                 "Exit 0: done", "Exit 1: refused", "Exit 2: usage error", "--json"):  # fmt: skip
        assert text in run.out, text


def test_the_installed_command_reads_its_environment(controlplane: str) -> None:
    env = {**os.environ, "LORAPLANE_URL": controlplane, "LORAPLANE_ADMIN_TOKEN": ADMIN}
    done = subprocess.run(
        [sys.executable, "-m", "loraplane", "tenants", "create", "umbrella", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "umbrella"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    bar = Progress("x:", 100, quiet)
    bar.advance(100)
    bar.close()
    assert quiet.getvalue() == ""
    tty = _Terminal()
    bar = Progress("x:", 4 << 20, tty)
    bar.advance(1 << 20)
    bar.advance(3 << 20)
    bar.status("waiting")
    bar.close()
    frames = tty.getvalue().split("\r")
    assert "100%" in frames[-2] and "4.0 MiB/4.0 MiB" in frames[-2]
    assert frames[-1].startswith("x: waiting") and frames[-1].endswith("\n")
    assert len(frames[-1]) > len(frames[-2].rstrip())  # a shorter line blanks the longer one


def test_the_multipart_body_is_as_long_as_it_says(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.bin"
    a.write_text("{}")
    b.write_bytes(bytes(range(256)) * 5000)
    seen: list[int] = []
    body = MultipartBody({"name": "n", "base_model": "m"}, "files", [a, b], seen.append)
    data = b"".join(body)
    assert len(data) == len(body) and sum(seen) == 2 + 256 * 5000
    assert data.endswith(f"--{body.boundary}--\r\n".encode())


def test_without_httpx_the_commands_say_what_to_install(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.setitem(sys.modules, "httpx", None)  # `import httpx` now raises ImportError
    # imported again under the missing httpx (whether an earlier test imported it or not)
    env.delitem(sys.modules, "loraplane.tenant_cli.client", raising=False)
    run = cli(capsys, "tenants", "list", "--json")
    assert run.code == 2
    error = run.json()["error"]
    assert error["code"] == "MissingDependency" and "loraplane[client]" in error["message"]
