"""`serve --tensor-parallel-size 2` on CPU: the OpenAI API over a model split across two
processes answers as the unsplit engine does, SIGTERM leaves no process behind, and a killed
worker fails the request in flight and the probes (the pod is restarted), never a hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.server.conftest import spawn, wait_ready
from tests.servers import free_port

PROMPT = [5, 17, 33, 9, 40, 11]


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (read from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _describe(pid: int) -> str:
    """`pid`'s state and command line, "" once it is gone (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
    return "" if state == "Z" else f"{state} {cmdline[:120]}"


def _reference(
    model: Path, adapter: Path, quantization: str | None = None
) -> tuple[str, list[float]]:
    """The unsplit engine's greedy text and its tokens' log-probabilities."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 num_kv_blocks=64, quantization=quantization))  # fmt: skip
    ref = engine.register_lora("a", adapter, "default")
    engine.add_request("x", PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True, logprobs=1), ref)  # fmt: skip
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.token_ids
            logprobs += out.logprobs or []
    return engine.tokenizer.decode(tokens), logprobs


@pytest.mark.parametrize("form", ["plain", "fp8", "dora-in-kv"])
def test_serve_split_over_two_processes_answers_as_one_and_exits_clean(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], form: str, tmp_path: Path
) -> None:
    """fp8: the base quantized at load, each rank its slice of the FP8 weights (its
    log-probabilities differ from fp32's by ~1e-3, so within 1e-4 they are FP8's).
    dora-in-kv: a DoRA adapter (its split rows' norms summed over the ranks) in each rank's
    KV cache (LORAPLANE_KV_LORA_SHARED, the CUDA default)."""
    from tests.factories import build_peft_adapter

    quantization = "fp8" if form == "fp8" else None
    adapter = peft_adapters["r16"]
    env = {"LORAPLANE_NUM_KV_BLOCKS": "64", "LORAPLANE_SHUTDOWN_GRACE_S": "10"}
    if form == "dora-in-kv":
        adapter = build_peft_adapter(tiny_llama_dir, tmp_path / "dora", seed=3, r=8,
                                     lora_alpha=16, use_dora=True)  # fmt: skip
        env["LORAPLANE_KV_LORA_SHARED"] = "1"
        env["LORAPLANE_METRICS_PORT"] = str(metrics_port := free_port())
    port = free_port()
    quantize = ["--quantization", quantization] if quantization else []
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--port", str(port), "--dtype", "float32",
         "--tensor-parallel-size", "2", "--lora-modules", f"a={adapter}", *quantize],
        env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=120, proc=proc)
        # the server, its engine process, and the engine's one worker
        assert len(_descendants(proc.pid)) >= 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        answer = client.completions.create(
            model="a", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, logprobs = _reference(tiny_llama_dir, adapter, quantization)
        assert answer.choices[0].text == text
        got = answer.choices[0].logprobs
        assert got is not None and got.token_logprobs is not None
        assert got.token_logprobs == pytest.approx(logprobs, abs=1e-4)
        if form == "dora-in-kv":  # rank 0's run of blocks holds the adapter (the workers' too)
            metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            held = [line for line in metrics.splitlines()
                    if line.startswith('loraplane_kv_blocks{holder="adapters"}')]  # fmt: skip
            assert held and float(held[0].split()[-1]) > 0, held
        children = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker ends on its own
        while (left := {p: _describe(p) for p in children if _describe(p)}) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not left, f"processes of the split engine outlived the server: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_dead_worker_takes_the_replica_out_of_rotation_and_the_liveness_probe_fails(
    tiny_llama_dir: Path,
) -> None:
    port = free_port()
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--port", str(port), "--dtype", "float32",
         "--tensor-parallel-size", "2"],
        env={"LORAPLANE_NUM_KV_BLOCKS": "64"},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=120, proc=proc)
        # the worker: a spawned process whose parent is the engine process, not the server
        workers = [
            p for p in _descendants(proc.pid)
            if _parent(p) != proc.pid and "spawn_main" in _describe(p)
        ]  # fmt: skip
        assert len(workers) == 1, {p: _describe(p) for p in _descendants(proc.pid)}
        os.kill(workers[0], signal.SIGKILL)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                      max_tokens=4, timeout=60)  # fmt: skip
        assert time.monotonic() - started < 60  # an error, never a hang
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = httpx.get(url + "/ready", timeout=5)
            health = httpx.get(url + "/health", timeout=5)
            if ready.status_code == health.status_code == 503:
                break
            time.sleep(0.2)
        assert (ready.status_code, health.status_code) == (503, 503), (ready.text, health.text)
        assert "engine" in health.text
    finally:
        proc.kill()
        proc.wait()
