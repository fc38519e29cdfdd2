"""A new tenant's first hour, scripted: what issue 28's user walked through, end to end.

Part one, the CLI, the REST API and the OpenAI client against a real control plane (SQLite, a
local store) and a real data plane in catalog mode: the admin registers a pool, a tenant and a
key (tokens pasted with a trailing newline); the tenant's key with surrounding whitespace works,
a mistyped one is called malformed and an unknown one invalid; the base models are listed; a
first answer; a Trainer's output folder is pushed (its artefacts listed as ignored) and served;
the adapter quota names a delete command that exists; a second version, a rollback that asks
first and holds across a push, follow latest, delete. No output ever holds a secret.

The console's part of the tour (Chromium at 1280 and 390 px) is
tests/console/test_console_actions.py::test_a_new_tenants_tour_from_key_to_upload_rollback_and_delete.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import openai
import pytest

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import start_server
from tests.test_e2e_catalog import controlplane
from tests.test_tenant_cli import Run, cli

BASE, POOL = "tiny-base", "pool-a"
TRAINER_ARTEFACTS = {  # what transformers' Trainer writes beside the adapter in checkpoint-*
    "training_args.bin": b"\x80\x04\x95pickled TrainingArguments",
    "optimizer.pt": b"PK\x03\x04 a torch.save zip",
    "rng_state.pth": b"PK\x03\x04 rng",
    "scheduler.pt": b"PK\x03\x04 scheduler",
    "trainer_state.json": b'{"global_step": 10}',
}
IGNORED = ", ".join(sorted(TRAINER_ARTEFACTS))


def trainer_checkpoint(adapter: Path, out: Path) -> Path:
    """`adapter`'s files as a Trainer's `checkpoint-N` folder holds them, artefacts beside."""
    shutil.copytree(adapter, out)
    for name, data in TRAINER_ARTEFACTS.items():
        (out / name).write_bytes(data)
    return out


class Tour:
    """The CLI runs of the tour, kept to check that no output holds a secret."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys, self.runs = capsys, list[Run]()

    def __call__(self, *args: str, code: int = 0) -> Run:
        run = cli(self.capsys, *args)
        assert run.code == code, (args, run.out, run.err)
        self.runs.append(run)
        return run

    def printed(self) -> str:
        return "".join(r.out + r.err for r in self.runs)


def test_a_new_tenant_from_key_to_first_answer_upload_rollback_and_delete(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    tour = Tour(capsys)
    with controlplane(tmp_path) as cp:
        monkeypatch.setenv("LORAPLANE_URL", cp)
        monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", ADMIN + "\n")  # read from an env file
        monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)

        # the admin: a pool, a tenant allowed one adapter, a key
        made = tour("pools", "create", POOL, "--base-model", BASE,
                    "--base-model-uri", str(tiny_llama_dir))  # fmt: skip
        assert POOL in made.out
        tour("tenants", "create", "acme")
        tour("tenants", "update", "acme", "--max-adapters", "1")
        made_key = cli(capsys, "keys", "create", "--tenant", "acme", "--label", "laptop", "--json")
        key = made_key.json()["key"]  # printed once, by design: not among the runs checked

        # the tenant: a key pasted with whitespace around it works; a mistyped one is called
        # malformed, a well-formed unknown one invalid, neither printed
        monkeypatch.setenv("LORAPLANE_API_KEY", f" {key}\n")
        offered = tour("adapters", "base-models")
        assert BASE in offered.out and POOL not in offered.err
        monkeypatch.setenv("LORAPLANE_API_KEY", key[:-5])
        mistyped = tour("adapters", "list", code=1)
        assert "malformed API key" in mistyped.err, mistyped.err
        unknown = "lp_" + "A" * (len(key) - 3)
        monkeypatch.setenv("LORAPLANE_API_KEY", unknown)
        assert "invalid or revoked API key" in tour("adapters", "list", code=1).err
        monkeypatch.setenv("LORAPLANE_API_KEY", key)

        data_plane = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            resolve_ttl_s=0.2, num_kv_blocks=256, max_loras=4,
        )  # fmt: skip
        with start_server(data_plane) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}

            def answer(model: str) -> str:
                out = client.completions.create(model=model, prompt="Hello", **greedy)  # type: ignore[call-overload]
                text: str = out.choices[0].text
                return text

            def serves(model: str, expected: str, timeout: float = 10.0) -> None:
                """`model` answers `expected` once the replica's resolve cache has expired."""
                deadline = time.monotonic() + timeout
                while (got := answer(model)) != expected and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert got == expected, (model, got, expected)

            # the first answer, from the base model
            base = answer(BASE)
            assert base
            assert client.models.retrieve(BASE).id == BASE

            # a Trainer's checkpoint folder, pushed as it is: the artefacts are ignored, named
            v1_dir = trainer_checkpoint(peft_adapters["r16"], tmp_path / "checkpoint-10")
            pushed = tour("adapters", "push", str(v1_dir), "--name", "support",
                          "--base-model", BASE)  # fmt: skip
            assert pushed.out.startswith("pushed: support v1 (new version)\n"), pushed.out
            ignored = next(line for line in pushed.out.splitlines() if "ignored" in line)
            # PEFT's README.md is ignored too
            assert ignored == f"  ignored     README.md, {IGNORED} (not sent)", ignored
            v1 = answer("support@1")
            assert v1 != base  # the adapter is applied
            serves("support", v1)
            assert client.models.retrieve("support").id == "support"

            # the quota: its message names a command that exists
            other = tour("adapters", "push", str(peft_adapters["r4"]), "--name", "other",
                         "--base-model", BASE, code=1)  # fmt: skip
            assert "QuotaExceeded" in other.err
            assert "`loraplane adapters delete NAME`" in other.err

            # a bad name is told in words, not as a pattern
            bad = tour("adapters", "push", str(peft_adapters["r4"]), "--name", "My Adapter",
                       "--base-model", BASE, code=1)  # fmt: skip
            assert "name" in bad.err and "lowercase" in bad.err, bad.err
            assert "pattern" not in bad.err and "^[" not in bad.err

            # a second version serves at once (the adapter follows the latest)
            second = tour("adapters", "push", str(peft_adapters["r8-qv"]), "--name", "support",
                          "--base-model", BASE)  # fmt: skip
            assert second.out.startswith("pushed: support v2 (new version)\n")
            v2 = answer("support@2")
            assert v2 != v1
            serves("support", v2)

            # rollback asks first; a script must say --yes; then v1 serves and stays
            refused = tour("adapters", "rollback", "support", code=1)
            assert "ConfirmationRequired" in refused.err and "--yes" in refused.err
            serves("support", v2)
            rolled = tour("adapters", "rollback", "support", "--yes")
            assert rolled.out.startswith("serving: support v1, held"), rolled.out
            serves("support", v1)
            third = tour("adapters", "push", str(peft_adapters["r4"]), "--name", "support",
                         "--base-model", BASE)  # fmt: skip
            assert "v3 is stored, not served" in third.out, third.out
            serves("support", v1)  # a push does not move a held version

            # follow the latest again
            followed = tour("adapters", "follow-latest", "support", "--yes")
            assert followed.out == (
                "serving: support v3, following the latest (each push serves its new version)\n"
            )
            serves("support", answer("support@3"))

            # delete: asked first, then the name is gone and the quota is free again
            tour("adapters", "delete", "support", code=1)
            tour("adapters", "delete", "support", "--yes")
            deadline = time.monotonic() + 10
            code = None
            while code is None and time.monotonic() < deadline:
                try:
                    answer("support")
                    time.sleep(0.1)
                except openai.NotFoundError as e:
                    code = e.code
            assert code == "model_not_found", "support is still served after delete"
            tour("adapters", "push", str(peft_adapters["r4"]), "--name", "other",
                 "--base-model", BASE)  # fmt: skip

    printed = tour.printed()
    assert made_key.code == 0 and ADMIN not in made_key.out + made_key.err
    for secret in (key, ADMIN, unknown):
        assert secret not in printed
    assert key[:-5] not in printed  # nor the mistyped key
