"""What the adapter core needs to know about a base model: its adaptable modules' shapes.

Built from the model's `config.json` alone (no weights, no torch), so the control plane and
the operator can validate adapters against a base model they never load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane import fileaccess
from loraplane.adapters.families import (
    ATTENTION_MODULES,
    FAMILIES,
    FUSED_ATTENTION_MODULES,
    MLP_MODULES,
    PACKED_EXPERT_PARAMS,
    Family,
)

# The linear layers a LoRA adapter may target in a decoder layer of the Llama layout (the
# other families' are in `families`).
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# the families `loraplane serve --tensor-parallel-size` splits (dataplane/parallel/): dense
# MLPs, and the mixtures of experts (each expert split as a dense MLP, the router replicated)
TENSOR_PARALLEL_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3",
    "mixtral", "qwen3_moe",
)  # fmt: skip


def tensor_parallel_problem(
    model_type: str,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    size: int,
    moe_intermediate_size: int = 0,
) -> str | None:
    """Why a base of these shapes cannot be split over `size` processes, or None: the one
    rule the data plane applies, the operator checks a ServingPool against and the planner
    plans with (each adds where the numbers came from). `moe_intermediate_size`: one
    expert's width (a mixture of experts; 0 for a dense model)."""
    if size == 1:
        return None
    if model_type not in TENSOR_PARALLEL_FAMILIES:
        return (
            f"model_type {model_type!r} is not split by tensor parallelism yet (supported:"
            f" {', '.join(TENSOR_PARALLEL_FAMILIES)})"
        )
    for name, value in (
        ("num_attention_heads", num_heads),
        ("intermediate_size", intermediate_size),
        ("moe_intermediate_size", moe_intermediate_size),
    ):
        if value % size:
            return f"tensor parallel size {size} does not divide {name} ({value})"
    if num_kv_heads % size and size % num_kv_heads:
        return (
            f"tensor parallel size {size} neither divides num_key_value_heads ({num_kv_heads})"
            " nor is a multiple of it (each rank holds its share of the KV heads, or one)"
        )
    return None


class BaseModelError(ValueError):
    """A base model's config.json cannot be used (missing fields, unsupported architecture)."""


class BaseModelUnavailable(BaseModelError):
    """A base model's config.json cannot be read now (missing, unreadable, store down)."""


MAX_CONFIG_BYTES = 1 << 20
CONFIG_NAME = "config.json"


W4_GROUP = 128  # the group size 4-bit checkpoints most often have (inputs per scale)


def checkpoint_quantization(config: dict[str, Any]) -> str | None:
    """The form of a checkpoint's projections by its config.json's `quantization_config`:
    "int4" (compressed-tensors pack-quantized, AWQ, GPTQ), "fp8" (compressed-tensors float
    or naive, transformers' block-wise "fp8"), "unsupported" (any other method or format: the
    data plane refuses it at load, naming it), None (16-bit)."""
    stored = config.get("quantization_config")
    if not isinstance(stored, dict):
        return None
    method, fmt = stored.get("quant_method"), stored.get("format")
    if method in ("awq", "gptq") or (method == "compressed-tensors" and fmt == "pack-quantized"):
        return "int4"
    if method == "compressed-tensors" and fmt in ("float-quantized", "naive-quantized"):
        return "fp8"
    if method == "fp8" and fp8_block(stored) is not None:
        return "fp8"
    return "unsupported"


def fp8_block(stored: Any) -> tuple[int, int] | None:
    """(rows, columns) of a block-wise FP8 checkpoint's scale blocks (transformers' quant_method
    "fp8", `weight_block_size`; compressed-tensors' strategy "block", `block_structure`), None
    when the quantization_config names none usable."""
    if not isinstance(stored, dict):
        return None
    size = stored.get("weight_block_size")
    if stored.get("quant_method") == "compressed-tensors":
        scheme = _weights_scheme(stored)
        size = scheme.get("block_structure") if scheme.get("strategy") == "block" else None
    if (
        isinstance(size, list | tuple) and len(size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    ):  # fmt: skip
        return int(size[0]), int(size[1])
    return None


def fp8_block_split_problem(shape: BaseModelSpec, size: int, block: tuple[int, int]) -> str | None:
    """Why FP8 weights with a scale per `block` (rows, columns) cannot be split over `size`
    ranks, or None. A rank's slice of a projection may start inside a scale block (it keeps
    the blocks it touches, read from that offset: parallel/shard.py), so only a fused
    projection, whose rank slice is several runs (Phi-3's q, k and v rows in qkv_proj, gate
    and up in gate_up_proj), needs each run to be whole blocks."""
    if size == 1:
        return None
    rows, cols = block
    per_rank = []
    if "qkv_proj" in shape.family.attention:
        # each rank's KV heads, or the one head it holds (fewer KV heads than ranks)
        kv_heads = shape.num_kv_heads // size if shape.num_kv_heads % size == 0 else 1
        per_rank += [("qkv_proj's q rows", shape.num_heads * shape.head_dim // size),
                     ("qkv_proj's k and v rows", kv_heads * shape.head_dim)]  # fmt: skip
    if "gate_up_proj" in shape.family.mlp:
        per_rank.append(("gate_up_proj's gate and up rows", shape.intermediate_size // size))
    for what, count in per_rank:
        if count % rows:
            return (
                f"FP8 weights in blocks of {rows}x{cols} do not split over {size} GPUs: {what}"
                f" come to {count:,} per GPU, not whole blocks of {rows} (a fused projection's"
                " parts must be)"
            )
    return None


def _weights_scheme(stored: dict[str, Any]) -> dict[str, Any]:
    """The weights scheme of a compressed-tensors quantization_config's one config group ({}
    when it has none, or several: models/quant.py `config_group` refuses those by name)."""
    groups = stored.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        return {}
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, dict) else None
    return weights if isinstance(weights, dict) else {}


def checkpoint_w4_group(config: dict[str, Any]) -> int:
    """The inputs per scale of a 4-bit checkpoint's projections as its config.json says them
    (-1: one group per row), W4_GROUP where it says nothing readable (models/w4_formats.py
    reads them strictly, for the load)."""
    stored = config.get("quantization_config")
    value: Any = None
    if isinstance(stored, dict):
        value = stored.get("group_size", stored.get("q_group_size"))
        if weights := _weights_scheme(stored):  # compressed-tensors
            value = -1 if weights.get("strategy") == "channel" else weights.get("group_size")
    ok = isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value > 0)
    return int(value) if ok else W4_GROUP


def w4_split_problem(shape: BaseModelSpec, size: int, group: int) -> str | None:
    """Why 4-bit weights in groups of `group` inputs (-1: one per row) cannot be split over
    `size` ranks, or None: a row-parallel projection's inputs on a rank (o_proj's heads,
    down_proj's MLP columns, an expert's down projection's) must be whole groups, packed
    eight to an int32 (the data plane's rule, models/quant_w4.W4Linear)."""
    if size == 1:
        return None
    inputs = {"o_proj": shape.num_heads * shape.head_dim}
    if len(shape.moe_layers) < shape.num_layers:  # dense MLP layers (every layer of a dense model)
        inputs["down_proj"] = shape.intermediate_size
    if shape.moe_layers:
        inputs["an expert's down projection"] = shape.moe_intermediate_size
    for module, whole in inputs.items():
        per = whole / size
        if whole % size or whole // size % (8 if group == -1 else math.lcm(8, group)):
            groups = "one group per row" if group == -1 else f"groups of {group} inputs"
            return (
                f"4-bit weights in {groups} do not split over {size} GPUs: {module}'s"
                f" {whole:,} inputs leave {per:,.0f} per GPU, not whole groups"
            )
    return None


def read_config(
    uri: str, *, s3_endpoint_url: str | None = None, max_bytes: int = MAX_CONFIG_BYTES
) -> dict[str, Any]:
    """The JSON object of a base model's config.json, the one reader of the control plane and
    the operator. `uri` is a folder holding it, the file itself, or an `s3://` prefix or
    `.json` object. BaseModelUnavailable when it cannot be read (or is over `max_bytes`),
    BaseModelError when it is not a JSON object."""
    if uri.startswith("s3://"):
        raw = _read_s3_config(uri, s3_endpoint_url, max_bytes)
    else:
        raw = _read_local_config(Path(uri), max_bytes)
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BaseModelError(f"the base model config at {uri} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise BaseModelError(f"the base model config at {uri} is not a JSON object")
    return config


def _read_local_config(path: Path, max_bytes: int) -> bytes:
    try:
        if path.is_dir():
            path = path / CONFIG_NAME
        if not path.is_file():
            raise BaseModelUnavailable(f"{path} is not a regular file")
        if path.stat().st_size > max_bytes:
            raise BaseModelUnavailable(f"{path} is larger than {max_bytes} bytes")
        with path.open("rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as exc:
        reason = f"cannot read the base model config at {path}: {fileaccess.message(exc)}"
        raise BaseModelUnavailable(reason) from exc


def _read_s3_config(uri: str, endpoint_url: str | None, max_bytes: int) -> bytes:
    from loraplane.adapters import s3read  # boto3: only for s3:// configs

    try:
        bucket, key = s3read.split_uri(uri)
    except ValueError as exc:
        raise BaseModelUnavailable(str(exc)) from exc
    if not key or key.endswith("/"):
        key += CONFIG_NAME
    elif not key.endswith(".json"):
        key += "/" + CONFIG_NAME
    try:
        return s3read.read_bytes(s3read.make_client(endpoint_url), bucket, key, max_bytes=max_bytes)
    except s3read.S3ReadError as exc:
        raise BaseModelUnavailable(f"cannot read the base model config: {exc}") from exc


def _int_field(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BaseModelError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _experts_field(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BaseModelError(
            f"config.json field {key!r} must be a non-negative integer, got {value!r}"
        )
    return value


def _moe_layers(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts (as the HF decoder layer decides)."""
    if model_type == "mixtral":
        return tuple(range(num_layers))
    step = _int_field(config, "decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise BaseModelError("config.json field 'mlp_only_layers' must be a list of layer indices")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    """Shapes of a base model's adaptable linear layers, enough to check an adapter against it.

    `intermediate_size` is a dense MLP's (Mixtral: an expert's); `num_experts`,
    `moe_intermediate_size` and `moe_layers` describe a mixture-of-experts model's sparse
    layers (0, 0, () for a dense model)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> BaseModelSpec:
        """Read the shapes from a parsed HF `config.json`; a field it leaves out takes the
        default of the family's transformers config class."""
        model_type = config.get("model_type")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None or not isinstance(model_type, str):
            raise BaseModelError(
                f"unsupported model_type {model_type!r}; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        text = config
        if family.nested_text_config:
            text = config.get("text_config")  # type: ignore[assignment]
            if not isinstance(text, dict):
                raise BaseModelError(
                    f"config.json of a {model_type} model must hold its text stack's numbers "
                    "in a 'text_config' object"
                )
        known = dict(family.defaults)
        hidden = _int_field(text, "hidden_size", known.get("hidden_size"))
        heads = _int_field(text, "num_attention_heads", known.get("num_attention_heads"))
        kv_heads = _int_field(text, "num_key_value_heads", known.get("num_key_value_heads", heads))
        head_dim = _int_field(text, "head_dim", family.head_dim_default or hidden // heads)
        layers = _int_field(text, "num_hidden_layers", known.get("num_hidden_layers"))
        intermediate = _int_field(text, "intermediate_size", known.get("intermediate_size"))
        experts, moe_inter = 0, 0
        moe_layers: tuple[int, ...] = ()
        # transformers 5 writes `num_local_experts` for both; Qwen's own configs `num_experts`
        key = "num_local_experts" if "num_local_experts" in text else "num_experts"
        if model_type == "mixtral":
            experts = _int_field(text, key, 8)
            moe_inter = intermediate
        elif model_type == "qwen3_moe":
            experts = _experts_field(text, key, 128)
            moe_inter = _int_field(text, "moe_intermediate_size", 768)
        if experts:
            moe_layers = _moe_layers(text, model_type, layers)
        return cls(
            name=name,
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            num_experts=experts if moe_layers else 0,
            moe_intermediate_size=moe_inter if moe_layers else 0,
            moe_layers=moe_layers,
        )

    @classmethod
    def from_dir(cls, path: Path | str, name: str | None = None) -> BaseModelSpec:
        """Read `<path>/config.json`; the name defaults to the directory's name."""
        path = Path(path)
        if not (path / CONFIG_NAME).exists():
            raise BaseModelUnavailable(f"no config.json in {path}")
        return cls.from_config(read_config(str(path)), name or path.name)

    @property
    def family(self) -> Family:
        return FAMILIES.get(self.model_type, FAMILIES["llama"])

    @property
    def layer_prefix(self) -> str:
        """Where the decoder layers live in the HF model (transformers 5 layout)."""
        return self.family.prefixes[0] + "layers"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer in self.moe_layers

    def layer_modules(self, layer: int) -> tuple[str, ...]:
        """The linear layers of decoder layer `layer` an adapter may adapt, in the checkpoint's
        own layout (fused names for Phi-3; one entry per expert, `experts.N.NAME`, in a sparse
        layer; the packed `experts.gate_up_proj` / `experts.down_proj` are the alternative)."""
        family = self.family
        if not self.is_moe_layer(layer):
            return family.attention + family.mlp
        per_expert = tuple(
            f"experts.{e}.{m}" for e in range(self.num_experts) for m in family.experts
        )
        return family.attention + per_expert

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module name some layer has (experts without their index: `experts.NAME`)."""
        family = self.family
        names = list(family.attention)
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)):
            names += family.mlp
        if self.num_experts:
            names += [f"experts.{m}" for m in family.experts]
        return tuple(names)

    def has_module(self, layer: int, module: str) -> bool:
        """Whether decoder layer `layer` holds `module` (layer_modules, or a packed expert
        parameter in a sparse layer of a family that packs them)."""
        family = self.family
        if module in family.attention:
            return True
        parts = module.split(".")
        if not self.is_moe_layer(layer):
            return module in family.mlp
        if len(parts) == 2 and parts[0] == "experts":
            return family.packed_experts and parts[1] in PACKED_EXPERT_PARAMS
        return (
            len(parts) == 3
            and parts[0] == "experts"
            and parts[1].isdigit()
            and int(parts[1]) < self.num_experts
            and parts[2] in family.experts
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a module: a projection (split or fused name: either
        layout's geometry is defined for every family), one expert's linear layer
        (`experts.N.NAME` or `experts.NAME`), or one expert's slice of a packed parameter
        (`experts.gate_up_proj`, `experts.down_proj`). KeyError for any other name."""
        hidden = self.hidden_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        parts = module.split(".")
        if parts[0] == "experts" and len(parts) in (2, 3):
            if self.num_experts == 0:
                raise KeyError(module)
            inter = self.moe_intermediate_size
            leaf = parts[-1]
            expert = {
                "w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden),
                "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            }  # fmt: skip
            if len(parts) == 2 and leaf == "gate_up_proj":
                return hidden, 2 * inter
            if leaf not in expert or (len(parts) == 3 and not parts[1].isdigit()):
                raise KeyError(module)
            return expert[leaf]
        shapes = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "qkv_proj": (hidden, q_out + 2 * kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, self.intermediate_size),
            "up_proj": (hidden, self.intermediate_size),
            "gate_up_proj": (hidden, 2 * self.intermediate_size),
            "down_proj": (self.intermediate_size, hidden),
        }
        return shapes[module]

    def module_block(self, module: str) -> str:
        """The block of a decoder layer that holds `module`: `self_attn`, `mlp`, or Mixtral's
        4.x `block_sparse_moe` for its per-expert layers."""
        if module in ATTENTION_MODULES or module in FUSED_ATTENTION_MODULES:
            return "self_attn"
        parts = module.split(".")
        if parts[0] == "experts" and len(parts) == 3:
            return self.family.expert_block
        return "mlp"

    def module_key(self, layer: int, module: str) -> str:
        """The module's name inside the HF model, as PEFT matches patterns against it."""
        return f"{self.layer_prefix}.{layer}.{self.module_block(module)}.{module}"
