"""A corpus of crafted bad adapters: each is refused with its exact reason code, a message that
says what is wrong, and nothing stored."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraplane.adapters.errors import SIGNATURE_CODES, AdapterRejected, ReasonCode
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store.local import LocalStore
from tests.adapters.crafting import (
    PREFIX,
    TINY_BASE,
    dora_tensors,
    f32_entry,
    lora_config,
    lora_tensors,
    raw_safetensors,
    write_adapter,
)

BASE = TINY_BASE
Q0 = PREFIX + "model.layers.0.self_attn.q_proj"
K0 = PREFIX + "model.layers.0.self_attn.k_proj"
Code = ReasonCode
Builder = Callable[[Path], Path]


@dataclass
class Case:
    id: str
    code: ReasonCode
    fragment: str
    build: Builder
    limits: AdapterLimits = field(default_factory=AdapterLimits)


def good(tmp: Path, **config: object) -> Path:
    return write_adapter(tmp / "a", lora_config(**config), lora_tensors(BASE, 8))


def with_tensors(change: Callable[[dict[str, np.ndarray]], None], **config: object) -> Builder:
    def build(tmp: Path) -> Path:
        tensors = lora_tensors(BASE, 8)
        change(tensors)
        return write_adapter(tmp / "a", lora_config(**config), tensors)

    return build


def dora(change: Callable[[dict[str, np.ndarray]], None]) -> Builder:
    """A DoRA adapter (magnitude vectors, use_dora) with `change` made to its tensors."""

    def build(tmp: Path) -> Path:
        tensors = dora_tensors(BASE, 8)
        change(tensors)
        return write_adapter(tmp / "a", lora_config(use_dora=True), tensors)

    return build


def with_config(**config: object) -> Builder:
    return lambda tmp: good(tmp, **config)


def raw_config(data: bytes) -> Builder:
    return lambda tmp: write_adapter(tmp / "a", data, lora_tensors(BASE, 8))


def raw_weights(
    header: dict[str, object] | bytes, data: bytes, length: int | None = None
) -> Builder:
    return lambda tmp: write_adapter(
        tmp / "a", lora_config(), raw_safetensors(header, data, length)
    )


def one_tensor(entry_over: dict[str, object], data_len: int = 16) -> Builder:
    entry = {**f32_entry([2, 2], 0), **entry_over}
    return raw_weights({"t": entry}, bytes(data_len))


def put(t: dict[str, np.ndarray], name: str, value: np.ndarray) -> None:
    t[name] = value


def pair(stem: str, r: int, fan_in: int, fan_out: int) -> dict[str, np.ndarray]:
    """Well-shaped LoRA A and B tensors for the module `stem`."""
    return {
        f"{stem}.lora_A.weight": np.zeros((r, fan_in), np.float32),
        f"{stem}.lora_B.weight": np.zeros((fan_out, r), np.float32),
    }


def poison(dtype: str, value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def change(t: dict[str, np.ndarray]) -> None:
        a = t[Q0 + ".lora_A.weight"].copy()
        a[1, 3] = value
        if dtype == "F16":
            t[Q0 + ".lora_A.weight"] = a.astype(np.float16)
        elif dtype == "BF16":
            t[Q0 + ".lora_A.weight"] = np.zeros(1)  # replaced in build_bf16
        else:
            t[Q0 + ".lora_A.weight"] = a

    return change


def bf16_nan(tmp: Path) -> Path:
    """BF16 has no numpy dtype: write the bit patterns by hand (0x7FC0 is a NaN)."""
    tensors = lora_tensors(BASE, 8)
    header: dict[str, object] = {}
    chunks = []
    pos = 0
    for name in sorted(tensors):
        bits = (tensors[name].view(np.uint32) >> 16).astype("<u2")
        if name == Q0 + ".lora_B.weight":
            bits.flat[5] = 0x7FC0
        raw = bits.tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(bits.shape),
            "data_offsets": [pos, pos + len(raw)],
        }
        chunks.append(raw)
        pos += len(raw)
    return write_adapter(tmp / "a", lora_config(), raw_safetensors(header, b"".join(chunks)))


def archive(kind: str, members: Callable[[Path, Path], list[tuple[str, object]]]) -> Builder:
    """Build a tar.gz or zip from (name, content) pairs; content is bytes or a TarInfo tweak."""

    def build(tmp: Path) -> Path:
        src = good(tmp)
        path = tmp / ("bad.tar.gz" if kind == "tar" else "bad.zip")
        entries = members(src, tmp)
        if kind == "tar":
            with tarfile.open(path, "w:gz") as tar:
                for name, content in entries:
                    if isinstance(content, tarfile.TarInfo):
                        content.name = name
                        tar.addfile(content)
                    else:
                        data = content if isinstance(content, bytes) else b""
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        else:
            with zipfile.ZipFile(path, "w") as zf:
                for name, content in entries:
                    if isinstance(content, zipfile.ZipInfo):
                        zf.writestr(content, b"x")
                    else:
                        zf.writestr(name, content if isinstance(content, bytes) else b"")
        return path

    return build


def both(src: Path) -> list[tuple[str, object]]:
    return [(p.name, p.read_bytes()) for p in sorted(src.iterdir())]


def tar_special(
    kind: bytes, name: str = "evil"
) -> Callable[[Path, Path], list[tuple[str, object]]]:
    def members(src: Path, tmp: Path) -> list[tuple[str, object]]:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "/etc/passwd"
        return [*both(src), (name, info)]

    return members


def zip_symlink(src: Path, tmp: Path) -> list[tuple[str, object]]:
    info = zipfile.ZipInfo("link")
    info.external_attr = 0o120777 << 16
    return [*both(src), ("link", info)]


def pickle_beside(tmp: Path) -> Path:
    (good(tmp) / "adapter_model.bin").write_bytes(b"\x80\x04")
    return tmp / "a"


def without(name: str) -> Builder:
    def build(tmp: Path) -> Path:
        (good(tmp) / name).unlink()
        return tmp / "a"

    return build


def file_with(name: str, data: bytes) -> Builder:
    def build(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name

    return build


def file_weights(data: bytes) -> Builder:
    return lambda tmp: write_adapter(tmp / "a", lora_config(), data)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


CASES = [
    # --- adapter_config.json ------------------------------------------------------------------
    Case("config-not-json", Code.INVALID_CONFIG, "not valid UTF-8 JSON", raw_config(b"{r: 8")),
    Case("config-not-object", Code.INVALID_CONFIG, "JSON object", raw_config(b"[1, 2]")),
    Case("config-not-utf8", Code.INVALID_CONFIG, "UTF-8", raw_config(b'{"r": "\xff"}')),
    Case("config-no-peft-type", Code.INVALID_CONFIG, "no peft_type", with_config(peft_type=None)),
    Case("config-ia3", Code.UNSUPPORTED_FORMAT, "only LoRA", with_config(peft_type="IA3")),
    Case("config-rank-zero", Code.INVALID_CONFIG, "r must be a positive integer", with_config(r=0)),
    Case("config-rank-string", Code.INVALID_CONFIG, "r must be", with_config(r="8")),
    Case("config-alpha-nan", Code.INVALID_CONFIG, "lora_alpha",
         raw_config(b'{"peft_type": "LORA", "r": 8, "lora_alpha": NaN, "target_modules": ["q_proj"]}')),
    Case("config-redos-pattern", Code.INVALID_CONFIG, "regex features",
         with_config(rank_pattern={"(a+)+$": 4})),
    Case("config-bad-regex", Code.INVALID_CONFIG, "not a valid regular expression",
         with_config(alpha_pattern={"q_proj[": 4})),
    Case("config-empty-targets", Code.INVALID_CONFIG, "adapts nothing", with_config(target_modules=[])),
    Case("config-layers-pattern", Code.INVALID_CONFIG, "layers_pattern", with_config(layers_pattern="h")),
    Case("config-too-large", Code.TOO_LARGE, "adapter_config.json is",
         raw_config(json.dumps({**lora_config(), "pad": "x" * (1 << 20)}).encode())),
    Case("config-task-seq-cls", Code.UNSUPPORTED_FORMAT, "task_type", with_config(task_type="SEQ_CLS")),
    Case("config-fan-in-fan-out", Code.UNSUPPORTED_FORMAT, "Conv1D", with_config(fan_in_fan_out=True)),
    Case("config-qalora", Code.UNSUPPORTED_FORMAT, "use_qalora", with_config(use_qalora=True)),
    # --- every tensor explained: targeted by the config, present in the base model ----------
    # (first of its code: the control plane's and the operator's corpus samples use this one)
    Case("tensor-outside-targets", Code.UNSUPPORTED_TARGET_MODULE,
         f"tensor '{K0}.lora_A.weight' adapts model.layers.0.self_attn.k_proj, which the config "
         "does not target (target_modules ['q_proj', 'v_proj'] do not select it)",
         with_tensors(lambda t: t.update(pair(K0, 8, 64, 32)))),
    Case("tensor-outside-regex-target", Code.UNSUPPORTED_TARGET_MODULE,
         "adapts model.layers.0.self_attn.q_proj, which the config does not target "
         "(target_modules '.*\\\\.v_proj' do not select it)",
         with_config(target_modules=r".*\.v_proj")),
    Case("tensor-outside-full-path-targets", Code.UNSUPPORTED_TARGET_MODULE,
         f"tensor '{PREFIX}model.layers.1.self_attn.q_proj.lora_A.weight' adapts",
         with_config(target_modules=["model.layers.0.self_attn.q_proj", "v_proj"])),
    Case("tensor-excluded-module", Code.UNSUPPORTED_TARGET_MODULE,
         "(exclude_modules ['layers.1.self_attn.v_proj'] exclude it)",
         with_config(exclude_modules=["layers.1.self_attn.v_proj"])),
    Case("tensor-layer-not-transformed", Code.UNSUPPORTED_TARGET_MODULE,
         "(layers_to_transform [0] leave out layer 1)", with_config(layers_to_transform=[0])),
    Case("tensor-module-not-in-base", Code.UNSUPPORTED_TARGET_MODULE,
         f"tensor '{PREFIX}model.layers.0.mlp.fancy_proj.lora_A.weight' adapts module "
         "'fancy_proj', which the base model lacks",
         with_tensors(lambda t: t.update(pair(PREFIX + "model.layers.0.mlp.fancy_proj", 8, 64, 64)))),
    Case("tensor-module-in-wrong-block", Code.UNSUPPORTED_TARGET_MODULE, "q_proj is not in mlp",
         with_tensors(lambda t: t.update(pair(PREFIX + "model.layers.0.mlp.q_proj", 8, 64, 64)))),
    Case("tensor-outside-decoder-layers", Code.UNSUPPORTED_TARGET_MODULE,
         "adapts 'model.vision_tower.layers.0.self_attn.q_proj', which is not a linear layer",
         with_tensors(lambda t: t.update(
             pair(PREFIX + "model.vision_tower.layers.0.self_attn.q_proj", 8, 64, 64)))),
    Case("tensor-unexplained-suffix", Code.UNSUPPORTED_FORMAT,
         f"unexpected tensor '{Q0}.extra.weight': a config explains only",
         with_tensors(lambda t: put(t, Q0 + ".extra.weight", np.zeros((8, 64), np.float32)))),
    Case("tensor-adapter-named-lora", Code.UNSUPPORTED_FORMAT,
         f"unexpected tensor '{Q0}.lora_A.default.weight'",
         with_tensors(lambda t: put(t, Q0 + ".lora_A.default.weight", np.zeros((8, 64), np.float32)))),
    Case("tensor-full-copy-of-norm", Code.MODULES_TO_SAVE_NOT_SUPPORTED,
         f"tensor '{PREFIX}model.norm.weight' is a full copy of a base-model module",
         with_tensors(lambda t: put(t, PREFIX + "model.norm.weight", np.ones(64, np.float32)))),
    Case("tensor-full-copy-of-linear", Code.MODULES_TO_SAVE_NOT_SUPPORTED,
         f"tensor '{Q0}.weight' is a full copy",
         with_tensors(lambda t: put(t, Q0 + ".weight", np.zeros((64, 64), np.float32)))),
    # --- targets, bias, DoRA, modules_to_save ---------------------------------------------------
    Case("target-lm-head", Code.UNSUPPORTED_TARGET_MODULE, "LoRA on `lm_head` (the output projection) is not supported",
         with_config(target_modules=["q_proj", "lm_head"])),
    Case("target-parameters", Code.UNSUPPORTED_TARGET_MODULE, "target_parameters",
         with_config(target_parameters=["experts.gate_up_proj"])),
    Case("tensor-embedding", Code.UNSUPPORTED_TARGET_MODULE, "embedding",
         with_tensors(lambda t: put(t, PREFIX + "model.embed_tokens.lora_embedding_A", np.zeros((8, 4), np.float32)))),
    Case("tensor-unknown-module", Code.UNSUPPORTED_TARGET_MODULE, "'rotary'",
         with_tensors(lambda t: put(t, PREFIX + "model.layers.0.self_attn.rotary.lora_A.weight", np.zeros((8, 4), np.float32)))),
    Case("bias-all", Code.BIAS_NOT_SUPPORTED, "bias is 'all'", with_config(bias="all")),
    Case("lora-bias", Code.BIAS_NOT_SUPPORTED, "lora_bias", with_config(lora_bias=True)),
    Case("tensor-bias", Code.BIAS_NOT_SUPPORTED, "bias term",
         with_tensors(lambda t: put(t, Q0 + ".lora_B.bias", np.zeros(64, np.float32)))),
    # DoRA is served (use_dora with a magnitude vector per module); what is refused:
    Case("dora-flag-without-magnitudes", Code.SHAPE_MISMATCH,
         "layer 0 q_proj has no lora_magnitude_vector, but use_dora is true", with_config(use_dora=True)),
    Case("dora-tensor-without-flag", Code.DORA_NOT_SUPPORTED, "does not set use_dora: true",
         with_tensors(lambda t: put(t, Q0 + ".lora_magnitude_vector", np.ones(64, np.float32)))),
    Case("dora-flag-not-bool", Code.INVALID_CONFIG, "use_dora must be true or false",
         with_config(use_dora="yes")),
    Case("dora-magnitude-short", Code.SHAPE_MISMATCH, "lora_magnitude_vector is [32], but the module has 64",
         dora(lambda t: put(t, Q0 + ".lora_magnitude_vector", np.ones(32, np.float32)))),
    Case("dora-magnitude-2d", Code.SHAPE_MISMATCH, "it must be [64]",
         dora(lambda t: put(t, Q0 + ".lora_magnitude_vector", np.ones((64, 1), np.float32)))),
    Case("dora-magnitude-twice", Code.UNSUPPORTED_FORMAT, "two lora_magnitude_vector tensors",
         dora(lambda t: put(t, Q0 + ".lora_magnitude_vector.weight", np.ones(64, np.float32)))),
    Case("dora-magnitude-nan", Code.NON_FINITE_WEIGHTS, "lora_magnitude_vector' holds NaN",
         dora(lambda t: put(t, Q0 + ".lora_magnitude_vector", np.full(64, np.nan, np.float32)))),
    Case("modules-to-save-config", Code.MODULES_TO_SAVE_NOT_SUPPORTED, "modules_to_save",
         with_config(modules_to_save=["lm_head"])),
    Case("modules-to-save-tensor", Code.MODULES_TO_SAVE_NOT_SUPPORTED, "full copy",
         with_tensors(lambda t: put(t, PREFIX + "lm_head.weight", np.zeros((4, 64), np.float32)))),
    Case("unexpected-tensor-name", Code.UNSUPPORTED_FORMAT, "unexpected tensor",
         with_tensors(lambda t: put(t, "weird", np.zeros(2, np.float32)))),
    # --- ranks and shapes ---------------------------------------------------------------------
    Case("rank-over-pool", Code.RANK_TOO_LARGE, "rank 8 exceeds max_lora_rank 4",
         with_config(), AdapterLimits(max_rank=4)),
    Case("rank-pattern-over-pool", Code.RANK_TOO_LARGE, "rank 32 exceeds max_lora_rank 16",
         with_config(rank_pattern={"v_proj": 32}), AdapterLimits(max_rank=16)),
    Case("shape-in-features", Code.SHAPE_MISMATCH, "needs A 8x64",
         with_tensors(lambda t: put(t, Q0 + ".lora_A.weight", np.zeros((8, 48), np.float32)))),
    Case("shape-out-features", Code.SHAPE_MISMATCH, "B 64x8",
         with_tensors(lambda t: put(t, Q0 + ".lora_B.weight", np.zeros((32, 8), np.float32)))),
    Case("shape-rank-a-vs-b", Code.SHAPE_MISMATCH, "lora_A has rank 8 but lora_B has rank 4",
         with_tensors(lambda t: put(t, Q0 + ".lora_B.weight", np.zeros((64, 4), np.float32)))),
    Case("shape-rank-vs-config", Code.SHAPE_MISMATCH, "config gives rank 16", with_config(r=16)),
    Case("shape-rank-pattern", Code.SHAPE_MISMATCH, "rank_pattern",
         with_config(rank_pattern={"model.layers.1.self_attn.v_proj": 4})),
    Case("shape-a-without-b", Code.SHAPE_MISMATCH, "has lora_A but no lora_B",
         with_tensors(lambda t: t.pop(Q0 + ".lora_B.weight"))),
    Case("shape-3d", Code.SHAPE_MISMATCH, "2-D",
         with_tensors(lambda t: put(t, Q0 + ".lora_A.weight", np.zeros((8, 64, 1), np.float32)))),
    Case("layer-beyond-base", Code.BASE_MODEL_MISMATCH,
         "layers.5.self_attn.q_proj.lora_A.weight' is for layer 5 but tiny has 2 layers",
         with_tensors(lambda t: t.update({
             PREFIX + "model.layers.5.self_attn.q_proj.lora_A.weight": np.zeros((8, 64), np.float32),
             PREFIX + "model.layers.5.self_attn.q_proj.lora_B.weight": np.zeros((64, 8), np.float32),
         }))),
    # --- weights ------------------------------------------------------------------------------
    Case("nan-f32", Code.NON_FINITE_WEIGHTS, "NaN or Inf (first at flat index 67)",
         with_tensors(poison("F32", float("nan")))),
    Case("inf-f16", Code.NON_FINITE_WEIGHTS, "NaN or Inf", with_tensors(poison("F16", float("inf")))),
    Case("nan-bf16", Code.NON_FINITE_WEIGHTS, "first at flat index 5", bf16_nan),
    Case("weights-too-large", Code.TOO_LARGE, "over the limit of 1000",
         with_config(), AdapterLimits(max_bytes=1000)),
    Case("too-many-tensors", Code.TOO_LARGE, "8 tensors exceed the limit of 4",
         with_config(), AdapterLimits(max_tensors=4)),
    # --- files --------------------------------------------------------------------------------
    Case("pickle-bin", Code.UNSUPPORTED_FORMAT, "pickle", pickle_beside),
    Case("pickle-file", Code.UNSUPPORTED_FORMAT, "never loaded", file_with("adapter.pt", b"\x80")),
    Case("no-weights", Code.UNSUPPORTED_FORMAT, "no adapter_model.safetensors",
         without("adapter_model.safetensors")),
    Case("no-config", Code.INVALID_CONFIG, "no adapter_config.json", without("adapter_config.json")),
    Case("not-an-archive", Code.UNSUPPORTED_FORMAT, "neither an adapter folder",
         file_with("x.tar.gz", b"hello")),
    # --- safetensors rules --------------------------------------------------------------------
    Case("st-short", Code.INVALID_SAFETENSORS, "shorter than the 8-byte", file_weights(b"\x01\x02")),
    Case("st-header-cap", Code.INVALID_SAFETENSORS, "exceeds the 104857600-byte cap",
         raw_weights(b"{}", b"", 200 << 20)),
    Case("st-header-past-eof", Code.INVALID_SAFETENSORS, "does not fit", raw_weights(b"{}", b"", 4096)),
    Case("st-header-not-utf8", Code.INVALID_SAFETENSORS, "not valid UTF-8", raw_weights(b"{\xff\xfe}", b"")),
    Case("st-header-not-json", Code.INVALID_SAFETENSORS, "not valid JSON", raw_weights(b"{nope", b"")),
    Case("st-header-array", Code.INVALID_SAFETENSORS, "does not start with a JSON object",
         raw_weights(b"[1]", b"")),
    Case("st-header-deep", Code.INVALID_SAFETENSORS, "not valid JSON",
         raw_weights(b'{"a":' + nested(100_000) + b"}", b"")),
    Case("st-duplicate-key", Code.INVALID_SAFETENSORS, "duplicate key 't'",
         raw_weights(b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                     b' "t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8))),
    Case("st-dtype-f64", Code.INVALID_SAFETENSORS, "dtype 'F64'", one_tensor({"dtype": "F64"})),
    Case("st-dtype-i8", Code.INVALID_SAFETENSORS, "allowed: F16, BF16, F32", one_tensor({"dtype": "I8"})),
    Case("st-shape-negative", Code.INVALID_SAFETENSORS, "non-negative", one_tensor({"shape": [-2, -2]})),
    Case("st-shape-float", Code.INVALID_SAFETENSORS, "non-negative integers", one_tensor({"shape": [2.0, 2]})),
    Case("st-shape-too-many-dims", Code.INVALID_SAFETENSORS, "at most 8", one_tensor({"shape": [1] * 9})),
    Case("st-shape-nan", Code.INVALID_SAFETENSORS, "non-JSON constant NaN",
         raw_weights(b'{"t": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', bytes(4))),
    Case("st-offsets-reversed", Code.INVALID_SAFETENSORS, "reversed", one_tensor({"data_offsets": [16, 0]})),
    Case("st-offsets-negative", Code.INVALID_SAFETENSORS, "negative", one_tensor({"data_offsets": [-4, 12]})),
    Case("st-size-mismatch", Code.INVALID_SAFETENSORS, "needs 16 bytes, data_offsets span 12",
         one_tensor({"data_offsets": [0, 12]}, 12)),
    Case("st-size-overflow", Code.INVALID_SAFETENSORS, "needs",
         one_tensor({"shape": [2**62, 2**62]})),
    Case("st-gap", Code.INVALID_SAFETENSORS, "gap of 4 bytes",
         raw_weights({"a": f32_entry([1], 0), "b": f32_entry([1], 8)}, bytes(12))),
    Case("st-overlap", Code.INVALID_SAFETENSORS, "overlaps",
         raw_weights({"a": f32_entry([2], 0), "b": f32_entry([2], 4)}, bytes(12))),
    Case("st-out-of-range", Code.INVALID_SAFETENSORS, "past the data section",
         raw_weights({"a": f32_entry([4], 0)}, bytes(8))),
    Case("st-trailing", Code.INVALID_SAFETENSORS, "8 trailing bytes",
         raw_weights({"a": f32_entry([1], 0)}, bytes(12))),
    Case("st-name-control", Code.INVALID_SAFETENSORS, "control characters",
         raw_weights({"a\x1b[2J": f32_entry([1], 0)}, bytes(4))),
    Case("st-name-long", Code.INVALID_SAFETENSORS, "tensor name of length 600",
         raw_weights({"a" * 600: f32_entry([1], 0)}, bytes(4))),
    Case("st-metadata-not-strings", Code.INVALID_SAFETENSORS, "is not a string",
         raw_weights({"__metadata__": {"k": 1}, "a": f32_entry([1], 0)}, bytes(4))),
    Case("st-entry-extra-field", Code.INVALID_SAFETENSORS, "exactly dtype, shape and data_offsets",
         one_tensor({"evil": True})),
    Case("st-entry-not-object", Code.INVALID_SAFETENSORS, "not an object", raw_weights({"t": [1]}, b"")),
    # --- archives -----------------------------------------------------------------------------
    Case("tar-dotdot", Code.UNSAFE_ARCHIVE, "escapes the archive",
         archive("tar", lambda s, t: [*both(s), ("../../etc/cron.d/x", b"boom")])),
    Case("tar-absolute", Code.UNSAFE_ARCHIVE, "absolute path",
         archive("tar", lambda s, t: [*both(s), ("/etc/passwd", b"boom")])),
    Case("tar-symlink", Code.UNSAFE_ARCHIVE, "is a link", archive("tar", tar_special(tarfile.SYMTYPE))),
    Case("tar-hardlink", Code.UNSAFE_ARCHIVE, "is a link", archive("tar", tar_special(tarfile.LNKTYPE))),
    Case("tar-device", Code.UNSAFE_ARCHIVE, "device", archive("tar", tar_special(tarfile.CHRTYPE))),
    Case("tar-fifo", Code.UNSAFE_ARCHIVE, "FIFO", archive("tar", tar_special(tarfile.FIFOTYPE))),
    Case("tar-too-many-entries", Code.UNSAFE_ARCHIVE, "more than 64 entries",
         archive("tar", lambda s, t: [*both(s), *[(f"f{i}", b"") for i in range(70)]])),
    Case("tar-too-large", Code.UNSAFE_ARCHIVE, "unpacks to more than 1000 bytes",
         archive("tar", lambda s, t: both(s)), AdapterLimits(max_archive_bytes=1000)),
    Case("tar-duplicate", Code.UNSAFE_ARCHIVE, "two entries named",
         archive("tar", lambda s, t: [*both(s), *both(s)])),
    Case("tar-pickle", Code.UNSUPPORTED_FORMAT, "pickle",
         archive("tar", lambda s, t: [*both(s), ("adapter_model.bin", b"\x80\x04")])),
    Case("tar-corrupt", Code.UNSAFE_ARCHIVE, "not a readable tar archive",
         file_with("c.tgz", b"\x1f\x8b\x08\x00garbage" * 10)),
    Case("tar-deep-folder", Code.UNSUPPORTED_FORMAT, "in one folder",
         archive("tar", lambda s, t: [(f"x/y/{n}", d) for n, d in both(s)])),
    Case("zip-dotdot", Code.UNSAFE_ARCHIVE, "escapes the archive",
         archive("zip", lambda s, t: [*both(s), ("a/../../x", b"boom")])),
    Case("zip-backslash", Code.UNSAFE_ARCHIVE, "is not allowed",
         archive("zip", lambda s, t: [*both(s), ("..\\x", b"boom")])),
    Case("zip-symlink", Code.UNSAFE_ARCHIVE, "symbolic link", archive("zip", zip_symlink)),
    Case("zip-too-large", Code.UNSAFE_ARCHIVE, "unpacks to more than 1000 bytes",
         archive("zip", lambda s, t: both(s)), AdapterLimits(max_archive_bytes=1000)),
]  # fmt: skip


def test_corpus_covers_every_reason_code() -> None:
    # the signature codes are a policy's, not the files' (tests/adapters/test_signing.py)
    assert {c.code for c in CASES} == set(ReasonCode) - SIGNATURE_CODES
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_adapter_is_rejected_with_its_reason_and_nothing_is_stored(
    case: Case, tmp_path: Path
) -> None:
    source = case.build(tmp_path)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(AdapterRejected) as info:
        ingest(source, "acme", "bot", BASE, case.limits, store)
    assert info.value.code == case.code, info.value.message
    assert case.fragment in info.value.message
    assert store.list_keys("") == []
    assert list((tmp_path / "store" / ".staging").iterdir()) == []


def test_a_valid_adapter_passes_the_same_pipeline(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    version = ingest(good(tmp_path), "acme", "bot", BASE, AdapterLimits(max_rank=8), store)
    assert version.version == 1
    assert version.rank == 8


def test_bf16_and_f16_weights_are_accepted(tmp_path: Path) -> None:
    tensors = {k: v.astype(np.float16) for k, v in lora_tensors(BASE, 4).items()}
    src = write_adapter(tmp_path / "f16", lora_config(r=4), tensors)
    store = LocalStore(tmp_path / "store")
    assert ingest(src, "acme", "f16", BASE, AdapterLimits(), store).rank == 4
    # BF16: the NaN builder without its NaN is a valid BF16 adapter
    (tmp_path / "bf").mkdir()
    bf = bf16_nan(tmp_path / "bf")
    raw = bytearray((bf / "adapter_model.safetensors").read_bytes())
    assert raw.count(b"\xc0\x7f") >= 1
    tensors32 = lora_tensors(BASE, 8)
    save_file(tensors32, str(bf / "adapter_model.safetensors"))
    assert ingest(bf, "acme", "bf", BASE, AdapterLimits(), store).version == 1


def only(*stems: str) -> Callable[[dict[str, np.ndarray]], None]:
    """Keep only the tensors of the modules whose key ends with one of `stems`."""

    def change(t: dict[str, np.ndarray]) -> None:
        for name in list(t):
            if not any(name.rsplit(".lora_", 1)[0].endswith(s) for s in stems):
                del t[name]

    return change


@pytest.mark.parametrize(
    ("config", "keep"),
    [
        ({"target_modules": r".*\.[qv]_proj"}, ("q_proj", "v_proj")),
        ({"target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"]},
         ("layers.0.self_attn.q_proj", "v_proj")),
        ({"layers_to_transform": [1]}, ("layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj")),
        ({"exclude_modules": ["layers.0.self_attn.v_proj"]},
         ("q_proj", "layers.1.self_attn.v_proj")),
        ({"target_modules": "all-linear"}, ("q_proj", "v_proj")),
    ],
    ids=["regex", "full-paths", "layers-to-transform", "exclude-modules", "all-linear"],
)  # fmt: skip
def test_tensors_of_targeted_modules_pass_however_the_config_names_them(
    config: dict[str, object], keep: tuple[str, ...], tmp_path: Path
) -> None:
    source = with_tensors(only(*keep), **config)(tmp_path)
    store = LocalStore(tmp_path / "store")
    assert ingest(source, "acme", "bot", BASE, AdapterLimits(), store).version == 1
