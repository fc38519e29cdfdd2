"""`loraplane demo`: the whole system on this machine, from nothing outside it.

1. Build (once; cached in the work folder): a small Llama (or, with `--family`, a Qwen3,
   Gemma 3, Phi-3, Mixtral or Qwen3-MoE) and three tenants' LoRA adapters, trained on CPU so
   each tenant's replies have its own voice.
2. Start the control plane (SQLite, local store) and a data plane (CPU, catalog mode) on
   localhost; register the pool, create tenants and keys, upload the adapters, all over REST.
3. Serve until Ctrl-C, printing ready-to-paste examples; or, with `once`, run the scripted tour
   (`tour.py`) and exit 0 when everything behaved.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from types import FrameType

import httpx

from loraplane import tokenfile
from loraplane.accesslog import AccessLogError, AccessLogSettings
from loraplane.demo import workspace
from loraplane.demo.console import say, step
from loraplane.demo.corpus import QUESTIONS
from loraplane.demo.errors import DemoError
from loraplane.demo.families import DEFAULT, family
from loraplane.demo.provision import Tenant, admin_client, provision, register_pool
from loraplane.demo.stack import MAX_LORA_RANK, MAX_LORAS, POOL, Service, Stack, StackError, running
from loraplane.demo.workspace import ADAPTERS, Workspace
from loraplane.redact import CredentialError

TOUR_STEPS = 5
REQUEST_LOG = "requests.log"  # in the run folder: both services' request logs, by default


def _where(service: Service, asked: int) -> str:
    taken = f" (port {asked} was taken)" if service.fell_back else ""
    return f"{service.url}{taken}"


def _build(ws: Workspace, rebuild: bool, number: int, total: int) -> float | None:
    """Build unless a complete build is cached; the seconds it took (None: cached)."""
    if ws.is_built() and not rebuild:
        step(number, total, f"model and adapters: built earlier, in {ws.root}")
        return None
    workspace.require("torch", "transformers", "peft")
    step(number, total, f"building the model and three tenants' adapters in {ws.root} "
         "(once; CPU, seeded)")  # fmt: skip
    seconds = workspace.build(ws, say)
    say(f"  built in {seconds:.1f} s; later runs reuse it (--rebuild builds again)")
    return seconds


def _set_up(
    stack: Stack, ws: Workspace, cp_port: int, number: int, total: int
) -> dict[str, Tenant]:
    step(number, total, f"control plane on {_where(stack.controlplane, cp_port)} "
         "(SQLite catalog, local store); set-up through its REST API")  # fmt: skip
    with admin_client(stack.controlplane.url, stack.admin_token) as admin:
        register_pool(admin, ws.base_name, ws.model)
    say(f"    admin    POST /v1/pools {POOL}: base model {ws.base_name} ({ws.model}), max rank "
        f"{MAX_LORA_RANK}, {MAX_LORAS} adapter slots per replica")  # fmt: skip
    stack.start_dataplane(ws.model, ws.base_name)  # loads while the tenants are set up
    adapters = {t: (name, ws.adapter(t)) for t, (name, _) in ADAPTERS.items()}
    return provision(stack.controlplane.url, stack.admin_token, ws.base_name, adapters, say)


def run_demo(
    workdir: Path,
    once: bool = False,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    controlplane_port: int = 8080,
    rebuild: bool = False,
    access_log: AccessLogSettings | None = None,
    family_name: str = DEFAULT,
) -> int:
    """Run the demo (see the module doc); return the process exit code. `access_log`: the
    services' request logs (default: to REQUEST_LOG in the run folder, so that they do not
    interleave with the tour's lines); `family_name`: the
    base model's family (another than the default builds in a sub-folder named after it)."""
    start = time.perf_counter()
    total = 3 + (TOUR_STEPS if once else 1)
    chosen = family(family_name)
    root = workdir.absolute()
    ws = Workspace(root if chosen.name == DEFAULT else root / chosen.name, chosen)
    try:
        workspace.require("openai")  # the clients of the tour and the serving preview
        build_s = _build(ws, rebuild, 1, total)
        admin_token, token_file = _admin_token()
        run_dir = ws.fresh_run_dir()
        if access_log is None:
            access_log = AccessLogSettings(access_log=True, access_log_file=run_dir / REQUEST_LOG)
            say(f"request logs: {access_log.access_log_file} (one JSON line per request from "
                "both services; --access-log on prints them here)")  # fmt: skip
        with running(run_dir, host, controlplane_port, port, access_log,
                     admin_token) as stack:  # fmt: skip
            tenants = _set_up(stack, ws, controlplane_port, 2, total)
            stack.wait_ready()
            ready_s = time.perf_counter() - start
            step(3, total, f"data plane on {_where(stack.dataplane, port)} (CPU, catalog mode): "
                 f"ready; the system serves {ready_s:.1f} s after start")  # fmt: skip
            if once:
                _tour(stack, ws, tenants, total)
                built = "cached" if build_s is None else f"{build_s:.1f} s (first run)"
                say(f"tour done. build {built}, serving after {ready_s:.1f} s, whole run "
                    f"{time.perf_counter() - start:.1f} s")  # fmt: skip
            else:
                _serve(stack, ws.base_name, tenants, total, token_file)
        if not once:
            say("stopped")
    except (DemoError, CredentialError, AccessLogError) as e:
        say(f"demo failed: {e}")
        return 1
    except OSError as e:  # the admin token's file: this user may not write it
        say(f"demo failed: {e}")
        return 1
    except httpx.HTTPError as e:
        say(f"demo failed: HTTP: {type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; everything started was stopped")
        return 130
    return 0


def _tour(stack: Stack, ws: Workspace, tenants: dict[str, Tenant], total: int) -> None:
    from loraplane.demo.tour import run_tour

    numbers = iter(range(4, total + 1))
    run_tour(
        stack.dataplane.url, stack.metrics.url, stack.controlplane.url, stack.admin_token,
        ws.base_name, tenants,
        ws.model, {t: ws.adapter(t) for t in tenants}, ws.run / "scratch",
        lambda title: step(next(numbers), total, title),
    )  # fmt: skip


def _admin_token() -> tuple[str, Path]:
    """The admin token in `.loraplane/admin-token` (the file the CLI reads), written there
    now (mode 0600) unless one is there already; the token and its file's absolute path."""
    token, path, written = tokenfile.ensure_admin_token()
    path = path.absolute()
    say(f"admin token: {'written to' if written else 'read from'} {path} (mode 0600; the "
        "tenant CLI reads it there, e.g. loraplane tenants list)")  # fmt: skip
    return token, path


def _serve(
    stack: Stack, base: str, tenants: dict[str, Tenant], total: int, token_file: Path
) -> None:
    from loraplane.demo.examples import show_examples
    from loraplane.demo.tour import preview

    step(4, total, "serving; first, one question to the base model and each adapter")
    preview(stack.dataplane.url, base, tenants, QUESTIONS[0])
    say("")
    show_examples(stack.dataplane.url, stack.controlplane.url, token_file, base,
                  tenants, metrics_url=stack.metrics.url)  # fmt: skip
    say("")
    say("serving until Ctrl-C (both services stop cleanly)")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set():
            if not (stack.controlplane.thread.is_alive() and stack.dataplane.thread.is_alive()):
                raise StackError("a service stopped on its own")
            stop.wait(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("stopping: the data plane drains, then the control plane stops")
