"""The demo's working folder and its cached build (model, tokenizer, tenants' adapters).

    <workdir>/model/            the base model (HF format: config, safetensors, tokenizer)
    <workdir>/adapters/<tenant>/  each tenant's PEFT adapter, as the tenant would upload it
    <workdir>/build.json        written last: the recipe's fingerprint (a build is complete)
    <workdir>/run/              the running system's state (catalog, store), fresh every run

The build is seeded and reused while `build.json` matches the recipe; a changed corpus, shape
or training recipe (or an interrupted build) builds again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from loraplane.demo import corpus
from loraplane.demo.errors import DemoError
from loraplane.demo.families import FAMILIES, DemoFamily

Say = Callable[[str], None]
BUILD_VERSION = 2
SEED = 0
VOCAB_SIZE = 512
BASE_NAME = FAMILIES["llama"].base_name  # the default family's: "demo-llama"
# tenant -> (adapter name, rank): ranks differ, the engine serves each at its own rank
ADAPTERS = {"acme": ("helpdesk-pirate", 8), "globex": ("helpdesk-legal", 16),
            "initech": ("helpdesk-memo", 32)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Workspace:
    """Paths inside the demo's working folder, for the base model's family."""

    root: Path
    family: DemoFamily = FAMILIES["llama"]

    @property
    def base_name(self) -> str:
        """The base model's name in the API (`demo-llama` for the default family)."""
        return self.family.base_name

    @property
    def model(self) -> Path:
        """The base model folder (also the pool's base model URI)."""
        return self.root / "model"

    def adapter(self, tenant: str) -> Path:
        """`tenant`'s trained adapter folder."""
        return self.root / "adapters" / tenant

    @property
    def run(self) -> Path:
        """The running system's state: SQLite catalog, object store, scratch uploads."""
        return self.root / "run"

    @property
    def stamp(self) -> Path:
        """Written last by a complete build."""
        return self.root / "build.json"

    def is_built(self) -> bool:
        """Whether a complete build of the current recipe is here."""
        try:
            stamp = json.loads(self.stamp.read_text())
        except (OSError, ValueError):
            return False
        files = [self.model / "model.safetensors", self.model / "tokenizer.json"]
        files += [self.adapter(t) / "adapter_model.safetensors" for t in ADAPTERS]
        built = stamp.get("fingerprint") == fingerprint(self.family)
        return built and all(f.is_file() for f in files)

    def fresh_run_dir(self) -> Path:
        """Empty the run folder (a previous run's catalog and store) and return it."""
        shutil.rmtree(self.run, ignore_errors=True)
        self.run.mkdir(parents=True)
        return self.run


class MissingPackages(DemoError):
    """A package the demo needs is not installed; the message says how to install it."""


def require(*packages: str) -> None:
    """MissingPackages naming those of `packages` that cannot be imported."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingPackages(
            f"the demo needs {', '.join(missing)}: pip install -e '.[demo]' (or: make demo)"
        )


def fingerprint(family: DemoFamily = FAMILIES["llama"]) -> str:
    """Hash of everything the build depends on: texts, family, shapes, recipes, ranks, seed."""
    from loraplane.demo import train

    recipe: dict[str, object] = {
        "version": BUILD_VERSION, "seed": SEED, "vocab": VOCAB_SIZE, "adapters": ADAPTERS,
        "questions": corpus.QUESTIONS, "styles": corpus.STYLES, "shape": family.shape,
        "base": asdict(train.BASE_RECIPE), "adapter": asdict(train.ADAPTER_RECIPE),
    }  # fmt: skip
    if family.name != "llama":  # the Llama build's fingerprint is the one it always had
        recipe["family"] = asdict(family)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _training_env() -> Iterator[None]:
    """One torch thread, no hub access, no progress bars, no deprecation chatter.

    One thread: the model is so small that a second thread gains little on an idle machine,
    and on a busy one (CI, two cores) its spin-waiting makes training several times slower;
    a fixed thread count also keeps the float sums, and so the build, reproducible.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.set_num_threads(threads)


def build(ws: Workspace, say: Say) -> float:
    """Build the tokenizer, base model and adapters into `ws`; return the seconds it took."""
    from loraplane.demo import train
    from loraplane.demo.build import build_tokenizer

    start = time.perf_counter()

    ws.stamp.unlink(missing_ok=True)
    for stale in (ws.model, ws.root / "adapters"):
        shutil.rmtree(stale, ignore_errors=True)
    texts = [t for style in corpus.STYLES for t in corpus.corpus(style)]
    vocab = build_tokenizer(ws.model, vocab_size=VOCAB_SIZE, corpus=texts)
    say(f"  [build 1/3] tokenizer: byte-level BPE, {vocab} tokens, in {ws.model}")
    family = ws.family
    shape = family.shape
    say(f"  [build 2/3] base model: {family.title}, {shape['num_hidden_layers']} layers, hidden "
        f"{shape['hidden_size']}, trained on the plain help-desk answers")  # fmt: skip
    with _training_env():
        train.train_base(ws.model, vocab, SEED, say, family)
        say("  [build 3/3] adapters: each tenant's phrasing of the same answers (PEFT LoRA)")
        for i, (tenant, (name, rank)) in enumerate(ADAPTERS.items(), start=1):
            say(f"    {tenant}: {name}, rank {rank}, {family.describe_targets()}")
            train.train_adapter(
                ws.model, ws.adapter(tenant), tenant, rank, SEED + i, say, ws.base_name, family
            )
    elapsed = time.perf_counter() - start
    ws.stamp.write_text(json.dumps({"fingerprint": fingerprint(), "seconds": elapsed}, indent=2))
    return elapsed
