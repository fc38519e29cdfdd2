"""The tenant CLI's lifecycle and admin commands against a real control plane over HTTP:
`adapters serve|rollback|follow-latest|delete`, `tenants delete`, `pools ...`, and the
confirmation that every destructive or production-changing command asks for (a real
pseudo-terminal included)."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loraplane.adapters.base_model import BaseModelSpec
from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.test_tenant_cli import BASE_NAME, Run, cli, controlplane, env, new_tenant

__all__ = ["controlplane", "env"]  # the fixtures, shared with tests/test_tenant_cli.py

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
Maker = Callable[[int], Path]  # seed -> an adapter folder


class _Terminal(io.StringIO):
    """stdin as a terminal that answers with the text given."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def make_adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Maker:
    """seed -> an adapter folder of the pool's base model, distinct content per seed."""
    spec = BaseModelSpec.from_dir(tiny_llama_dir, BASE_NAME)
    root = tmp_path_factory.mktemp("lifecycle-adapters")

    def make(seed: int) -> Path:
        out = root / f"s{seed}"
        if not out.exists():
            write_adapter(out, lora_config(r=4), lora_tensors(spec, 4, seed=seed))
        return out

    return make


def push(capsys: pytest.CaptureFixture[str], make: Maker, name: str, seed: int) -> Run:
    run = cli(capsys, "adapters", "push", str(make(seed)), "--name", name,
              "--base-model", BASE_NAME)  # fmt: skip
    assert run.code == 0, run.err
    return run


def resolved(url: str, key: str, model: str) -> int | None:
    """The version the data plane would load for `model` (None: not found)."""
    r = httpx.get(
        url + "/internal/v1/resolve",
        params={"model": model},
        headers={"Authorization": f"Bearer {SERVICE}", "X-Tenant-Key": key},
    )
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    version: int = r.json()["version"]
    return version


def test_serve_holds_a_version_across_pushes_and_follow_latest_undoes_it(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str,
) -> None:  # fmt: skip
    key = new_tenant(capsys, "servers")
    env.setenv("LORAPLANE_API_KEY", key)
    push(capsys, make_adapter, "bot", 1)
    push(capsys, make_adapter, "bot", 2)

    run = cli(capsys, "adapters", "serve", "bot", "1", "--yes")
    assert run.code == 0, run.err
    assert run.out == (
        "serving: bot v1, held (pushes do not change it; latest v2; follow the latest again "
        "with `loraplane adapters follow-latest bot`)\n"
    )
    assert resolved(controlplane, key, "bot") == 1
    third = push(capsys, make_adapter, "bot", 3)
    assert third.out.startswith("pushed: bot v3 (new version)\n")
    assert (  # the push says v1 still serves, and how to serve the new one
        "  serving     v1 (held: v3 is stored, not served; serve it with `loraplane adapters "
        "serve bot 3` or `loraplane adapters follow-latest bot`)\n"
    ) in third.out
    assert resolved(controlplane, key, "bot") == 1
    versions = cli(capsys, "adapters", "versions", "bot").out.splitlines()
    assert versions[0].split()[:3] == ["VERSION", "SERVING", "DIGEST"]
    assert [line.split()[:2] for line in versions[1:]] == [["v1", "yes"], ["v2", "-"], ["v3", "-"]]
    table = cli(capsys, "adapters", "list").out.splitlines()
    assert table[0].split()[-1] == "MODE"
    assert table[1].split()[:3] == ["bot", "v1", "v3"] and table[1].split()[-1] == "held"

    back = cli(capsys, "adapters", "follow-latest", "bot", "--yes", "--json")
    assert back.code == 0, back.err
    body = back.json()
    human = cli(capsys, "adapters", "follow-latest", "bot", "--yes")
    assert human.out == (
        "serving: bot v3, following the latest (each push serves its new version)\n"
    )
    assert (body["current_version"], body["latest_version"], body["follow_latest"]) == (3, 3, True)
    assert resolved(controlplane, key, "bot") == 3
    fourth = push(capsys, make_adapter, "bot", 4)
    assert "  serving     v4\n" in fourth.out
    assert resolved(controlplane, key, "bot") == 4
    assert cli(capsys, "adapters", "list").out.splitlines()[1].split()[-1] == "follow-latest"

    v2 = cli(capsys, "adapters", "serve", "bot", "v2", "--yes", "--json")  # "v2" reads as 2
    assert (v2.code, v2.json()["current_version"]) == (0, 2)
    missing = cli(capsys, "adapters", "serve", "bot", "9", "--yes")
    assert missing.code == 1
    assert missing.err == "error: NotFound: adapter 'bot' has no version 9; its versions: v1-v4\n"
    assert cli(capsys, "adapters", "serve", "bot", "0", "--yes").code == 2  # argparse
    latest = cli(capsys, "adapters", "serve", "bot", "latest")
    assert latest.code == 2 and latest.err.rstrip().endswith(
        "'latest' is not a version (1, 2, ... or v1, v2, ...); to serve the newest version and "
        "follow pushes: loraplane adapters follow-latest NAME"
    )
    nobody = cli(capsys, "adapters", "follow-latest", "nobody", "--yes")
    assert nobody.code == 1 and nobody.err == "error: NotFound: adapter 'nobody' not found\n"


def test_rollback_serves_the_version_before_and_says_when_there_is_none(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str,
) -> None:  # fmt: skip
    key = new_tenant(capsys, "rollers")
    env.setenv("LORAPLANE_API_KEY", key)
    for seed in (1, 2, 3):
        push(capsys, make_adapter, "bot", seed)
    run = cli(capsys, "adapters", "rollback", "bot", "--yes")
    assert run.code == 0, run.err
    assert run.out.startswith("serving: bot v2, held (pushes do not change it; latest v3;")
    assert resolved(controlplane, key, "bot") == 2
    push(capsys, make_adapter, "bot", 4)  # v4 arrives: the rollback holds
    assert resolved(controlplane, key, "bot") == 2
    again = cli(capsys, "adapters", "rollback", "bot", "--yes", "--json")
    assert (again.code, again.json()["current_version"]) == (0, 1)
    oldest = cli(capsys, "adapters", "rollback", "bot", "--yes")
    assert (oldest.code, oldest.out) == (1, "")
    assert oldest.err == (
        "error: NoEarlierVersion: bot serves v1, its oldest version: there is no earlier "
        "version to roll back to (see: loraplane adapters versions bot)\n"
    )
    as_json = cli(capsys, "adapters", "rollback", "bot", "--yes", "--json")
    assert as_json.json()["error"]["code"] == "NoEarlierVersion"
    assert resolved(controlplane, key, "bot") == 1


def test_the_quota_message_names_a_delete_command_that_works(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str,
) -> None:  # fmt: skip
    key = new_tenant(capsys, "tight")
    assert cli(capsys, "tenants", "update", "tight", "--max-adapters", "1").code == 0
    env.setenv("LORAPLANE_API_KEY", key)
    push(capsys, make_adapter, "first", 1)
    full = cli(capsys, "adapters", "push", str(make_adapter(2)), "--name", "second",
               "--base-model", BASE_NAME)  # fmt: skip
    assert full.code == 1 and full.err.startswith("error: QuotaExceeded: ")
    named = re.search(r"`loraplane (adapters delete NAME)`", full.err)
    assert named is not None, full.err
    words = named.group(1).replace("NAME", "first").split()

    run = cli(capsys, *words, "--yes")
    assert run.code == 0, run.err
    assert run.out == (
        "deleted: adapter first (no longer served; it no longer counts against max_adapters)\n"
    )
    assert resolved(controlplane, key, "first") is None
    assert cli(capsys, "adapters", "list").out == "no adapters\n"
    push(capsys, make_adapter, "second", 2)  # the place is free
    gone = cli(capsys, "adapters", "delete", "first", "--yes", "--json")
    assert gone.code == 1 and gone.json()["error"]["code"] == "NotFound"


# -- confirmation ---------------------------------------------------------------------------------


@pytest.fixture
def stocked(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str, request: pytest.FixtureRequest,
) -> dict[str, str]:  # fmt: skip
    """A fresh tenant with a key and adapter `bot` (v1, v2: serving v2)."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-40:].strip("-")
    key = new_tenant(capsys, name)
    env.setenv("LORAPLANE_API_KEY", key)
    push(capsys, make_adapter, "bot", 1)
    push(capsys, make_adapter, "bot", 2)
    return {"tenant": name, "key": key}


def _state(url: str, s: dict[str, str]) -> tuple[object, ...]:
    """What the confirmed commands would change: the adapter, the tenant, its key."""
    key_h = {"Authorization": f"Bearer {s['key']}"}
    adapter = httpx.get(url + "/v1/adapters/bot", headers=key_h)
    listed = httpx.get(url + f"/v1/tenants/{s['tenant']}/keys", headers=ADMIN_H)
    keys = listed.json() if listed.status_code == 200 else []  # a deleted tenant: 404
    tenant = httpx.get(url + f"/v1/tenants/{s['tenant']}", headers=ADMIN_H)
    body = adapter.json() if adapter.status_code == 200 else {}
    return (
        adapter.status_code,
        body.get("current_version"),
        body.get("follow_latest"),
        tenant.status_code,
        tuple(k["revoked_at"] is None for k in keys),
    )


CONFIRMED = {
    "adapters-delete": ["adapters", "delete", "bot"],
    "adapters-serve": ["adapters", "serve", "bot", "1"],
    "adapters-rollback": ["adapters", "rollback", "bot"],
    "adapters-follow-latest": ["adapters", "follow-latest", "bot"],
    "tenants-delete": ["tenants", "delete", "{tenant}"],
    "keys-revoke": ["keys", "revoke", "--tenant", "{tenant}", "{key_id}"],
}


def _args(s: dict[str, str], url: str, command: str) -> list[str]:
    keys = httpx.get(url + f"/v1/tenants/{s['tenant']}/keys", headers=ADMIN_H).json()
    return [a.format(tenant=s["tenant"], key_id=keys[0]["id"]) for a in CONFIRMED[command]]


@pytest.mark.parametrize("command", list(CONFIRMED))
def test_without_a_terminal_and_without_yes_nothing_changes_and_exit_is_1(
    command: str, stocked: dict[str, str], capsys: pytest.CaptureFixture[str],
    controlplane: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    args = _args(stocked, controlplane, command)
    if command == "adapters-follow-latest":  # make it a change: serve v1 first
        assert cli(capsys, "adapters", "serve", "bot", "1", "--yes").code == 0
    before = _state(controlplane, stocked)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # a pipe: never read as an answer
    run = cli(capsys, *args)
    assert (run.code, run.out) == (1, "")
    assert run.err == (
        "error: ConfirmationRequired: this command needs confirmation and stdin is not a "
        "terminal, so nothing was asked and nothing changed: pass --yes to confirm\n"
    )
    as_json = cli(capsys, *args, "--json")
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "ConfirmationRequired"
    assert _state(controlplane, stocked) == before
    assert sys.stdin.read() == "y\n"  # nothing was read

    done = cli(capsys, *args, "--yes")
    assert done.code == 0, done.err
    assert _state(controlplane, stocked) != before


@pytest.mark.parametrize("command", list(CONFIRMED))
def test_on_a_terminal_the_command_asks_and_only_yes_goes_on(
    command: str, stocked: dict[str, str], capsys: pytest.CaptureFixture[str],
    controlplane: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    args = _args(stocked, controlplane, command)
    if command == "adapters-follow-latest":
        assert cli(capsys, "adapters", "serve", "bot", "1", "--yes").code == 0
    before = _state(controlplane, stocked)
    for answer in ("\n", "n\n", "no\n", "yess\n", ""):  # Enter, no, anything else, end of input
        monkeypatch.setattr(sys, "stdin", _Terminal(answer))
        run = cli(capsys, *args, "--json")
        assert run.code == 1, (answer, run.err)
        assert run.json() == {
            "error": {"code": "Cancelled", "message": "not confirmed: nothing changed"}
        }
        assert run.err.rstrip("\n").endswith(" [y/N] "), run.err  # asked on stderr
        assert _state(controlplane, stocked) == before
    monkeypatch.setattr(sys, "stdin", _Terminal("Y\n"))
    done = cli(capsys, *args)
    assert done.code == 0, done.err
    assert done.err.endswith(" [y/N] ")
    assert _state(controlplane, stocked) != before


def test_each_question_says_what_will_change(
    stocked: dict[str, str], capsys: pytest.CaptureFixture[str], controlplane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    questions = {}
    for command in CONFIRMED:
        monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
        if command == "adapters-follow-latest":
            assert cli(capsys, "adapters", "serve", "bot", "1", "--yes").code == 0
            monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
        questions[command] = cli(capsys, *_args(stocked, controlplane, command)).err
    t = stocked["tenant"]
    assert questions["adapters-delete"].startswith(
        "Delete adapter bot (serving v2)? Requests for it fail from now on; its versions stay "
        "stored, and pushing the name again starts it afresh. [y/N] "
    )
    assert questions["adapters-serve"].startswith(
        "Serve bot v1 instead of v2, and keep serving it when new versions are pushed? [y/N] "
    )
    assert questions["adapters-rollback"].startswith(
        "Roll bot back from v2 to v1, and keep serving v1 when new versions are pushed? [y/N] "
    )
    assert questions["adapters-follow-latest"].startswith(
        "Serve bot's latest version v2 (now v1), and each new version when it is pushed? [y/N] "
    )
    assert questions["tenants-delete"].startswith(
        f"Delete tenant {t}? Its 1 live key(s) are revoked and its adapters stop serving at "
        "once; the name cannot be used again. [y/N] "
    )
    assert re.match(
        rf"Revoke key \d+ \(ci, lp_[\w-]+…\) of {t}\? Requests with it fail at once; this cannot "
        r"be undone\. \[y/N\] ",
        questions["keys-revoke"],
    ), questions["keys-revoke"]
    for err in questions.values():
        assert err.endswith("error: Cancelled: not confirmed: nothing changed\n")
        assert stocked["key"] not in err


def test_nothing_to_change_asks_nothing(
    stocked: dict[str, str], capsys: pytest.CaptureFixture[str], controlplane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Following already, serving that version already, a missing version or key: no
    question on the terminal (the control plane answers, or refuses with its reason)."""
    monkeypatch.setattr(sys, "stdin", _Terminal(""))  # any question would be answered "no"
    follow = cli(capsys, "adapters", "follow-latest", "bot")
    assert (follow.code, follow.err) == (0, "")
    missing = cli(capsys, "adapters", "serve", "bot", "7")
    assert missing.code == 1 and missing.err.startswith("error: NotFound: ")
    assert "[y/N]" not in missing.err
    no_key = cli(capsys, "keys", "revoke", "--tenant", stocked["tenant"], "999999")
    assert no_key.code == 1 and no_key.err.startswith("error: NotFound: ")
    assert cli(capsys, "tenants", "delete", "nobody-here").err == (
        "error: NotFound: tenant 'nobody-here' not found\n"
    )


def test_a_real_terminal_is_asked_and_answered(stocked: dict[str, str], controlplane: str) -> None:
    """`loraplane adapters delete` with a pseudo-terminal as stdin: it asks, reads `y`."""
    environ = {**os.environ, "LORAPLANE_URL": controlplane, "LORAPLANE_API_KEY": stocked["key"]}
    primary, secondary = pty.openpty()
    try:
        os.write(primary, b"y\n")  # typed ahead: the terminal holds the line until read
        done = subprocess.run(
            [sys.executable, "-m", "loraplane", "adapters", "delete", "bot"],
            stdin=secondary, capture_output=True, text=True, timeout=120, env=environ,
        )  # fmt: skip
    finally:
        os.close(secondary)
        os.close(primary)
    assert done.returncode == 0, done.stderr
    assert "Delete adapter bot (serving v2)? " in done.stderr and "[y/N]" in done.stderr
    assert done.stdout.startswith("deleted: adapter bot ")
    key_h = {"Authorization": f"Bearer {stocked['key']}"}
    assert httpx.get(controlplane + "/v1/adapters/bot", headers=key_h).status_code == 404


# -- admin: tenants and pools ---------------------------------------------------------------------


def test_tenants_delete_revokes_its_keys_and_the_name_stays_taken(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str,
) -> None:  # fmt: skip
    key = new_tenant(capsys, "leaving")
    env.setenv("LORAPLANE_API_KEY", key)
    push(capsys, make_adapter, "bot", 1)
    run = cli(capsys, "tenants", "delete", "leaving", "--yes")
    assert run.code == 0, run.err
    assert run.out == "deleted: tenant leaving (1 key(s) revoked, adapters no longer served)\n"
    refused = cli(capsys, "adapters", "list")
    assert refused.code == 1 and "Unauthorized" in refused.err
    assert "leaving" not in {t["name"] for t in cli(capsys, "tenants", "list", "--json").json()}
    again = cli(capsys, "tenants", "delete", "leaving", "--yes")
    assert again.code == 1 and again.err.startswith("error: NotFound: ")


def test_tenants_update_edits_quotas_through_the_patch_route(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], controlplane: str
) -> None:
    assert cli(capsys, "tenants", "create", "quotas").code == 0
    run = cli(capsys, "tenants", "update", "quotas", "--max-adapters", "3", "--max-rank", "8",
              "--max-bytes", "1048576", "--tokens-per-minute", "5000", "--json")  # fmt: skip
    assert run.code == 0, run.err
    stored = httpx.get(controlplane + "/v1/tenants/quotas", headers=ADMIN_H).json()
    assert (stored["max_adapters"], stored["max_rank"], stored["max_bytes"],
            stored["tokens_per_minute"]) == (3, 8, 1048576, 5000)  # fmt: skip
    assert run.json() == stored


def test_pools_are_listed_shown_created_updated_and_deleted(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path,
    controlplane: str,
) -> None:  # fmt: skip
    made = cli(capsys, "pools", "create", "pool-b", "--namespace", "team-b",
               "--base-model", "tiny-b", "--base-model-uri", str(tiny_llama_dir),
               "--max-lora-rank", "16", "--max-loras", "4")  # fmt: skip
    assert made.code == 0, made.err
    lines = made.out.splitlines()
    assert lines[0] == "created: pool team-b/pool-b"
    assert lines[1] == f"  base model      tiny-b ({tiny_llama_dir})"
    assert "  model config    llama" in lines and "  max_lora_rank   16" in lines
    assert "  max_loras       4" in lines and "  max_cpu_loras   32" in lines
    assert "  max_cpu_lora_bytes  none" in lines  # no byte limit unless given
    pending = cli(capsys, "pools", "create", "pool-c", "--base-model", "tiny-c", "--base-model-uri",
                  "/models/tiny-c", "--config-from-replicas", "--json")  # fmt: skip
    assert pending.code == 0, pending.err
    assert pending.json()["base_model_config"] is None

    table = cli(capsys, "pools", "list").out.splitlines()
    assert table[0].split()[:4] == ["NAMESPACE", "NAME", "BASE", "MODEL"]
    rows = {tuple(line.split()[:2]): line.split() for line in table[1:]}
    assert rows[("team-b", "pool-b")][2:] == ["tiny-b", "yes", "16", "4", "32", "0"]
    assert rows[("default", "pool-c")][3] == "pending"
    shown = cli(capsys, "pools", "show", "pool-b", "--namespace", "team-b", "--json")
    assert (shown.json()["name"], shown.json()["max_loras"]) == ("pool-b", 4)
    wrong_ns = cli(capsys, "pools", "show", "pool-b")  # it is not in "default"
    assert wrong_ns.code == 1 and wrong_ns.err.startswith("error: NotFound: ")

    updated = cli(capsys, "pools", "update", "pool-b", "--namespace", "team-b",
                  "--max-loras", "6")  # fmt: skip
    assert updated.code == 0, updated.err
    assert "  max_loras       6" in updated.out and "  max_lora_rank   16" in updated.out
    sized = cli(capsys, "pools", "update", "pool-b", "--namespace", "team-b",
                "--max-cpu-lora-bytes", "512MiB", "--json")  # fmt: skip
    assert sized.code == 0, sized.err
    assert (sized.json()["max_cpu_lora_bytes"], sized.json()["max_loras"]) == (512 << 20, 6)
    bad = cli(capsys, "pools", "update", "pool-b", "--max-cpu-lora-bytes", "half")
    assert bad.code == 2 and "must be a size such as 8GiB" in bad.err
    nothing = cli(capsys, "pools", "update", "pool-b", "--namespace", "team-b")
    assert nothing.code == 2 and "nothing to change: pass at least one of --max-lora-rank" in (
        nothing.err
    )

    unconfirmed = cli(capsys, "pools", "delete", "pool-b", "--namespace", "team-b")
    assert unconfirmed.code == 1 and "ConfirmationRequired" in unconfirmed.err
    gone = cli(capsys, "pools", "delete", "pool-b", "--namespace", "team-b", "--yes")
    assert (gone.code, gone.out) == (0, "deleted: pool team-b/pool-b\n")
    assert cli(capsys, "pools", "delete", "pool-c", "--yes").code == 0
    names = {(p["namespace"], p["name"]) for p in cli(capsys, "pools", "list", "--json").json()}
    assert names == {("default", "pool-a")}  # the fixture's pool is the one left
    missing = cli(capsys, "pools", "delete", "pool-b", "--namespace", "team-b", "--yes")
    assert missing.code == 1 and missing.err.startswith("error: NotFound: ")


def test_pools_update_clears_the_byte_limit_with_none_and_keeps_the_other_limits(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path,
    controlplane: str,
) -> None:  # fmt: skip
    """`--max-cpu-lora-bytes none` sends null, which clears the pool's byte limit (as PATCH
    with null does); `pools create` takes it too, as its default."""
    made = cli(capsys, "pools", "create", "pool-n", "--base-model", "tiny-n", "--base-model-uri",
               str(tiny_llama_dir), "--max-cpu-lora-bytes", "none", "--json")  # fmt: skip
    assert made.code == 0, made.err
    assert made.json()["max_cpu_lora_bytes"] is None
    sized = cli(capsys, "pools", "update", "pool-n", "--max-cpu-lora-bytes", "1GiB",
                "--max-loras", "3", "--json")  # fmt: skip
    assert (sized.json()["max_cpu_lora_bytes"], sized.json()["max_loras"]) == (1 << 30, 3)
    cleared = cli(capsys, "pools", "update", "pool-n", "--max-cpu-lora-bytes", "None")
    assert cleared.code == 0, cleared.err
    assert "  max_cpu_lora_bytes  none" in cleared.out.splitlines()
    stored = httpx.get(controlplane + "/v1/pools/pool-n", headers=ADMIN_H)
    assert (stored.json()["max_cpu_lora_bytes"], stored.json()["max_loras"]) == (None, 3)
    bad = cli(capsys, "pools", "update", "pool-n", "--max-cpu-lora-bytes", "nothing")
    assert bad.code == 2 and "or none for no limit" in bad.err
    helped = cli(capsys, "pools", "update", "--help")
    assert "--max-cpu-lora-bytes SIZE|none" in helped.out
    assert "none clears it (no byte limit)" in " ".join(helped.out.split())
    assert cli(capsys, "pools", "delete", "pool-n", "--yes").code == 0


@pytest.mark.parametrize(
    "command",
    [
        ["adapters", "serve"], ["adapters", "rollback"], ["adapters", "follow-latest"],
        ["adapters", "delete"], ["tenants", "delete"], ["pools", "list"], ["pools", "show"],
        ["pools", "create"], ["pools", "update"], ["pools", "delete"], ["keys", "revoke"],
    ],
    ids=lambda c: "-".join(c),
)  # fmt: skip
def test_every_new_command_help_says_what_it_does_and_how_to_confirm(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    run = cli(capsys, *command, "--help")
    assert run.code == 0
    env_var = "LORAPLANE_ADMIN_TOKEN" if command[0] != "adapters" else "LORAPLANE_API_KEY"
    for text in ("LORAPLANE_URL", env_var, f"example:\n  loraplane {' '.join(command)}",
                 "Exit 0: done", "Exit 1: refused", "--json"):  # fmt: skip
        assert text in run.out, text
    confirms = command[1] in ("serve", "rollback", "follow-latest", "delete", "revoke")
    assert ("--yes" in run.out) is confirms
    assert ("asks [y/N]" in run.out) is confirms


def test_the_help_of_loraplane_lists_pools() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loraplane", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert re.search(r"^\s+pools\s+list, show, create, update and delete pools", done.stdout, re.M)


def test_rollout_set_promote_and_rollback_are_one_command_each(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_adapter: Maker,
    controlplane: str,
) -> None:  # fmt: skip
    key = new_tenant(capsys, "canaries")
    env.setenv("LORAPLANE_API_KEY", key)
    for seed in (1, 2, 3):
        push(capsys, make_adapter, "bot", seed)
    assert cli(capsys, "adapters", "serve", "bot", "2", "--yes").code == 0

    run = cli(capsys, "adapters", "rollout", "set", "bot", "2=90", "v3=10", "--yes")
    assert run.code == 0, run.err
    assert run.out == (
        "rollout: bot v2 90%, v3 10% (rollback serves v2; `loraplane adapters rollout promote "
        "bot` or `... rollback bot`)\n"
    )
    assert cli(capsys, "adapters", "list").out.splitlines()[1].split()[-1] == (
        "rollout:v2=90,v3=10"
    )
    unasked = cli(capsys, "adapters", "rollout", "set", "bot", "2=50", "3=50")  # no terminal
    assert unasked.code == 1 and "ConfirmationRequired" in unasked.err
    bad = cli(capsys, "adapters", "rollout", "set", "bot", "2=90", "3=20", "--yes")
    assert bad.code == 1 and bad.err == (
        "error: InvalidRequest: a rollout's weights sum to 100; these (v2: 90, v3: 20) sum to 110\n"
    )
    assert cli(capsys, "adapters", "rollout", "set", "bot", "2:90", "--yes").code == 2

    back = cli(capsys, "adapters", "rollout", "rollback", "bot", "--yes", "--json")
    assert back.code == 0, back.err
    assert (back.json()["current_version"], back.json()["rollout"]) == (2, None)
    assert resolved(controlplane, key, "bot") == 2
    none = cli(capsys, "adapters", "rollout", "rollback", "bot", "--yes")
    assert none.code == 1 and none.err == (
        "error: Conflict: adapter 'bot' has no rollout to roll back\n"
    )

    assert cli(capsys, "adapters", "rollout", "set", "bot", "2=90", "3=10", "--yes").code == 0
    promoted = cli(capsys, "adapters", "rollout", "promote", "bot", "--yes")
    assert promoted.code == 0, promoted.err
    assert promoted.out == "serving: bot v3 alone (no rollout)\n"
    assert resolved(controlplane, key, "bot") == 3
    assert cli(capsys, "adapters", "rollout", "set", "bot", "1=10", "3=90", "--yes").code == 0
    pinned = cli(capsys, "adapters", "rollout", "promote", "bot", "v1", "--yes")
    assert pinned.code == 0 and resolved(controlplane, key, "bot") == 1
