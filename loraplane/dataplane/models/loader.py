"""Load a base model directory (HF format: config.json + safetensors) into LlamaForCausalLM.

Base model files are the operator's, not a tenant's, so safetensors' own reader is trusted
here. The model is built on the meta device and the checkpoint's tensors are assigned in, so
no memory or time goes into a random initialisation that would be overwritten. A sharded
checkpoint (`model.safetensors.index.json`) is read shard by shard and tensor by tensor, each
cast to the serving dtype on the target device as it arrives (on CUDA, read straight to the
device): host memory holds at most one tensor beyond the model being built. Quantized
projections are read in their own formats: FP8 (models/quant.py, also made at load with
`quantization="fp8"`) and 4-bit (models/w4_formats.py, from the checkpoint only).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loraplane import fileaccess
from loraplane.adapters import base_model
from loraplane.dataplane import kv_quant
from loraplane.dataplane.devices import torch_device
from loraplane.dataplane.models import quant, w4_formats
from loraplane.dataplane.models.config import (
    GEMMA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
    check_supported,
)
from loraplane.dataplane.models.gemma import GemmaConfig, GemmaForCausalLM
from loraplane.dataplane.models.gemma import checkpoint_name as gemma_name
from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.models.moe import MoEConfig, MoEForCausalLM
from loraplane.dataplane.models.quant_w4 import W4Linear
from loraplane.dataplane.models.rope import RotaryEmbedding

# the module, not its names: parallel/shard.py imports models.config, whose package imports
# this module
from loraplane.dataplane.parallel import shard as parallel

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_NAME = "model.safetensors.index.json"
# Buffers some older checkpoints saved: recomputed from the config, never read.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(model_dir: Path | str) -> ModelConfig:
    """Parse `<model_dir>/config.json` (read by `loraplane.adapters.base_model.read_config`,
    every service's one reader of it); a ValueError says why it cannot be used."""
    return parse_config(base_model.read_config(str(model_dir)))


def parse_config(config: dict[str, Any]) -> ModelConfig:
    """Any family's HF config.json, parsed by its own parser (UnsupportedModelError naming
    the problem): here, where every family's module is imported, so that models/config.py
    imports none of them."""
    check_supported(config)
    model_type = config["model_type"]
    if model_type in GEMMA_ARCHITECTURES:
        return GemmaConfig.from_hf(config)
    if model_type in MOE_ARCHITECTURES:
        return MoEConfig.from_hf(config)
    return ModelConfig.from_dict(config)


def checkpoint_files(model_dir: Path | str) -> list[Path]:
    """The safetensors shards, from the index when the checkpoint is sharded."""
    root = Path(model_dir)
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name:
                raise ValueError(f"{index} names a shard outside the folder: {name!r}")
        return [root / name for name in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {root}")
    return files


def _owned(read: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """`cast` (the checkpoint tensor `read`, cast for serving) in memory of the process's own.
    safetensors hands out CPU tensors as views of the file's mapping; where the cast changed
    nothing, the model would keep those pages of the page cache, scattered as the file's pages
    are. The native CPU linear (kernels/cpu_linear.py) reads several rows of a weight at once
    and ran a 64-row decode step 1.4x slower on such weights than on the same weights
    copied (a fresh allocation); torch's BLAS was unaffected. So a CPU tensor that is still
    the file's is copied, one tensor at a time, as it arrives."""
    if cast.device.type == "cpu" and cast.data_ptr() == read.data_ptr():
        return cast.clone()
    return cast


def _check_keys(model: LlamaForCausalLM, state: dict[str, torch.Tensor], where: Path) -> None:
    expected = set(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {where} does not match a {model.config.model_type} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )


def _load_fp8(
    state: dict[str, torch.Tensor], target: str, tensor: torch.Tensor, scheme: quant.FP8Scheme,
    device: torch.device, dtype: torch.dtype, part_of: Callable[[str, torch.Tensor], torch.Tensor],
) -> None:  # fmt: skip
    """One tensor of an FP8 projection into `state`: its weight (quantized here when the
    checkpoint is 16-bit), its scale (fp32, shaped as the layer's; a block-wise checkpoint's
    `weight_scale_inv`), its bias (as stored), each as `part_of` slices it for this
    tensor-parallel rank; activation scales are read past (activations stay unquantized)."""
    module, _, part = target.rpartition(".")
    if scheme.block is not None and part in ("weight_scale", "weight_scale_inv"):
        if part != scheme.scale_name or tensor.dim() != 2:
            raise ValueError(
                f"{target} has shape {tuple(tensor.shape)}: block-wise FP8 keeps one factor per"
                f" block of {scheme.block[0]}x{scheme.block[1]} in `{scheme.scale_name}`, 2-D"
            )
        scale = tensor.to(device=device, dtype=torch.float32)
        state[f"{module}.weight_scale"] = part_of(f"{module}.weight_scale", scale)
        return
    if part == "weight":
        if scheme.at_load:
            # the whole weight is quantized, then sliced: a row-parallel slice's rows keep the
            # scales of their whole rows, so every rank's part is the unsplit model's
            weight, scale = quant.quantize(tensor.to(device), scheme.per_channel)
            state[f"{module}.weight_scale"] = part_of(f"{module}.weight_scale", scale)
            state[target] = part_of(target, weight)
            return
        if tensor.dtype != quant.FP8:
            raise ValueError(f"{target} is {tensor.dtype}, its quantization_config says fp8 e4m3")
        state[target] = part_of(target, tensor).to(device)
    elif part == "weight_scale":
        want = (-1, 1) if scheme.per_channel else ()
        if scheme.per_channel and (tensor.dim() > 2 or tensor.shape[-1:] != (1,)):
            raise ValueError(
                f"{target} has shape {tuple(tensor.shape)}, per channel needs [out, 1]"
            )
        if not scheme.per_channel and tensor.numel() != 1:
            raise ValueError(f"{target} has {tensor.numel()} values, per tensor needs one")
        scale = tensor.to(device=device, dtype=torch.float32).reshape(want)
        state[target] = part_of(target, scale)
    elif part not in ("input_scale", "weight_zero_point"):
        state[target] = part_of(target, tensor).to(device=device, dtype=dtype)  # the bias


def _load_w4(
    state: dict[str, torch.Tensor], target: str, tensor: torch.Tensor, layer: W4Linear,
    scheme: w4_formats.W4Scheme, device: torch.device, dtype: torch.dtype,
    part_of: Callable[[str, torch.Tensor], torch.Tensor],
) -> None:  # fmt: skip
    """One tensor of a 4-bit projection into `state`, in models/quant_w4.py's packed layout
    (converted on the target device: AWQ's and GPTQ's packings are transposed there), as
    `part_of` slices it there for this tensor-parallel rank (`layer`: the unsplit one)."""
    converted = w4_formats.convert(scheme, layer, target, tensor.to(device), dtype)
    if converted is not None:
        state[converted[0]] = part_of(*converted)


def causal_lm(config: ModelConfig) -> LlamaForCausalLM:
    """The decoder a parsed config describes (Gemma's and the MoE families' are LlamaForCausalLM
    subclasses)."""
    if isinstance(config, GemmaConfig):
        return GemmaForCausalLM(config)
    if isinstance(config, MoEConfig):
        return MoEForCausalLM(config)
    return LlamaForCausalLM(config)


def load_model(
    model_dir: Path | str, dtype: torch.dtype, device: torch.device | str,
    quantization: str | None = None, shard: parallel.TPShard | None = None,
) -> LlamaForCausalLM:  # fmt: skip
    """Build the decoder from `config.json` and load its weights in `dtype` on `device`; FP8
    projections (models/quant.py) where the checkpoint holds them or `quantization` is "fp8".
    With `shard`, only that tensor-parallel rank's part (parallel/shard.py): its heads, MLP
    columns and vocabulary rows, read slice by slice (`parallel.layers.parallelize` then
    swaps in the collectives).

    Raises UnsupportedModelError (a ValueError) for an architecture or option not implemented,
    ValueError for missing files or weights that do not fit the config.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
    device = torch_device(device)
    root = Path(model_dir)
    raw = base_model.read_config(str(root))
    config = parse_config(raw)
    w4 = w4_formats.scheme_for(raw, quantization)  # a 4-bit checkpoint's; quant.py's is None
    scheme = quant.scheme_for(raw, quantization)
    # parallel.shard's names are read here, not imported: it imports models.config, whose
    # package imports this module
    tp = shard or parallel.TPShard(0, 1)
    heads = parallel.Heads(config.num_heads, config.num_kv_heads)
    built = config
    block = scheme.block if scheme is not None else None
    if tp.size > 1:
        parallel.check_supported(config, tp.size)
        rows = tp.vocab_part(config.vocab_size)[2]
        built = dataclasses.replace(parallel.local_config(config, tp), vocab_size=rows)
        if block is not None:  # each rank's slices must be whole scale blocks
            spec = base_model.BaseModelSpec.from_config(raw, str(root))
            if why := base_model.fp8_block_split_problem(spec, tp.size, block):
                raise UnsupportedModelError(f"tensor parallel size {tp.size}: {why}")

    def part_of(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`: a copy of its slice, so the whole
        tensor is not kept (the tensor itself without tensor parallelism)."""
        if tp.size == 1:
            return tensor
        if block is not None and name.endswith(".weight_scale"):
            linear = whole_fp8.get_submodule(name.rpartition(".")[0])
            assert isinstance(linear, torch.nn.Linear)
            shape = (linear.out_features, linear.in_features)
            return parallel.block_scale_slice(name, tensor, tp, heads, block, shape).clone()
        return parallel.checkpoint_slice(name, tensor, tp, heads).clone()

    def packed_part_of(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a 4-bit projection's tensor, in the packed layout (a copy)."""
        if tp.size == 1 or w4 is None:
            return tensor
        module = name.rpartition(".")[0]
        # the rank's layer holds every group: act-order, or one group per row
        whole_groups = int4[module].scales.shape[1] == whole[module].scales.shape[1]
        return parallel.packed_slice(name, tensor, tp, heads, whole_groups).clone()

    with torch.device("meta"):
        model = causal_lm(built)
        fp8 = set() if scheme is None else set(quant.quantize_projections(model, scheme, dtype))
        try:
            int4 = {} if w4 is None else w4_formats.replace_projections(model, w4, dtype)
        except UnsupportedModelError as e:
            if tp.size == 1 or "does not split into groups" not in str(e):
                raise  # not the split's doing
            raise UnsupportedModelError(
                f"tensor parallel size {tp.size}: {e} (each rank holds 1/{tp.size} of o_proj's"
                " and down_proj's inputs)"
            ) from e
        # the unsplit projections' shapes, which a block-wise FP8 scale's blocks cover
        whole_fp8 = causal_lm(config) if block is not None and tp.size > 1 else model
        for name in fp8 if whole_fp8 is not model else ():
            linear = whole_fp8.get_submodule(name)
            assert isinstance(linear, torch.nn.Linear)
            assert block is not None
            shape = (linear.out_features, linear.in_features)
            offset = parallel.block_offset(f"{name}.weight", tp, heads, block, shape)
            if offset != (0, 0):  # this rank's slice starts inside a scale block
                local = model.get_submodule(name)
                assert isinstance(local, quant.FP8Linear)
                local.start_in_block(offset)
        # the unsplit layers, for the checks of the conversion (the checkpoint's shapes)
        whole = int4
        if w4 is not None and tp.size > 1:
            whole = w4_formats.replace_projections(causal_lm(config), w4, dtype)
            for name, local in int4.items():
                if w4.act_order and name.rpartition(".")[2] in parallel.ROW_PARALLEL:
                    # a rank's input columns may be in any group of the map: all are kept
                    local.hold_groups(whole[name].scales.shape[1])
    state: dict[str, torch.Tensor] = {}
    kv_scales: dict[tuple[int, str], float] = {}  # (layer, "k" | "v" | "kv") -> an FP8 KV scale
    # one tensor at a time, read onto the target device (CUDA: straight from the file) and
    # cast there: host memory never holds a shard, nor a full-precision copy of the model
    where = str(device) if device.type == "cuda" else "cpu"
    for part in checkpoint_files(root):
        fileaccess.check_readable(part)  # safetensors calls an unreadable file missing
        with safe_open(str(part), framework="pt", device=where) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                target = gemma_name(name) if isinstance(config, GemmaConfig) else name
                if target is None:
                    continue  # an image-text Gemma 3's vision tower: only its text is served
                if config.tie_word_embeddings and target == "lm_head.weight":
                    continue  # tied: the embedding matrix is the output projection
                if (kv := kv_quant.scale_target(target)) is not None:
                    kv_scales[kv] = kv_quant.scale_value(name, f.get_tensor(name))
                    continue  # per tensor: the same on every tensor-parallel rank
                layer = whole.get(target.rpartition(".")[0])
                if layer is not None and w4 is not None:
                    _load_w4(state, target, f.get_tensor(name), layer, w4, device, dtype,
                             packed_part_of)  # fmt: skip
                    continue
                if target.rpartition(".")[0] in fp8 and scheme is not None:
                    _load_fp8(state, target, f.get_tensor(name), scheme, device, dtype, part_of)
                    continue
                tensor = part_of(target, f.get_tensor(name))
                if tensor.dtype == quant.FP8:  # its scale would be dropped: wrong numbers
                    raise UnsupportedModelError(
                        f"{target} is stored in FP8, but only the decoder's projections (and"
                        " experts) are served quantized: its module must be in the"
                        " quantization_config's ignore list, stored 16-bit"
                    )
                state[target] = _owned(tensor, tensor.to(device=device, dtype=dtype))
    _check_keys(model, state, root)
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"checkpoint in {root} does not fit its config.json: {e}") from e
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = dataclasses.replace(model.config, vocab_size=config.vocab_size)
    layer_scales = kv_quant.read_scales(kv_scales, config.num_layers)
    for decoder, (k_scale, v_scale) in zip(model.model.decoder_layers, layer_scales, strict=True):
        decoder.self_attn.k_scale, decoder.self_attn.v_scale = k_scale, v_scale
    for module in model.modules():  # cos/sin tables: computed on the CPU, not in the file
        if isinstance(module, RotaryEmbedding):
            module.to(device)
    return model.eval().requires_grad_(False)
