"""Errors a pod's operator can act on: the real `loraplane` command run as uid 10001 (the
chart's user) against files and folders that only root may use. Each startup failure exits
non-zero with one line that says "permission denied", names the path and the user (no
traceback, no "No such file or directory"); an adapter file that becomes unreadable while the
server runs fails that adapter's requests with a clear 503, and the server goes on serving.

Needs root (to start a process as another user); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loraplane import fileaccess
from tests.dataplane.server.conftest import wait_ready
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]
UID = GID = 10001
ADMIN = "admin-token-for-permission-tests-0123456789"
CP_TOKENS = {
    "LORAPLANE_ADMIN_TOKEN": "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI",
    "LORAPLANE_SERVICE_TOKEN": "zB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gZ",
}

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run the CLI as uid 10001 (a pod's user)"
)

# When this interpreter lives where uid 10001 cannot reach (pyenv under /root), the system
# Python of the same minor version runs this venv's packages instead (the same wheels).
_BOOT = (
    "import site, sys; [site.addsitedir(p) for p in sys.argv[1].split(':')];"
    "sys.path.insert(0, sys.argv[2]); sys.argv = ['loraplane', *sys.argv[3:]];"
    "from loraplane.cli import main; sys.exit(main())"
)


def _as_user(**kwargs: object) -> dict[str, object]:
    return {"user": UID, "group": GID, "extra_groups": [], **kwargs}


def _runs(cmd: list[str], home: Path) -> bool:
    try:
        done = subprocess.run(
            [*cmd, "--help"], capture_output=True, timeout=120, cwd=home, env=_env(home),
            **_as_user(),  # type: ignore[arg-type]
        )  # fmt: skip
    except OSError:
        return False
    return done.returncode == 0


def _env(home: Path, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLANE_", "KUBE"))}
    return {**keep, "HOME": str(home), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "LORAPLANE_METRICS_PORT": "0", "LORAPLANE_GATEWAY_METRICS_PORT": "0",
            "KUBECONFIG": str(home / "no-kubeconfig"), **extra}  # fmt: skip


@pytest.fixture(scope="module")
def world() -> Iterator[Path]:
    """A folder every user may enter (pytest's own tmp folders are root's alone, 0700)."""
    root = Path(tempfile.mkdtemp(prefix="loraplane-perms-"))
    root.chmod(0o755)
    home = root / "home"
    home.mkdir()
    os.chown(home, UID, GID)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def loraplane_cmd(world: Path) -> list[str]:
    """How uid 10001 runs `loraplane` here, or a skip saying why it cannot."""
    home = world / "home"
    direct = [sys.executable, "-m", "loraplane"]
    if _runs(direct, home):
        return direct
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    sites = ":".join(p for p in sys.path if p.endswith("site-packages"))
    fallback = [str(system), "-S", "-c", _BOOT, sites, str(REPO)]
    if system.exists() and _runs(fallback, home):
        return fallback
    pytest.skip(f"uid {UID} can run neither {sys.executable} nor {system} with this venv")


@pytest.fixture(scope="module")
def model(world: Path, tiny_llama_dir: Path) -> Path:
    """The tiny model, every file readable (save_pretrained leaves the weights 0600)."""
    out = world / "model"
    shutil.copytree(tiny_llama_dir, out)
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    return out


@pytest.fixture(scope="module")
def adapters(world: Path, model: Path) -> dict[str, Path]:
    from tests.factories import build_peft_adapter

    out = {}
    for i, name in enumerate(("a", "b")):
        folder = build_peft_adapter(model, world / "adapters" / name, seed=i, r=4, lora_alpha=8)
        for f in folder.iterdir():
            f.chmod(0o644)
        out[name] = folder
    (world / "adapters").chmod(0o755)
    return out


def run_cli(
    cmd: list[str], world: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    home = world / "home"
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=180, cwd=home,
        env=_env(home, **env), **_as_user(),  # type: ignore[arg-type]
    )  # fmt: skip


def assert_denied(done: subprocess.CompletedProcess[str], path: Path, *more: str) -> str:
    """The process failed with one clear line naming `path`, permission and the user."""
    out = done.stderr + done.stdout
    assert done.returncode != 0, out
    lines = [line for line in out.splitlines() if "permission denied" in line]
    assert lines, out
    line = lines[-1]
    assert f"permission denied: {path} (" in line, line
    assert f"uid {UID}" in line and f"gid {GID}" in line, line
    for text in more:
        assert text in line, line
    assert "No such file or directory" not in out, out
    assert "Traceback" not in out, out
    return line


@pytest.fixture
def restore(model: Path, adapters: dict[str, Path]) -> Iterator[None]:
    """Every test leaves the shared files readable again."""
    yield
    for folder in (model, *adapters.values()):
        folder.chmod(0o755)
        for f in folder.iterdir():
            f.chmod(0o644)


def serve(
    cmd: list[str], world: Path, model: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return run_cli(cmd, world, "serve", "--model", str(model), "--port", str(free_port()),
                   *args, **env)  # fmt: skip


# -- the data plane: the base model -------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_serve_says_permission_denied_for_a_root_only_model_file(
    loraplane_cmd: list[str], world: Path, model: Path, restore: None, name: str
) -> None:
    (model / name).chmod(0o600)  # as save_pretrained leaves the weights
    line = assert_denied(serve(loraplane_cmd, world, model), model / name,
                         "mode 0600", "owner uid 0", "chmod a+r")  # fmt: skip
    assert line.startswith(f"error: cannot load model {model}"), line


def test_serve_names_the_model_folder_it_cannot_enter(
    loraplane_cmd: list[str], world: Path, model: Path, restore: None
) -> None:
    model.chmod(0o700)
    assert_denied(serve(loraplane_cmd, world, model), model,
                  "a folder this process cannot enter", "mode 0700")  # fmt: skip


def test_a_model_file_truly_missing_still_says_it_is_missing(
    loraplane_cmd: list[str], world: Path, model: Path
) -> None:
    partial = world / "no-weights"
    partial.mkdir(mode=0o755)
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, partial / f.name)
    done = serve(loraplane_cmd, world, partial)
    assert done.returncode != 0
    assert f"no *.safetensors weights in {partial}" in done.stderr, done.stderr
    assert "permission denied" not in done.stderr


# -- the data plane: adapters, spool, store ------------------------------------------------------


def test_serve_says_permission_denied_for_a_root_only_static_adapter(
    loraplane_cmd: list[str], world: Path, model: Path, adapters: dict[str, Path], restore: None
) -> None:
    weights = adapters["a"] / "adapter_model.safetensors"
    weights.chmod(0o600)
    done = serve(loraplane_cmd, world, model, "--lora-modules", f"a={adapters['a']}")
    line = assert_denied(done, weights, "mode 0600")
    assert "error: adapter a: " in line and "InvalidSafetensors" not in line, line


def test_an_adapter_unreadable_at_load_fails_its_requests_with_a_clear_503(
    loraplane_cmd: list[str], world: Path, model: Path, adapters: dict[str, Path], restore: None
) -> None:
    port = free_port()
    home = world / "home"
    proc = subprocess.Popen(
        [*loraplane_cmd, "serve", "--model", str(model), "--served-model-name", "tiny",
         "--port", str(port), "--max-cpu-loras", "1", "--admin-token", ADMIN,
         "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"],
        cwd=home, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        **_as_user(),  # type: ignore[arg-type]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout=120, proc=proc)
        for folder in adapters.values():  # only one is in host memory: the other is read again
            (folder / "adapter_model.safetensors").chmod(0o600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        failures = []
        for name in ("a", "b"):
            try:
                client.completions.create(model=name, prompt="hello", max_tokens=2)
            except openai.APIStatusError as e:
                failures.append(e)
        assert len(failures) == 1, "one adapter had to be read again from its folder"
        error = failures[0]
        assert error.status_code == 503, error
        message = str(error.body)
        assert "permission denied" in message and f"uid {UID}" in message, message
        assert "adapter_model.safetensors" in message, message
        # the server goes on: the base model answers
        done = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert done.choices[0].text is not None
        # loading it again through the admin route says why, as a 503 naming the file
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for name in ("a", "b"):
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a"}, headers=admin)
        assert r.status_code == 503, r.text
        body = r.json()["error"]
        assert body["code"] == "AdapterUnreadable", body
        weights = adapters["a"] / "adapter_model.safetensors"
        assert f"permission denied: {weights} (" in body["message"], body
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


@pytest.mark.parametrize("what", ["spool", "store"])
def test_serve_in_catalog_mode_names_a_folder_it_may_not_use(
    loraplane_cmd: list[str], world: Path, model: Path, what: str
) -> None:
    folder = world / f"root-only-{what}"
    folder.mkdir(mode=0o700, exist_ok=True)
    env = {
        "LORAPLANE_CONTROLPLANE_URL": "http://127.0.0.1:9",
        "LORAPLANE_SERVICE_TOKEN": CP_TOKENS["LORAPLANE_SERVICE_TOKEN"],
        "LORAPLANE_STORE": str(world / "home" / "st"),
    }
    if what == "spool":
        folder.chmod(0o755)  # enterable, not writable
        env["LORAPLANE_USAGE_SPOOL_DIR"] = str(folder)
        line = assert_denied(serve(loraplane_cmd, world, model, **env), folder,
                             "cannot write in this folder")  # fmt: skip
        assert "LORAPLANE_USAGE_SPOOL_DIR" in line, line
    else:
        env["LORAPLANE_STORE"] = str(folder)
        line = assert_denied(serve(loraplane_cmd, world, model, **env), folder,
                             "cannot list", "mode 0700")  # fmt: skip
        assert "LORAPLANE_STORE" in line, line


@pytest.mark.parametrize("block", ["weights", "folder"])
def test_adapters_validate_says_permission_denied(
    loraplane_cmd: list[str], world: Path, adapters: dict[str, Path], restore: None, block: str
) -> None:
    folder = adapters["b"]
    if block == "weights":
        (folder / "adapter_model.safetensors").chmod(0o600)
        expect, text = folder / "adapter_model.safetensors", "cannot read this file"
    else:
        folder.chmod(0o700)
        expect, text = folder, "a folder this process cannot enter"
    target = folder / "adapter_config.json" if block == "folder" else folder
    done = run_cli(loraplane_cmd, world, "adapters", "validate", str(target))
    assert done.returncode == 2, done.stderr
    assert_denied(done, expect, text)
    assert "rejected" not in done.stdout


# -- the control plane -------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["sqlite-folder", "sqlite-file", "token-file", "store"])
def test_controlplane_says_permission_denied_for_its_files(
    loraplane_cmd: list[str], world: Path, case: str
) -> None:
    data = world / f"cp-{case}"
    data.mkdir(mode=0o755)  # root's: uid 10001 may enter, not write
    store = world / "home" / f"store-{case}"  # writable, but for the "store" case
    env = {"LORAPLANE_DATA_DIR": str(data), "LORAPLANE_STORE": str(store), **CP_TOKENS}
    expect, variable = data, "LORAPLANE_DATABASE_URL"
    if case == "sqlite-file":
        db = data / "controlplane.db"
        db.touch(mode=0o600)
        data.chmod(0o777)
        expect = db
    elif case == "token-file":
        del env["LORAPLANE_ADMIN_TOKEN"], env["LORAPLANE_SERVICE_TOKEN"]
        variable = "LORAPLANE_ADMIN_TOKEN"
    elif case == "store":
        env["LORAPLANE_STORE"] = str(data / "store")
        variable = "LORAPLANE_STORE"
    done = run_cli(loraplane_cmd, world, "controlplane", "--port", str(free_port()), **env)
    line = assert_denied(done, expect)
    assert variable in line, line
    assert "cannot write" in line and "mount a writable volume" in line, line


@pytest.mark.parametrize("blocked", ["file", "folder"])
def test_a_pool_whose_model_config_is_root_only_is_refused_over_rest_naming_it_and_the_user(
    loraplane_cmd: list[str], world: Path, model: Path, restore: None, blocked: str
) -> None:
    port = free_port()
    home = world / "home"
    env = {"LORAPLANE_DATA_DIR": str(home / f"cp-pool-{blocked}"), **CP_TOKENS}
    proc = subprocess.Popen(
        [*loraplane_cmd, "controlplane", "--port", str(port)], cwd=home, env=_env(home, **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        **_as_user(),  # type: ignore[arg-type]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    config = model / "config.json"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        (config if blocked == "file" else model).chmod(0o600 if blocked == "file" else 0o700)
        admin = {"Authorization": f"Bearer {CP_TOKENS['LORAPLANE_ADMIN_TOKEN']}"}
        pool = {"name": "p", "base_model": {"name": "tiny", "uri": str(model)}}
        r = httpx.post(url + "/v1/pools", json=pool, headers=admin, timeout=30)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "InvalidBaseModel", error
        denied = config if blocked == "file" else model
        assert f"permission denied: {denied} (" in error["message"], error
        assert f"uid {UID} (" in error["message"] and f"gid {GID}" in error["message"], error
        assert "No such file or directory" not in error["message"], error
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


def test_controlplane_migrate_says_permission_denied_for_the_sqlite_folder(
    loraplane_cmd: list[str], world: Path
) -> None:
    data = world / "cp-migrate"
    data.mkdir(mode=0o755)
    done = run_cli(loraplane_cmd, world, "controlplane", "migrate", LORAPLANE_DATA_DIR=str(data))
    assert_denied(done, data, "cannot write in this folder")


# -- the operator ------------------------------------------------------------------------------


def test_operator_says_permission_denied_for_a_root_only_kubeconfig(
    loraplane_cmd: list[str], world: Path
) -> None:
    kubeconfig = world / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "
        "'http://127.0.0.1:9'}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\nusers: [{name: u, user: {token: t}}]\n"
    )
    kubeconfig.chmod(0o600)
    env = {"KUBECONFIG": str(kubeconfig), "LORAPLANE_CONTROLPLANE_URL": "http://127.0.0.1:9",
           "LORAPLANE_SERVICE_TOKEN": CP_TOKENS["LORAPLANE_SERVICE_TOKEN"],
           "LORAPLANE_STORE": str(world / "home" / "op-store")}  # fmt: skip
    start = time.monotonic()
    done = run_cli(loraplane_cmd, world, "operator", "--all-namespaces", **env)
    assert time.monotonic() - start < 120
    line = assert_denied(done, kubeconfig, "mode 0600", "owner uid 0")
    assert "Kubernetes credentials" in line, line


# -- the module itself (in this process) -------------------------------------------------------


def test_a_read_only_file_system_is_named_with_the_volume_hint(tmp_path: Path) -> None:
    err = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x"))
    explained = fileaccess.explain(err, "write")
    assert isinstance(explained, fileaccess.AccessDenied)
    assert str(explained).startswith(f"read-only file system: cannot write in {tmp_path} (")
    assert "mount a writable volume" in str(explained)


def test_a_missing_file_stays_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fileaccess.check_readable(tmp_path / "nope")
    other = OSError(errno.ENOENT, "No such file or directory", str(tmp_path / "nope"))
    assert fileaccess.explain(other) is other
