"""What the adapter core needs to know about a base model: its adaptable modules' shapes.

Built from the model's `config.json` alone (no weights, no torch), so the control plane and
the operator can validate adapters against a base model they never load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane import fileaccess

# The linear layers a LoRA adapter may target, in a decoder layer of the Llama family.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class BaseModelError(ValueError):
    """A base model's config.json cannot be used (missing fields, unsupported architecture)."""


class BaseModelUnavailable(BaseModelError):
    """A base model's config.json cannot be read now (missing, unreadable, store down)."""


MAX_CONFIG_BYTES = 1 << 20
CONFIG_NAME = "config.json"


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


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    """Shapes of a Llama-family base model, enough to check an adapter against it."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> BaseModelSpec:
        """Read the shapes from a parsed HF `config.json`."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise BaseModelError(
                f"unsupported model_type {model_type!r}; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        hidden = _int_field(config, "hidden_size")
        heads = _int_field(config, "num_attention_heads")
        kv_heads = _int_field(config, "num_key_value_heads", heads)
        head_dim = _int_field(config, "head_dim", hidden // heads)
        return cls(
            name=name,
            model_type=model_type,
            num_layers=_int_field(config, "num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=_int_field(config, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )

    @classmethod
    def from_dir(cls, path: Path | str, name: str | None = None) -> BaseModelSpec:
        """Read `<path>/config.json`; the name defaults to the directory's name."""
        path = Path(path)
        if not (path / CONFIG_NAME).exists():
            raise BaseModelUnavailable(f"no config.json in {path}")
        return cls.from_config(read_config(str(path)), name or path.name)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one of SUPPORTED_MODULES."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        return shapes[module]

    def module_key(self, layer: int, module: str) -> str:
        """The module's name inside the HF model, as PEFT matches patterns against it."""
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        return f"model.layers.{layer}.{block}.{module}"
