"""Session fixtures shared by every test folder: a tiny HF model and real PEFT adapters."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A worker of a parallel run (pytest-xdist, `make test`) shares the machine's cores with the
# other workers: its torch team, and those of the servers it starts, take one thread each, so
# the workers' teams never outnumber the cores (an OpenMP barrier waiting on a thread that
# another process displaced costs a whole scheduler slice: data plane cpus.py). Set before torch
# is imported; tests that set their own thread count still do.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LORAPLANE_CPU_THREADS"] = "1"
    # adapter loads at the engine's priority: at the default nice 19 a loader thread gets ~1.5%
    # of a core the other worker keeps busy, and a 50 ms load takes seconds; tests of the
    # niceness itself set it
    os.environ.setdefault("LORAPLANE_LOADER_NICE", "0")

# Triton reads TRITON_INTERPRET once, when it is first imported, and PEFT and torch._dynamo import
# it as a side effect: any test module collected before the kernel tests (one importing PEFT at
# module level) would otherwise freeze Triton's own @jit helpers (tl.sum, tl.max) uninterpreted,
# and every interpreted kernel then fails with "Cannot call @triton.jit'd outside of the scope of
# a kernel". Without CUDA the kernels can only run interpreted, so decide here, before anything.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# Every data plane a test starts in this process (tests/dataplane/server's start_server and
# others) runs its engine in a child process (engine_process.py). Spawned, as in a replica, each
# child would import torch and the engine afresh: about 4 s of CPU, over a hundred times a run.
# Forked from one forkserver that imported them once, a child starts in a fraction of a second;
# it still takes the test's environment as it is at the start (engine_child.main).
# Subprocesses (`loraplane serve`) spawn their engine as a replica does.
from loraplane.dataplane import engine_process

engine_process.START_METHOD = "forkserver"
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["loraplane.dataplane.engine_child"]
)

# name -> LoraConfig arguments; ranks 4 to 64 and every PEFT feature the engine honours
ADAPTER_CONFIGS: dict[str, dict[str, object]] = {
    "r4": {"r": 4, "lora_alpha": 8},
    "r8-qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "r16": {"r": 16, "lora_alpha": 32},
    "r16-rslora": {"r": 16, "lora_alpha": 16, "use_rslora": True},
    "r32-mlp": {"r": 32, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "r64": {"r": 64, "lora_alpha": 128},
    "r8-patterns": {
        "r": 8,
        "lora_alpha": 16,
        "rank_pattern": {"model.layers.0.self_attn.q_proj": 4, "down_proj": 12},
        "alpha_pattern": {"o_proj": 3},
    },
    "r8-layer1": {"r": 8, "lora_alpha": 8, "layers_to_transform": [1]},
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA) model directory in HF format, with tokenizer."""
    from tests.factories import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def peft_adapters(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Real PEFT adapters of tiny_llama_dir, one per ADAPTER_CONFIGS entry."""
    from tests.factories import build_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_peft_adapter(tiny_llama_dir, root / name, seed=i, **dict(cfg))
        for i, (name, cfg) in enumerate(ADAPTER_CONFIGS.items())
    }


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with only the tiny base model's config.json (all validation and pools need)."""
    import json

    from tests.adapters.crafting import TINY_BASE_CONFIG

    folder = tmp_path_factory.mktemp("base-model")
    (folder / "config.json").write_text(json.dumps(TINY_BASE_CONFIG))
    return folder


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite catalog migrated once; each test copies it."""
    from loraplane.controlplane import db

    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    engine = db.make_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    engine.dispose()
    return path
