"""The base model: a Llama-family decoder in plain torch over a paged KV cache."""

from loraplane.dataplane.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.models.loader import load_model, read_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "load_model",
    "read_config",
]
