"""Mutated safetensors files: the reader accepts a valid file or raises AdapterRejected,
never another exception, never a hang."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.safetensors_io import SafetensorsFile


def _seed_file(tmp: Path) -> bytes:
    rng = np.random.default_rng(0)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal(
            (4, 8)
        ).astype(np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal(
            (8, 4)
        ).astype(np.float16),
    }
    path = tmp / "seed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.read_bytes()


SEED = _seed_file(Path(__import__("tempfile").mkdtemp()))
HEADER_END = 8 + struct.unpack("<Q", SEED[:8])[0]

mutation = st.one_of(
    # flip bytes anywhere, with a bias towards the header where the structure is
    st.tuples(st.just("set"), st.integers(0, HEADER_END + 16), st.integers(0, 255)),
    st.tuples(st.just("set"), st.integers(0, len(SEED) - 1), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(SEED)), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(SEED)), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, len(SEED) - 1), st.just(0)),
)


def _apply(data: bytearray, op: tuple[str, int, int]) -> bytearray:
    kind, pos, value = op
    if kind == "set" and pos < len(data):
        data[pos] = value
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = bytes([value])
    elif kind == "delete" and pos < len(data):
        del data[pos]
    return data


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_file_is_accepted_or_rejected_with_a_typed_error(
    ops: list[tuple[str, int, int]], tmp_path: Path
) -> None:
    data = bytearray(SEED)
    for op in ops:
        data = _apply(data, op)
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(bytes(data))
    try:
        with SafetensorsFile(path) as f, np.errstate(all="ignore"):
            for name in f.tensors:
                f.array(name).sum()
                f.first_non_finite(name)
    except AdapterRejected as e:
        assert e.code in (ReasonCode.INVALID_SAFETENSORS, ReasonCode.TOO_LARGE)  # noqa: PT017


@settings(max_examples=200, deadline=None)
@given(header=st.binary(max_size=256), data=st.binary(max_size=64))
def test_random_header_bytes_never_escape_as_other_errors(header: bytes, data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + data)
        try:
            SafetensorsFile(path).close()
        except AdapterRejected as e:
            assert e.code is ReasonCode.INVALID_SAFETENSORS  # noqa: PT017


def test_seed_file_reads_back_exactly(tmp_path: Path) -> None:
    path = tmp_path / "seed.safetensors"
    path.write_bytes(SEED)
    with SafetensorsFile(path) as f:
        names = sorted(f.tensors)
        assert [f.tensors[n].dtype for n in names] == ["F32", "F16"]
        assert f.array(names[0]).shape == (4, 8)
        assert f.metadata == {"format": "pt"}
        assert f.first_non_finite(names[0]) is None
