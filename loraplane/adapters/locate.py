"""Where a LoRA weight belongs: its decoder layer and module, read from the tensor's name and
checked against the base model's family (`families`) and the adapter's config.

PEFT names a module's weights `base_model.model.<module path>.lora_A.weight`. The module path
is a decoder layer's linear layer (`model.layers.3.self_attn.q_proj`), one expert's
(`model.layers.3.block_sparse_moe.experts.5.w1`), or, for transformers 5's packed experts
adapted through `target_parameters`, the experts module itself: with both packed parameters
targeted PEFT nests its wrappers in the order the experts module registers them, so
`mlp.experts.base_layer` holds `gate_up_proj`'s factors and `mlp.experts` `down_proj`'s.

Cross-layout modules: a base whose checkpoints fuse q/k/v and gate/up (Phi-3's `qkv_proj`,
`gate_up_proj`) also accepts an adapter of the split projections (`q_proj`, ..., `up_proj`,
each with its part's shape), and a base of split projections accepts the fused names (with
the fused shapes): the data plane converts them to the base's layout when it loads them
(`packing`, rank-exact). `counterparts` says which of the base's modules serve such a module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.families import (
    ATTENTION_MODULES,
    FAMILIES,
    FUSED_ATTENTION_MODULES,
    KNOWN_MODULE_NAMES,
    MLP_MODULES,
    PACKED_EXPERT_PARAMS,
    refused_module,
)
from loraplane.adapters.peft_config import LoraSpec

_PEFT_PREFIX = "base_model.model."
_IN_LAYER = re.compile(
    r"^(?P<prefix>(?:[A-Za-z0-9_]+\.){0,3}?)layers\.(?P<layer>\d{1,6})\.(?P<rest>.+)$"
)
_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_BLOCKS = ("self_attn", "mlp", "block_sparse_moe")
_NOT_SERVED_PARTS = ("vision_tower", "vision_model", "multi_modal_projector", "audio_tower")
ATTENTION_NAMES = ATTENTION_MODULES + FUSED_ATTENTION_MODULES
MLP_NAMES = MLP_MODULES
_ALL_PREFIXES = tuple(dict.fromkeys(p for f in FAMILIES.values() for p in f.prefixes))
# A fused projection and the split projections it packs, in the order of its output rows
# (vLLM's packed_modules_mapping): Phi-3's checkpoints fuse them, the other families split.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
PART_OF = {part: fused for fused, parts in PACKED_MODULES.items() for part in parts}


def counterparts(base: BaseModelSpec, layer: int, module: str) -> tuple[str, ...] | None:
    """The modules of `base`'s own layout that serve `module` in decoder layer `layer` when
    the base lacks it: a split projection's fused module (`q_proj` -> `qkv_proj` on Phi-3),
    or a fused name's parts (`qkv_proj` -> q, k, v on Llama). None when the base has
    `module` itself or no layout of its serves it (an expert's, a sparse layer's MLP)."""
    if base.has_module(layer, module):
        return None
    fused = PART_OF.get(module)
    if fused is not None:
        return (fused,) if base.has_module(layer, fused) else None
    parts = PACKED_MODULES.get(module)
    if parts is not None and all(base.has_module(layer, p) for p in parts):
        return parts
    return None


@dataclass(frozen=True, slots=True)
class Located:
    """One LoRA weight's place in the base model."""

    layer: int
    block: str  # self_attn | mlp | block_sparse_moe
    module: str  # q_proj, qkv_proj, experts.5.w1, experts.gate_up_proj (packed)
    key: str  # the module's (or packed parameter's) name in the HF model, canonical layout
    stem: str  # where the canonical file keeps this module's lora_A / lora_B

    @property
    def packed(self) -> bool:
        return self.module.count(".") == 1


def strip_prefix(name: str) -> str:
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


def module_refused(name: str, what: str, base: BaseModelSpec | None) -> AdapterRejected:
    served = base.modules if base is not None else ("the family's linear layers",)
    where = f" of {base.name} ({base.model_type})" if base is not None else ""
    return AdapterRejected(
        ReasonCode.UNSUPPORTED_TARGET_MODULE,
        f"tensor {name!r} {what}; LoRA is served on " + ", ".join(served) + where,
    )


def _router(name: str, path: str) -> AdapterRejected:
    return AdapterRejected(
        ReasonCode.UNSUPPORTED_TARGET_MODULE,
        f"tensor {name!r}: " + str(refused_module("gate", path)),
    )


def _packed_targets(
    spec: LoraSpec, base: BaseModelSpec | None, prefix: str, layer: int
) -> list[str]:
    """The packed parameters the config targets in this layer, in registration order."""
    if base is not None and not base.family.packed_experts:
        return []
    return [
        p
        for p in PACKED_EXPERT_PARAMS
        if spec.parameter_miss(f"{prefix}layers.{layer}.mlp.experts.{p}") is None
    ]


def locate(name: str, path: str, spec: LoraSpec, base: BaseModelSpec | None) -> Located:
    """The place of LoRA weight `name` of module `path`, once the base model has that module
    and the config targets it; else the AdapterRejected that names the tensor."""
    short = strip_prefix(path)
    refused = refused_module(short.rsplit(".", 1)[-1], short)
    if refused is not None and not short.endswith(".gate"):
        raise AdapterRejected(ReasonCode.UNSUPPORTED_TARGET_MODULE, f"tensor {name!r}: {refused}")
    m = _IN_LAYER.match(short)
    prefixes = base.family.prefixes if base is not None else _ALL_PREFIXES
    if (
        m is None
        or m.group("prefix") not in prefixes
        or m.group("rest").split(".")[0] not in _BLOCKS
    ):
        hint = ""
        if any(part in short.split(".") for part in _NOT_SERVED_PARTS):
            hint = (
                " (a vision or audio tower and its projector are not served, only the text "
                "decoder: train with exclude_modules '.*vision_tower.*'"
                " or target the decoder by path)"
            )
        raise module_refused(
            name, f"adapts {short!r}, which is not a linear layer of a decoder block{hint}", base
        )
    own_prefix = m.group("prefix") or "model."
    layer = int(m.group("layer"))
    block, *parts = m.group("rest").split(".")
    router = parts in (["gate"], ["router"]) and block in ("mlp", "block_sparse_moe")
    if router and (base is None or base.family.moe):
        raise _router(name, f"{block}.{parts[0]}")
    if parts and parts[0] == "experts" and all(p == "base_layer" for p in parts[1:]):
        if block != "mlp":
            raise module_refused(name, f"adapts {block}.experts: packed experts live in mlp", base)
        targeted = _packed_targets(spec, base, own_prefix, layer)
        depth = len(parts) - 1
        if depth >= len(targeted):
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_TARGET_MODULE,
                f"tensor {name!r} adapts the packed experts of layer {layer}, but the config's "
                f"target_parameters {sorted(spec.target_parameters)!r} select "
                f"{len(targeted)} of their parameters there, which PEFT saves as "
                + (" and ".join(_stems(len(targeted))) or "nothing"),
            )
        module = f"experts.{targeted[len(targeted) - 1 - depth]}"
    elif len(parts) == 1 and _NAME.match(parts[0]):
        module = parts[0]
        refused = refused_module(module, f"{block}.{module}")
        if refused is not None and module != "gate":
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_TARGET_MODULE, f"tensor {name!r}: {refused}"
            )
    elif len(parts) == 3 and parts[0] == "experts" and parts[1].isdigit() and _NAME.match(parts[2]):
        module = ".".join(parts)
    else:
        raise module_refused(
            name, f"adapts {short!r}, which is not a linear layer of a decoder block", base
        )
    _check_in_base(name, layer, block, module, base)
    key = (base.module_key(layer, module) if base is not None
           else f"{own_prefix}layers.{layer}.{block}.{module}")  # fmt: skip
    own_key = f"{own_prefix}layers.{layer}.{block}.{module}"
    miss = (
        spec.parameter_miss(own_key) if module.count(".") == 1 else spec.target_miss(own_key, layer)
    )
    if miss is not None:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            f"tensor {name!r} adapts {key}, which the config does not target ({miss}): every "
            "tensor must belong to a targeted module",
        )
    layer_path = key[: key.index(f".{block}.")]
    stem = f"{layer_path}.{block}.{'.'.join(parts)}" if module.count(".") == 1 else key
    return Located(layer, block, module, key, stem)


def _stems(n: int) -> list[str]:
    return ["experts" + ".base_layer" * (n - 1 - i) for i in range(n)]


def _check_in_base(
    name: str, layer: int, block: str, module: str, base: BaseModelSpec | None
) -> None:
    """Refuse a module the base model (or, without one, every family) lacks in that block."""
    leaf = module.rsplit(".", 1)[-1]
    if base is None:
        if leaf not in KNOWN_MODULE_NAMES:
            raise module_refused(name, f"adapts module {leaf!r}, which the base model lacks", None)
        if (block == "self_attn") != (leaf in ATTENTION_NAMES):
            what = f"adapts {block}.{leaf}, which the base model lacks ({leaf} is not in {block})"
            raise module_refused(name, what, None)
        return
    if layer >= base.num_layers:
        raise AdapterRejected(
            ReasonCode.BASE_MODEL_MISMATCH,
            f"tensor {name!r} is for layer {layer} but {base.name} has {base.num_layers} layers "
            f"(0 to {base.num_layers - 1})",
        )
    if base.has_module(layer, module) or counterparts(base, layer, module) is not None:
        if base.module_block(module) != block:
            raise module_refused(
                name, f"adapts {block}.{module}, which the base model lacks ({leaf} is not in "
                f"{block}: {base.model_type} keeps it in {base.module_block(module)})", base,
            )  # fmt: skip
        return
    family = base.family
    if module.startswith("experts."):
        if not base.num_experts:
            why = f"adapts {block}.{module}, but {base.name} ({base.model_type}) has no experts"
        elif not base.is_moe_layer(layer):
            why = f"adapts {block}.{module}, but layer {layer} of {base.name} is a dense layer"
        else:
            why = (
                f"adapts {block}.{module}, which {base.name} lacks (its experts are 0 to "
                f"{base.num_experts - 1}, each with {', '.join(family.experts)})"
            )
    elif module in family.mlp or (family.moe and (module in MLP_NAMES or module == "gate_up_proj")):
        why = (
            f"adapts {block}.{module}, but layer {layer} of {base.name} is a mixture-of-experts "
            "layer (adapt its experts)"
        )
    else:
        why = f"adapts module {module!r}, which the base model lacks"
        if leaf in KNOWN_MODULE_NAMES:
            why += (
                f" ({base.model_type} layers have {', '.join(family.attention + family.mlp)}"
                + (": its checkpoints fuse q/k/v and gate/up" if "qkv_proj" in family.attention
                   else "")
                + ")"
            )  # fmt: skip
    raise module_refused(name, why, base)
