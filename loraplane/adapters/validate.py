"""Validate a PEFT LoRA adapter against a base model and limits.

Cheap checks run first (config, then the safetensors header, then tensor names and shapes);
the scan for NaN/Inf, which touches every byte, runs last. Every tensor must be explained by
the config and the base model: a lora_A or lora_B weight of a module the base model has and the
config targets (as vLLM requires); anything else is refused, never stored as dead weight. The
first failure raises `AdapterRejected` with its reason code and a message naming the tensor or
field and the numbers.

A DoRA adapter (`use_dora: true`) carries one more tensor per module, PEFT's
`<module path>.lora_magnitude_vector` ([out_features], float, finite), and every module must
have it; a magnitude vector without `use_dora` is refused (DoRANotSupported), as is DoRA where
it is not served: on a mixture of experts' expert modules, and on modules of the other layout
than the base's (a conversion would have to rebuild the magnitudes of rows the adapter does
not train).

On a base of the other layout (split q/k/v and gate/up on Phi-3's fused `qkv_proj` and
`gate_up_proj`, or the fused names on a split base), modules are checked with their own
shapes (a part's, or the fused module's) and kept as uploaded (the digest and the stored
files are what the tenant uploaded); `conversions` lists what the data plane builds from them
when it loads the adapter. Fusing places the parts' A's side by side in the rank, so the fused
module's rank is the sum of its parts' ranks: that rank is the one checked against the pool's
`max_rank` (RankTooLarge, naming the module and the parts' ranks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.families import KNOWN_MODULE_NAMES, refused_module
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.locate import PACKED_MODULES, Located, counterparts, locate, strip_prefix
from loraplane.adapters.peft_config import LoraSpec, parse_adapter_config
from loraplane.adapters.safetensors_io import SafetensorsFile
from loraplane.adapters.source import AdapterFiles

# PEFT saves `base_model.model.<module path>.lora_A.weight`; the prefix is optional so files
# written by other tools with the bare module path are accepted too.
_LORA_WEIGHT = re.compile(r"^(?P<path>.+)\.lora_(?P<which>[AB])\.weight$")
# DoRA's magnitude vector, as PEFT saves it (`.weight` as an older naming might add it)
_MAGNITUDE = re.compile(r"^(?P<path>.+)\.lora_magnitude_vector(?:\.weight)?$")
# A base-model parameter saved whole (what PEFT's modules_to_save writes): a decoder layer's
# linear layer or norm, the final norm, the embeddings or the head.
_BASE_WEIGHT = re.compile(
    r"^(?:model\.)?(?:layers\.\d{1,6}\.(?:(?:self_attn|mlp)\.[A-Za-z0-9_]+|[A-Za-z0-9_]*norm)"
    r"|norm|embed_tokens|lm_head)\.weight$"
)
_OTHER_LORA = re.compile(r"(?:^|\.)([A-Za-z0-9_]+)\.lora_[AB](?:\.|$)")
_SAVED_MODULES = ("lm_head", "embed_tokens", "score", "modules_to_save", "classifier")
# The order modules are listed in (target_modules, summaries): q, k, v, o, then the MLP, then
# experts (an expert's index left out: `experts.w1`).
_ORDER = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
    "down_proj", "experts.w1", "experts.w3", "experts.w2", "experts.gate_proj",
    "experts.up_proj", "experts.gate_up_proj", "experts.down_proj",
)  # fmt: skip


def generic_module(module: str) -> str:
    """A module's name without an expert's index: `experts.5.w1` -> `experts.w1`."""
    parts = module.split(".")
    return f"experts.{parts[2]}" if len(parts) == 3 and parts[0] == "experts" else module


def _module_order(module: str) -> tuple[int, int]:
    generic = generic_module(module)
    rank = _ORDER.index(generic) if generic in _ORDER else len(_ORDER)
    parts = module.split(".")
    return rank, int(parts[1]) if len(parts) == 3 else -1


@dataclass(frozen=True, slots=True)
class ModuleLoRA:
    """One adapted linear layer (or packed experts' parameter): where it is, its rank and
    scale, and its tensors' names.

    `module` is the name inside its block: `q_proj`, `qkv_proj`, one expert's `experts.5.w1`,
    or a packed parameter `experts.gate_up_proj`, whose A is [rank * experts, in] (expert-major
    rows) and B [out, rank * experts] (rank-major columns), as PEFT's ParamWrapper lays them
    out; `in_features` / `out_features` are one expert's. `key` is its name in the HF model
    (transformers 5 layout) and `stem` the module path its canonical tensors are named after.
    """

    layer: int
    module: str
    rank: int
    alpha: float
    scale: float
    in_features: int
    out_features: int
    a_name: str
    b_name: str
    key: str = ""
    stem: str = ""
    experts: int = 1  # > 1: a packed parameter's expert count
    m_name: str = ""  # DoRA: the magnitude vector's tensor name ([out_features]); "" otherwise

    def canonical_names(self) -> tuple[str, str]:
        stem = self.stem or self.key
        return (
            f"base_model.model.{stem}.lora_A.weight",
            f"base_model.model.{stem}.lora_B.weight",
        )

    def canonical_magnitude_name(self) -> str:
        """The DoRA magnitude vector's name in the canonical weights file."""
        return f"base_model.model.{self.stem or self.key}.lora_magnitude_vector"


@dataclass(frozen=True, slots=True)
class Conversion:
    """One module of the base's own layout that serving builds from modules of the other
    layout (`packing.fuse` / `packing.split`, rank-exact).

    Fusing (split parts onto a fused base): `module` is the fused module (`qkv_proj`),
    `parts` the adapter's modules it is made of (the ones the adapter has: a part left out is
    zero rows of B), `rank` the sum of their ranks (at most: parts sharing one A fuse at that
    A's rank). Splitting (a fused name onto a split base): `module` is one part (`k_proj`),
    `parts` the one fused module it comes from, `rank` the fused module's."""

    layer: int
    module: str
    parts: tuple[ModuleLoRA, ...]
    rank: int

    @property
    def fuses(self) -> bool:
        return self.module in PACKED_MODULES


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
    # modules of the base's layout serving builds from the other layout's (empty: none)
    conversions: tuple[Conversion, ...] = ()

    @property
    def rank(self) -> int:
        """The largest rank of the modules as uploaded."""
        return max(m.rank for m in self.modules)

    @property
    def served_rank(self) -> int:
        """The largest rank of a module as the base serves it (a fused module built from
        parts: the sum of their ranks)."""
        converted = {(p.layer, p.module) for c in self.conversions for p in c.parts}
        kept = [m.rank for m in self.modules if (m.layer, m.module) not in converted]
        return max(kept + [c.rank for c in self.conversions])

    @property
    def target_modules(self) -> list[str]:
        present = {generic_module(m.module) for m in self.modules}
        return sorted(present, key=_module_order)

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
        out: dict[str, Any] = {
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
        if self.spec.use_dora:  # absent otherwise: summaries of plain LoRA stay what they were
            out["use_dora"] = True
        if self.conversions:  # served in the base's other layout
            out["served_rank"] = self.served_rank
            out["served_modules"] = sorted({c.module for c in self.conversions},
                                           key=_module_order)  # fmt: skip
        return out

    def close(self) -> None:
        self.weights.close()


def _classify_foreign(name: str) -> AdapterRejected:
    """The reason a tensor that is not a LoRA A/B weight (or, with use_dora, a magnitude
    vector) is refused: nothing in the config explains it."""
    if "lora_magnitude_vector" in name:
        return AdapterRejected(
            ReasonCode.DORA_NOT_SUPPORTED,
            f"tensor {name!r} is a DoRA magnitude vector, but adapter_config.json does not set "
            "use_dora: true",
        )
    if name.endswith(".bias"):
        return AdapterRejected(ReasonCode.BIAS_NOT_SUPPORTED, f"tensor {name!r} is a bias term")
    if "lora_embedding_" in name:
        return AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r} adapts an embedding layer: " + str(refused_module("embed_tokens")),
        )
    m = _OTHER_LORA.search(name)
    if m and m.group(1) not in KNOWN_MODULE_NAMES:
        refused = refused_module(m.group(1))
        return AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r}: {refused}"
            if refused
            else f"tensor {name!r} adapts module {m.group(1)!r}; supported: "
            + ", ".join(KNOWN_MODULE_NAMES),
        )
    if _BASE_WEIGHT.match(strip_prefix(name)) or any(
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


def _pair_tensors(
    weights: SafetensorsFile, spec: LoraSpec, base: BaseModelSpec | None
) -> dict[tuple[int, str], tuple[Located, dict[str, str]]]:
    """Every tensor must be explained by the config and the base model: a LoRA A or B weight
    of a module the base model has and the config targets. Group them by module."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    places: dict[tuple[int, str], Located] = {}
    for name in sorted(weights.tensors):
        m = _LORA_WEIGHT.match(name)
        magnitude = _MAGNITUDE.match(name) if m is None and spec.use_dora else None
        found = m or magnitude
        if found is None:
            raise _classify_foreign(name)
        place = locate(name, found.group("path"), spec, base)
        layer, module = place.layer, place.module
        places.setdefault((layer, module), place)
        which = m.group("which") if m is not None else "M"
        slot = pairs.setdefault((layer, module), {})
        if which in slot:
            what = f"lora_{which}" if which != "M" else "lora_magnitude_vector"
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_FORMAT,
                f"two {what} tensors for layer {layer} {module}: {slot[which]!r}, {name!r}",
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
        if spec.use_dora and "M" not in slot:
            raise AdapterRejected(
                ReasonCode.SHAPE_MISMATCH,
                f"layer {layer} {module} has no lora_magnitude_vector, but use_dora is true: "
                "a DoRA adapter carries one per adapted module",
            )
    return {where: (places[where], slot) for where, slot in pairs.items()}


def _check_module(
    spec: LoraSpec,
    weights: SafetensorsFile,
    place: Located,
    names: dict[str, str],
    base: BaseModelSpec | None,
    seen_shapes: dict[str, tuple[int, int]],
) -> ModuleLoRA:
    layer, module, key = place.layer, place.module, place.key
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
    want = spec.rank_for(key)
    # A packed parameter's factors hold every expert's: rank * experts rows of A.
    experts = 1
    if place.packed:
        experts = base.num_experts if base is not None else max(1, rank_a // want)
    if rank_a != want * experts:
        per = f" x {experts} experts" if place.packed else ""
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: tensors have rank {rank_a} but the config gives rank {want}{per} "
            "(r / rank_pattern)",
        )
    if base is not None:
        base_in, base_out = base.module_shape(module)
        if (in_f, out_f) != (base_in, base_out):
            raise AdapterRejected(
                ReasonCode.SHAPE_MISMATCH,
                f"{where}: lora_A is {rank_a}x{in_f} and lora_B {out_f}x{rank_b}, but "
                f"{base.name} needs A {rank_a}x{base_in} and B {base_out}x{rank_a}"
                + _layout_hint(base, layer, module),
            )
    elif seen_shapes.setdefault(generic_module(module), (in_f, out_f)) != (in_f, out_f):
        first = seen_shapes[generic_module(module)]
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: in/out features {in_f}/{out_f} differ from another layer's "
            f"{first[0]}/{first[1]}",
        )
    m_name = names.get("M", "")
    if m_name:
        _check_magnitude(weights, m_name, where, out_f, place.packed or "experts." in module)
    return ModuleLoRA(
        layer=layer,
        module=module,
        rank=want,
        alpha=spec.alpha_for(key),
        scale=spec.scale_for(key),
        in_features=in_f,
        out_features=out_f,
        a_name=names["A"],
        b_name=names["B"],
        key=key,
        stem=place.stem,
        experts=experts,
        m_name=m_name,
    )


def _check_magnitude(
    weights: SafetensorsFile, name: str, where: str, out_f: int, expert: bool
) -> None:
    """A DoRA magnitude vector: [out_features] (its values are scanned with the rest)."""
    if expert:
        raise AdapterRejected(
            ReasonCode.DORA_NOT_SUPPORTED,
            f"{where}: DoRA on a mixture of experts' expert weights is not served (only on "
            "the attention and dense MLP projections); train the experts with plain LoRA",
        )
    shape = list(weights.tensors[name].shape)
    if shape != [out_f]:
        raise AdapterRejected(
            ReasonCode.SHAPE_MISMATCH,
            f"{where}: lora_magnitude_vector is {shape}, but the module has {out_f} output "
            f"features: it must be [{out_f}]",
        )


def _layout_hint(base: BaseModelSpec, layer: int, module: str) -> str:
    """For a module of the other layout, what it is on this base (for a shape refusal)."""
    served = counterparts(base, layer, module)
    if served is None:
        return ""
    if module in PACKED_MODULES:
        return (f" ({module} is split into {', '.join(served)} on {base.model_type}: "
                "its B's rows are theirs, in that order)")  # fmt: skip
    fused = served[0]
    rows = base.module_shape(module)[1]
    return (f" ({module} is served as {rows} of the {base.module_shape(fused)[1]} rows of "
            f"{base.model_type}'s fused {fused})")  # fmt: skip


def conversions(modules: list[ModuleLoRA], base: BaseModelSpec | None) -> tuple[Conversion, ...]:
    """The modules of `base`'s own layout that serving builds from `modules` of the other
    layout, in module order (empty when every module is the base's own)."""
    if base is None:
        return ()
    out: list[Conversion] = []
    fused: dict[tuple[int, str], list[ModuleLoRA]] = {}
    for m in modules:
        served = counterparts(base, m.layer, m.module)
        if served is None:
            continue
        if m.module in PACKED_MODULES:  # a fused name on a split base: each part its rows
            out += [Conversion(m.layer, part, (m,), m.rank) for part in served]
        else:
            fused.setdefault((m.layer, served[0]), []).append(m)
    for (layer, name), parts in fused.items():
        order = PACKED_MODULES[name]
        parts.sort(key=lambda p: order.index(p.module))
        out.append(Conversion(layer, name, tuple(parts), sum(p.rank for p in parts)))
    return tuple(sorted(out, key=lambda c: (c.layer, *_module_order(c.module))))


def check_served_rank(
    found: tuple[Conversion, ...], base: BaseModelSpec, limits: AdapterLimits
) -> None:
    """RankTooLarge when a fused module built from parts needs a rank over the limit."""
    if limits.max_rank is None:
        return
    for c in found:
        if c.fuses and c.rank > limits.max_rank:
            names = [p.module for p in c.parts]
            raise AdapterRejected(
                ReasonCode.RANK_TOO_LARGE,
                f"layer {c.layer} {c.module}: {base.name} ({base.model_type}) fuses "
                f"{', '.join(PACKED_MODULES[c.module])} into one {c.module}, so the adapter's "
                f"{' + '.join(names)} of ranks {' + '.join(str(p.rank) for p in c.parts)} "
                f"are served as one module of rank {c.rank}, which exceeds "
                f"{limits.rank_limit_text()}: train them with ranks adding up to at most "
                f"{limits.max_rank}, or train on the fused {c.module}",
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
            f"{files.weights_path.name} is {size} bytes, over {limits.bytes_limit_text()}",
        )
    weights = SafetensorsFile(files.weights_path, max_tensors=limits.max_tensors)
    try:
        modules = _check_modules(spec, weights, base)
        found = conversions(modules, base)
        if found and spec.use_dora and base is not None:
            raise AdapterRejected(
                ReasonCode.DORA_NOT_SUPPORTED,
                f"a DoRA adapter of {', '.join(sorted({p.module for c in found for p in c.parts}))}"
                f" cannot be served on {base.name} ({base.model_type}), whose layers have "
                f"{', '.join(base.family.attention + base.family.mlp)}: DoRA is served only on "
                "the base's own layout (train on its modules)",
            )
        if base is not None:
            check_served_rank(found, base, limits)
        if scan_weights:
            for name in sorted(weights.tensors):
                check_finite(weights, name)
    except BaseException:
        weights.close()
        raise
    dtypes = tuple(sorted({t.dtype for t in weights.tensors.values()}))
    return ValidatedAdapter(
        spec, modules, weights, files, dtypes, base.name if base else None,
        config_bytes=config_bytes, conversions=found,
    )  # fmt: skip


def _check_modules(
    spec: LoraSpec, weights: SafetensorsFile, base: BaseModelSpec | None
) -> list[ModuleLoRA]:
    if spec.target_parameters and base is not None and not base.family.packed_experts:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"target_parameters {sorted(spec.target_parameters)!r} name packed experts, but "
            f"{base.name} ({base.model_type}) has none: PEFT would adapt nothing there",
        )
    pairs = _pair_tensors(weights, spec, base)
    if base is not None:
        _refuse_both_layouts(pairs, base)
    seen: dict[str, tuple[int, int]] = {}
    return [
        _check_module(spec, weights, *pairs[where], base, seen)
        for where in sorted(pairs, key=lambda lm: (lm[0], *_module_order(lm[1])))
    ]


def _refuse_both_layouts(pairs: dict[tuple[int, str], Any], base: BaseModelSpec) -> None:
    """A layer may adapt a fused projection or its parts, not both (no model has both)."""
    for layer, module in sorted(pairs, key=lambda lm: (lm[0], *_module_order(lm[1]))):
        served = counterparts(base, layer, module)
        if served is None:
            continue
        fused, parts = (module, served) if module in PACKED_MODULES else (served[0], (module,))
        clash = [p for p in (fused, *parts) if p != module and (layer, p) in pairs]
        if clash:
            family = base.family
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_TARGET_MODULE,
                f"layer {layer} is adapted on both the fused {fused} and its part "
                f"{next(p for p in (module, *clash) if p != fused)}: {base.model_type} "
                f"layers have {', '.join(family.attention + family.mlp)}, and an adapter "
                f"targets either the fused {fused} or its parts {', '.join(PACKED_MODULES[fused])}",
            )
