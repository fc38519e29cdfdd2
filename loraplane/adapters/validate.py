"""Validate a PEFT LoRA adapter against a base model and limits.

Cheap checks run first (config, then the safetensors header, then tensor names and shapes);
the scan for NaN/Inf, which touches every byte, runs last. Every tensor must be explained by
the config and the base model: a lora_A or lora_B weight of a module the base model has and the
config targets (as vLLM requires); anything else is refused, never stored as dead weight. The
first failure raises `AdapterRejected` with its reason code and a message naming the tensor or
field and the numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from loraplane.adapters.base_model import ATTENTION_MODULES, SUPPORTED_MODULES, BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.peft_config import LoraSpec, parse_adapter_config
from loraplane.adapters.safetensors_io import SafetensorsFile
from loraplane.adapters.source import AdapterFiles

# PEFT saves `base_model.model.<module path>.lora_A.weight`; the prefix is optional so files
# written by other tools with the bare module path are accepted too.
_PEFT_PREFIX = "base_model.model."
_LORA_WEIGHT = re.compile(r"^(?P<path>.+)\.lora_(?P<which>[AB])\.weight$")
_LAYER_MODULE = re.compile(r"^(?:model\.)?layers\.(\d{1,6})\.(self_attn|mlp)\.([A-Za-z0-9_]+)$")
# A base-model parameter saved whole (what PEFT's modules_to_save writes): a decoder layer's
# linear layer or norm, the final norm, the embeddings or the head.
_BASE_WEIGHT = re.compile(
    r"^(?:model\.)?(?:layers\.\d{1,6}\.(?:(?:self_attn|mlp)\.[A-Za-z0-9_]+|[A-Za-z0-9_]*norm)"
    r"|norm|embed_tokens|lm_head)\.weight$"
)
_OTHER_LORA = re.compile(r"(?:^|\.)([A-Za-z0-9_]+)\.lora_[AB](?:\.|$)")
_SAVED_MODULES = ("lm_head", "embed_tokens", "score", "modules_to_save", "classifier")


@dataclass(frozen=True, slots=True)
class ModuleLoRA:
    """One adapted linear layer: where it is, its rank and scale, and its tensors' names."""

    layer: int
    module: str
    rank: int
    alpha: float
    scale: float
    in_features: int
    out_features: int
    a_name: str
    b_name: str

    @property
    def key(self) -> str:
        block = "self_attn" if self.module in ATTENTION_MODULES else "mlp"
        return f"model.layers.{self.layer}.{block}.{self.module}"

    def canonical_names(self) -> tuple[str, str]:
        return (
            f"base_model.model.{self.key}.lora_A.weight",
            f"base_model.model.{self.key}.lora_B.weight",
        )


@dataclass(slots=True)
class ValidatedAdapter:
    """An adapter that passed every check; its weights file stays open (memory-mapped)."""

    spec: LoraSpec
    modules: list[ModuleLoRA]
    weights: SafetensorsFile
    files: AdapterFiles
    dtypes: tuple[str, ...]
    base_model: str | None = None
    warnings: list[str] = field(default_factory=list)
    config_bytes: bytes = b""  # the config file as read and checked

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def target_modules(self) -> list[str]:
        present = {m.module for m in self.modules}
        return [m for m in SUPPORTED_MODULES if m in present]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.tensors.values())

    @property
    def num_layers(self) -> int:
        return len({m.layer for m in self.modules})

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description (ranks, alpha, scales, modules, sizes)."""
        ranks = sorted({m.rank for m in self.modules})
        scales = sorted({round(m.scale, 6) for m in self.modules})
        return {
            "rank": self.rank,
            "ranks": ranks,
            "alpha": self.spec.lora_alpha,
            "use_rslora": self.spec.use_rslora,
            "scales": scales,
            "target_modules": self.target_modules,
            "layers": self.num_layers,
            "modules": len(self.modules),
            "tensors": len(self.weights.tensors),
            "dtypes": list(self.dtypes),
            "size_bytes": self.tensor_bytes,
            "base_model": self.base_model,
            "base_model_name_or_path": self.spec.base_model_name_or_path,
        }

    def close(self) -> None:
        self.weights.close()


def _strip_prefix(name: str) -> str:
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


def _classify_foreign(name: str) -> AdapterRejected:
    """The reason a tensor that is not a LoRA A/B weight is refused: nothing in a LoRA config
    explains it."""
    if "lora_magnitude_vector" in name:
        return AdapterRejected(
            ReasonCode.DORA_NOT_SUPPORTED, f"tensor {name!r} is a DoRA magnitude vector"
        )
    if name.endswith(".bias"):
        return AdapterRejected(ReasonCode.BIAS_NOT_SUPPORTED, f"tensor {name!r} is a bias term")
    if "lora_embedding_" in name:
        return AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r} adapts an embedding layer, which no served config can target",
        )
    m = _OTHER_LORA.search(name)
    if m and m.group(1) not in SUPPORTED_MODULES:
        return AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r} adapts module {m.group(1)!r}; supported: "
            + ", ".join(SUPPORTED_MODULES),
        )
    if _BASE_WEIGHT.match(_strip_prefix(name)) or any(
        part in name.split(".") for part in _SAVED_MODULES
    ):
        return AdapterRejected(
            ReasonCode.MODULES_TO_SAVE_NOT_SUPPORTED,
            f"tensor {name!r} is a full copy of a base-model module (modules_to_save), which "
            "the config does not declare and which is not served",
        )
    return AdapterRejected(
        ReasonCode.UNSUPPORTED_FORMAT,
        f"unexpected tensor {name!r}: a config explains only the lora_A/lora_B weights of its "
        "target modules, named like "
        "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'",
    )


def _locate(name: str, path: str, spec: LoraSpec, base: BaseModelSpec | None) -> tuple[int, str]:
    """(layer, module) of a LoRA weight named `name` for module `path`, once the base model
    has that module and the config targets it; else the rejection that names the tensor."""
    short = _strip_prefix(path)
    m = _LAYER_MODULE.match(short)
    if m is None:
        raise _module_refused(
            name, f"adapts {short!r}, which is not a linear layer of a decoder block"
        )
    layer, block, module = int(m.group(1)), m.group(2), m.group(3)
    if module not in SUPPORTED_MODULES:
        raise _module_refused(name, f"adapts module {module!r}, which the base model lacks")
    if (block == "self_attn") != (module in ATTENTION_MODULES):
        raise _module_refused(
            name,
            f"adapts {block}.{module}, which the base model lacks ({module} is not in {block})",
        )
    if base is not None and layer >= base.num_layers:
        raise AdapterRejected(
            ReasonCode.BASE_MODEL_MISMATCH,
            f"tensor {name!r} is for layer {layer} but {base.name} has {base.num_layers} layers "
            f"(0 to {base.num_layers - 1})",
        )
    key = f"model.layers.{layer}.{block}.{module}"
    miss = spec.target_miss(key, layer)
    if miss is not None:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r} adapts {key}, which the config does not target ({miss}): every "
            "tensor must belong to a targeted module",
        )
    return layer, module


def _module_refused(name: str, what: str) -> AdapterRejected:
    return AdapterRejected(
        ReasonCode.UNSUPPORTED_TARGET_MODULE,
        f"tensor {name!r} {what}; LoRA is served on " + ", ".join(SUPPORTED_MODULES),
    )


def _pair_tensors(
    weights: SafetensorsFile, spec: LoraSpec, base: BaseModelSpec | None
) -> dict[tuple[int, str], dict[str, str]]:
    """Every tensor must be explained by the config and the base model: a LoRA A or B weight
    of a module the base model has and the config targets. Group them by module."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in sorted(weights.tensors):
        m = _LORA_WEIGHT.match(name)
        if m is None:
            raise _classify_foreign(name)
        layer, module = _locate(name, m.group("path"), spec, base)
        which = m.group("which")
        slot = pairs.setdefault((layer, module), {})
        if which in slot:
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_FORMAT,
                f"two lora_{which} tensors for layer {layer} {module}: {slot[which]!r}, {name!r}",
            )
        slot[which] = name
    if not pairs:
        raise AdapterRejected(ReasonCode.UNSUPPORTED_FORMAT, "the weights file holds no tensors")
    for (layer, module), slot in pairs.items():
        for which in "AB":
            if which not in slot:
                other = "B" if which == "A" else "A"
                raise AdapterRejected(
                    ReasonCode.SHAPE_MISMATCH,
                    f"layer {layer} {module} has lora_{other} but no lora_{which}",
                )
    return pairs


def _check_module(
    spec: LoraSpec,
    weights: SafetensorsFile,
    layer: int,
    module: str,
    names: dict[str, str],
    base: BaseModelSpec | None,
    seen_shapes: dict[str, tuple[int, int]],
) -> ModuleLoRA:
    a, b = weights.tensors[names["A"]], weights.tensors[names["B"]]
    where = f"layer {layer} {module}"
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} must both be 2-D",
        )
    (rank_a, in_f), (out_f, rank_b) = a.shape, b.shape
    if rank_a != rank_b:
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: lora_A has rank {rank_a} but lora_B has rank {rank_b}",
        )
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    key = f"model.layers.{layer}.{block}.{module}"
    want = spec.rank_for(key)
    if rank_a != want:
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: tensors have rank {rank_a} but the config gives rank {want} "
            "(r / rank_pattern)",
        )
    if base is not None:
        base_in, base_out = base.module_shape(module)
        if (in_f, out_f) != (base_in, base_out):
            raise AdapterRejected(
                ReasonCode.SHAPE_MISMATCH,
                f"{where}: lora_A is {rank_a}x{in_f} and lora_B {out_f}x{rank_b}, but "
                f"{base.name} needs A {rank_a}x{base_in} and B {base_out}x{rank_a}",
            )
    elif seen_shapes.setdefault(module, (in_f, out_f)) != (in_f, out_f):
        first = seen_shapes[module]
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: in/out features {in_f}/{out_f} differ from another layer's "
            f"{first[0]}/{first[1]}",
        )
    return ModuleLoRA(
        layer=layer,
        module=module,
        rank=rank_a,
        alpha=spec.alpha_for(key),
        scale=spec.scale_for(key),
        in_features=in_f,
        out_features=out_f,
        a_name=names["A"],
        b_name=names["B"],
    )


def check_finite(weights: SafetensorsFile, name: str) -> None:
    """Raise NonFiniteWeights if the tensor holds a NaN or an Inf."""
    bad = weights.first_non_finite(name)
    if bad is not None:
        raise AdapterRejected(
            ReasonCode.NON_FINITE_WEIGHTS,
            f"tensor {name!r} holds NaN or Inf (first at flat index {bad})",
        )


def validate_adapter(
    files: AdapterFiles,
    base: BaseModelSpec | None,
    limits: AdapterLimits,
    *,
    scan_weights: bool = True,
) -> ValidatedAdapter:
    """Run every check; return the open, validated adapter or raise AdapterRejected.

    `scan_weights=False` skips the NaN/Inf scan for a caller that scans while it copies the
    weights anyway (`canonical.write_canonical(..., scan_weights=True)` in ingest).
    """
    try:
        config_bytes = files.config_path.read_bytes()
    except OSError as e:
        raise AdapterRejected(ReasonCode.INVALID_CONFIG, f"cannot read config: {e}") from e
    spec = parse_adapter_config(config_bytes)
    if limits.max_rank is not None and spec.max_rank > limits.max_rank:
        raise AdapterRejected(
            ReasonCode.RANK_TOO_LARGE,
            f"rank {spec.max_rank} exceeds {limits.rank_limit_text()}",
        )
    size = files.weights_path.stat().st_size
    if size > limits.max_bytes:
        raise AdapterRejected(
            ReasonCode.TOO_LARGE,
            f"{files.weights_path.name} is {size} bytes, over the limit of {limits.max_bytes}",
        )
    weights = SafetensorsFile(files.weights_path, max_tensors=limits.max_tensors)
    try:
        modules = _check_modules(spec, weights, base)
        if scan_weights:
            for name in sorted(weights.tensors):
                check_finite(weights, name)
    except BaseException:
        weights.close()
        raise
    dtypes = tuple(sorted({t.dtype for t in weights.tensors.values()}))
    return ValidatedAdapter(
        spec, modules, weights, files, dtypes, base.name if base else None,
        config_bytes=config_bytes,
    )  # fmt: skip


def _check_modules(
    spec: LoraSpec, weights: SafetensorsFile, base: BaseModelSpec | None
) -> list[ModuleLoRA]:
    pairs = _pair_tensors(weights, spec, base)
    seen: dict[str, tuple[int, int]] = {}
    order = {m: i for i, m in enumerate(SUPPORTED_MODULES)}
    return [
        _check_module(spec, weights, layer, module, pairs[(layer, module)], base, seen)
        for layer, module in sorted(pairs, key=lambda lm: (lm[0], order[lm[1]]))
    ]
