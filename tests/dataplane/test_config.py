"""EngineConfig and SchedulerConfig: defaults, derived fields, and one ValueError per bad field."""

from __future__ import annotations

import dataclasses

import pytest

from loraplane.dataplane.config import EngineConfig, SchedulerConfig


def test_defaults_are_valid_and_name_the_model_after_its_folder() -> None:
    config = EngineConfig(model="/models/tiny-llama/")
    assert config.served_model_name == "tiny-llama"
    assert config.max_num_seqs == 256
    assert config.max_num_batched_tokens == 4096
    assert config.block_size == 16
    assert config.max_loras is None  # auto: memory decides, at most max_num_seqs
    assert config.lora_slots == 256
    assert config.lora_memory == 0.1
    assert config.max_lora_rank == 64
    assert config.max_model_len is None
    assert config.num_kv_blocks is None
    assert config.enable_prefix_caching and config.enable_chunked_prefill


def test_config_is_a_slots_dataclass() -> None:
    config = EngineConfig(model="m")
    assert not hasattr(config, "__dict__")
    with pytest.raises(AttributeError):
        config.not_a_field = 1  # type: ignore[attr-defined]


def test_max_cpu_loras_defaults_to_max_loras() -> None:
    assert EngineConfig(model="m", max_loras=5).max_cpu_loras == 5


def test_auto_max_loras_is_bounded_by_max_num_seqs_and_max_cpu_loras() -> None:
    assert EngineConfig(model="m", max_num_seqs=64).lora_slots == 64
    assert EngineConfig(model="m", max_num_seqs=64, max_cpu_loras=10).lora_slots == 10
    assert EngineConfig(model="m", max_num_seqs=64, max_loras=100).lora_slots == 64
    assert EngineConfig(model="m", max_num_seqs=64).scheduler_config().max_loras == 64


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1.5 GiB", 3 << 29),
        ("1G", 10**9),
        ("64k", 64_000),
        ("1073741824", 1 << 30),
        ("0.1", 0.1),
        ("1.0", 1.0),
        (4096, 4096),
        (0.25, 0.25),
    ],
)
def test_lora_memory_takes_sizes_and_fractions(text: str | int | float, value: float) -> None:
    parsed = EngineConfig(model="m", lora_memory=text).lora_memory
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["2 parsecs", "", "-1", "0", "1.5", "0.0", "GiB", True])
def test_a_bad_lora_memory_is_rejected_naming_the_field(text: object) -> None:
    with pytest.raises(ValueError, match="lora_memory"):
        EngineConfig(model="m", lora_memory=text)  # type: ignore[arg-type]


def test_max_cpu_loras_below_max_loras_is_rejected_naming_both() -> None:
    with pytest.raises(ValueError, match=r"max_cpu_loras \(3\) must be >= max_loras \(4\)"):
        EngineConfig(model="m", max_loras=4, max_cpu_loras=3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", ""),
        ("served_model_name", ""),
        ("dtype", "float64"),
        ("device", "tpu"),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_model_len", 1),
        ("block_size", 0),
        ("num_kv_blocks", 0),
        ("max_loras", 0),
        ("max_loras", True),
        ("max_lora_rank", 0),
        ("max_cpu_loras", 0),
        ("enable_prefix_caching", "yes"),
        ("enable_chunked_prefill", 1),
        ("max_deferral_steps", 0),
        ("seed", 1.5),
        ("block_size", 16.0),
    ],
)
def test_a_bad_value_is_rejected_with_a_ValueError_naming_the_field(
    field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{"model": "m", field: value})  # type: ignore[arg-type]


def test_without_chunked_prefill_a_whole_prompt_must_fit_the_token_budget() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(
            model="m",
            enable_chunked_prefill=False,
            max_model_len=8192,
            max_num_batched_tokens=4096,
        )
    EngineConfig(model="m", enable_chunked_prefill=True, max_model_len=8192)


def test_replace_revalidates_fields_filled_in_later() -> None:
    config = EngineConfig(model="m")
    assert dataclasses.replace(config, num_kv_blocks=100, max_model_len=512).num_kv_blocks == 100
    with pytest.raises(ValueError, match="num_kv_blocks"):
        dataclasses.replace(config, num_kv_blocks=0)


def test_scheduler_config_carries_only_the_scheduler_fields() -> None:
    config = EngineConfig(
        model="m",
        max_num_seqs=7,
        max_num_batched_tokens=99,
        max_loras=3,
        max_deferral_steps=5,
        enable_chunked_prefill=False,
        max_model_len=64,
    )
    assert config.scheduler_config() == SchedulerConfig(
        max_num_seqs=7,
        max_num_batched_tokens=99,
        max_loras=3,
        max_deferral_steps=5,
        enable_chunked_prefill=False,
        max_model_len=64,
    )


@pytest.mark.parametrize(
    "field", ["max_num_seqs", "max_num_batched_tokens", "max_loras", "max_deferral_steps"]
)
def test_scheduler_config_rejects_non_positive_limits(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})  # type: ignore[arg-type]


def test_cuda_graphs_default_on_for_cuda_only_and_an_explicit_choice_stays() -> None:
    """Graphs ran on an H200 (decode 15 ms against 86 ms eager at 64 rows over 8 adapters of
    an 8B model; tokens equal to HF + PEFT in fp32): on by default where they can run."""
    assert EngineConfig(model="m", device="cpu").cuda_graphs is False
    cuda = EngineConfig(model="m")  # the default device
    assert cuda.cuda_graphs is True and cuda.kv_lora_shared is True
    assert EngineConfig(model="m", device="cuda", cuda_graphs=False).cuda_graphs is False


def test_serve_takes_cuda_graphs_and_no_cuda_graphs_and_leaves_the_default_unset() -> None:
    from loraplane.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).cuda_graphs is None
    assert parser.parse_args(["serve", "--cuda-graphs"]).cuda_graphs is True
    assert parser.parse_args(["serve", "--no-cuda-graphs"]).cuda_graphs is False
