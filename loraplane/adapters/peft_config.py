"""Parse and check a PEFT `adapter_config.json` into the fields that change the computation.

Only LoRA is served, plain or DoRA (`use_dora`: each module's output rescaled per row by its
magnitude vector over the norm of its updated weight). The semantics follow PEFT: a module's
rank and alpha come from the first `rank_pattern` / `alpha_pattern` key that matches the end
of its name, else `r` / `lora_alpha`;
the scale is alpha / r, or alpha / sqrt(r) with rslora. Patterns are regular expressions written
by the tenant, so they are bounded and restricted to a form that cannot backtrack explosively.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.families import KNOWN_MODULE_NAMES, PACKED_EXPERT_PARAMS, refused_module

MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERNS = 1024
MAX_PATTERN_LEN = 256
MAX_QUANTIFIERS = 4
# Letters, digits and a few regex tokens, but no counted repetition: with at most
# MAX_QUANTIFIERS quantifiers over module names of ~40 characters, matching stays cheap.
_SAFE_PATTERN = re.compile(r"^[A-Za-z0-9_.\-|*+?^$\\\[\]]+$")
# A group of plain alternatives, as PEFT's docs write targets (`.*\.(q_proj|v_proj)`), capturing
# or not: nothing quantified inside it, nothing nested, and the group itself not quantified, so
# it adds no backtracking beyond its alternatives.
_PLAIN_GROUP = re.compile(r"\((?:\?:)?[A-Za-z0-9_.\-|\\\[\]]+\)(?![*+?{])")
ALL_LINEAR = "all-linear"

_REJECTED_FLAGS = {
    "lora_bias": (
        ReasonCode.BIAS_NOT_SUPPORTED,
        "lora_bias is true: LoRA bias terms are not served",
    ),
    "fan_in_fan_out": (
        ReasonCode.UNSUPPORTED_FORMAT,
        "fan_in_fan_out is true: that layout is for GPT-2 Conv1D layers, not Llama-family models",
    ),
}
# PEFT options that change the computation in ways the engine does not implement.
_UNSUPPORTED_EXTRAS = (
    "layer_replication",
    "megatron_config",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)


def _invalid(message: str) -> AdapterRejected:
    return AdapterRejected(ReasonCode.INVALID_CONFIG, message)


def _compile_pattern(what: str, pattern: object) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_LEN:
        raise _invalid(f"{what} {str(pattern)[:60]!r} must be a string of 1 to {MAX_PATTERN_LEN}")
    ungrouped = _PLAIN_GROUP.sub("_", pattern)
    quantifiers = sum(ungrouped.count(c) for c in "*+?")
    if not _SAFE_PATTERN.match(ungrouped) or quantifiers > MAX_QUANTIFIERS:
        raise _invalid(
            f"{what} {pattern!r} uses regex features that are not accepted (allowed: names, '.', "
            f"'|', classes, ^ $, groups of plain alternatives such as (q_proj|v_proj), and at "
            f"most {MAX_QUANTIFIERS} of * + ?; no nested or quantified groups, no braces)"
        )
    try:
        return re.compile(pattern)
    except re.error as e:
        raise _invalid(f"{what} {pattern!r} is not a valid regular expression: {e}") from e


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _invalid(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_float(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _invalid(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise _invalid(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def _pattern_map(name: str, raw: object, parse: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_PATTERNS:
        raise _invalid(f"{name} must be an object of at most {MAX_PATTERNS} entries")
    out = {}
    for key, value in raw.items():
        _compile_pattern(f"{name} key", key)
        out[key] = parse(f"{name}[{key!r}]", value)
    return out


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """The semantic content of a LoRA adapter config, checked."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    exclude_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    # transformers 5's packed MoE experts, adapted as parameters (`experts.gate_up_proj`, ...)
    target_parameters: tuple[str, ...] = ()
    base_model_name_or_path: str | None = None
    task_type: str | None = None
    # DoRA: every module also carries a magnitude vector (validate.py checks it)
    use_dora: bool = False

    @property
    def max_rank(self) -> int:
        """The largest rank any module can have under this config."""
        return max([self.r, *self.rank_pattern.values()])

    def rank_for(self, module_key: str) -> int:
        key = _pattern_key(self.rank_pattern, module_key)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_for(self, module_key: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_key)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    def scale_for(self, module_key: str) -> float:
        """The factor PEFT multiplies B(A x) by for this module."""
        rank, alpha = self.rank_for(module_key), self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def target_miss(self, module_key: str, layer: int) -> str | None:
        """None when PEFT would attach this adapter to `module_key` (in layer `layer`); else
        why not, naming the config field that leaves the module out."""
        short = module_key.rsplit(".", 1)[-1]
        if _matches_any(self.exclude_modules, module_key):
            return f"exclude_modules {_shown(self.exclude_modules)} exclude it"
        if self.target_modules == ALL_LINEAR:
            hit = short in KNOWN_MODULE_NAMES
        else:
            hit = _matches_any(self.target_modules, module_key)
        if not hit:
            return f"target_modules {_shown(self.target_modules)} do not select it"
        # As in PEFT, layers_to_transform narrows a list of names (or all-linear), not a regex.
        regex = isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR
        layers = self.layers_to_transform
        if layers is not None and not regex and layer not in layers:
            return f"layers_to_transform {list(layers)} leave out layer {layer}"
        return None

    def parameter_miss(self, param_key: str) -> str | None:
        """None when PEFT would adapt the parameter `param_key` (a packed experts' weight,
        `model.layers.N.mlp.experts.gate_up_proj`) through target_parameters; else why not.
        As in PEFT, a name matches the whole key or its end; exclude_modules and
        layers_to_transform do not apply to parameters."""
        if _matches_any(self.target_parameters, param_key):
            return None
        return f"target_parameters {_shown(self.target_parameters)} do not select it"

    def canonical(self) -> dict[str, Any]:
        """The fields that change the computation, in a PEFT-loadable form."""
        targets: list[str] | str = (
            self.target_modules
            if isinstance(self.target_modules, str)
            else sorted(self.target_modules)
        )
        excludes: list[str] | str | None = (
            self.exclude_modules
            if isinstance(self.exclude_modules, str)
            else (sorted(self.exclude_modules) or None)
        )
        extra: dict[str, Any] = {}
        if self.target_parameters:  # absent otherwise: older digests stay what they were
            extra["target_parameters"] = sorted(self.target_parameters)
        return {
            **extra,
            "peft_type": "LORA",
            "task_type": self.task_type,
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "target_modules": targets,
            "exclude_modules": excludes,
            "rank_pattern": dict(sorted(self.rank_pattern.items())),
            "alpha_pattern": dict(sorted(self.alpha_pattern.items())),
            "layers_to_transform": (
                list(self.layers_to_transform) if self.layers_to_transform is not None else None
            ),
            "bias": "none",
            "use_dora": self.use_dora,
            "lora_dropout": 0.0,
            "fan_in_fan_out": False,
            "inference_mode": True,
        }

    def canonical_json(self) -> bytes:
        """Canonical `adapter_config.json` bytes (the digest covers them)."""
        return json.dumps(self.canonical(), sort_keys=True, indent=2).encode() + b"\n"


def _pattern_key(patterns: dict[str, Any], module_key: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None


def _shown(targets: tuple[str, ...] | str) -> str:
    """A module list or regex as a message shows it."""
    return repr(targets) if isinstance(targets, str) else repr(sorted(targets))


def _matches_any(targets: tuple[str, ...] | str, module_key: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module_key) is not None
    return any(module_key == t or module_key.endswith("." + t) for t in targets)


def _module_list(name: str, raw: object, *, allow_all: bool) -> tuple[str, ...] | str:
    if raw is None:
        return ()
    if isinstance(raw, str):
        if allow_all and raw == ALL_LINEAR:
            return raw
        _compile_pattern(name, raw)
        return raw
    if not isinstance(raw, list | tuple) or len(raw) > MAX_PATTERNS:
        raise _invalid(f"{name} must be a list of module names or a regex string")
    names: list[str] = []
    for item in raw:
        if not isinstance(item, str) or not item or len(item) > MAX_PATTERN_LEN:
            raise _invalid(f"{name} entry {str(item)[:60]!r} must be a non-empty module name")
        names.append(item)
    return tuple(names)


def parse_adapter_config(data: bytes) -> LoraSpec:
    """Parse `adapter_config.json` bytes; raise AdapterRejected with the precise reason."""
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterRejected(
            ReasonCode.TOO_LARGE,
            f"adapter_config.json is {len(data)} bytes (limit {MAX_CONFIG_BYTES})",
        )
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _invalid(f"adapter_config.json is not valid UTF-8 JSON: {str(e)[:200]}") from e
    if not isinstance(raw, dict):
        raise _invalid("adapter_config.json must hold a JSON object")

    peft_type = raw.get("peft_type")
    if peft_type is None:
        raise _invalid('adapter_config.json has no peft_type (expected "LORA")')
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT,
            f"peft_type {peft_type!r} is not supported: only LoRA adapters are served",
        )
    for flag, (code, message) in _REJECTED_FLAGS.items():
        if raw.get(flag):
            raise AdapterRejected(code, message)
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterRejected(
            ReasonCode.BIAS_NOT_SUPPORTED, f'bias is {bias!r}: only bias "none" is served'
        )
    if raw.get("modules_to_save"):
        raise AdapterRejected(
            ReasonCode.MODULES_TO_SAVE_NOT_SUPPORTED,
            f"modules_to_save {raw['modules_to_save']!r}: full copies of base-model modules "
            "are not served (train with LoRA only)",
        )
    for extra in _UNSUPPORTED_EXTRAS:
        if raw.get(extra):
            code = (
                ReasonCode.UNSUPPORTED_TARGET_MODULE
                if extra == "target_parameters"
                else ReasonCode.UNSUPPORTED_FORMAT
            )
            raise AdapterRejected(code, f"{extra} is set: this PEFT feature is not served")

    r = _positive_int("r", raw.get("r"))
    alpha = _positive_float("lora_alpha", raw.get("lora_alpha", 8))
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(f"use_rslora must be true or false, got {use_rslora!r}")
    use_dora = raw.get("use_dora", False)
    if use_dora is None:
        use_dora = False
    if not isinstance(use_dora, bool):
        raise _invalid(f"use_dora must be true or false, got {str(use_dora)[:40]!r}")

    targets = _module_list("target_modules", raw.get("target_modules"), allow_all=True)
    parameters = _target_parameters(raw.get("target_parameters"))
    if not targets and not parameters:
        raise _invalid("target_modules is empty: the adapter adapts nothing")
    if isinstance(targets, tuple):
        for t in targets:
            short = t.rsplit(".", 1)[-1]
            refused = refused_module(short, t)
            if refused is not None:
                raise AdapterRejected(ReasonCode.UNSUPPORTED_TARGET_MODULE, refused)
            if short not in KNOWN_MODULE_NAMES:
                raise AdapterRejected(
                    ReasonCode.UNSUPPORTED_TARGET_MODULE,
                    f"target module {t!r} is not supported; supported: "
                    + ", ".join(KNOWN_MODULE_NAMES),
                )

    layers = raw.get("layers_to_transform")
    layers_t: tuple[int, ...] | None = None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None:
        if not isinstance(layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
        ):
            raise _invalid(f"layers_to_transform must be a list of layer indices, got {layers!r}")
        layers_t = tuple(sorted(set(layers))) if layers else None
    layers_pattern = raw.get("layers_pattern")
    if layers_pattern not in (None, "", "layers", ["layers"], []):
        raise _invalid(
            f"layers_pattern {layers_pattern!r} does not name this model family's layers "
            '(expected "layers")'
        )

    base = raw.get("base_model_name_or_path")
    task = raw.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT,
            f"task_type {str(task)[:40]!r} is not served (expected CAUSAL_LM)",
        )
    return LoraSpec(
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=targets,
        exclude_modules=_module_list(
            "exclude_modules", raw.get("exclude_modules"), allow_all=False
        ),
        rank_pattern=_pattern_map("rank_pattern", raw.get("rank_pattern"), _positive_int),
        alpha_pattern=_pattern_map("alpha_pattern", raw.get("alpha_pattern"), _positive_float),
        layers_to_transform=layers_t,
        target_parameters=parameters,
        base_model_name_or_path=base[:512] if isinstance(base, str) else None,
        task_type=task,
        use_dora=use_dora,
    )


def _target_parameters(raw: object) -> tuple[str, ...]:
    """PEFT's target_parameters: only the packed experts' weights of a transformers 5 MoE
    model (`experts.gate_up_proj`, `experts.down_proj`, bare or with their full path)."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or len(raw) > MAX_PATTERNS:
        raise _invalid("target_parameters must be a list of parameter names")
    names: list[str] = []
    for item in raw:
        if not isinstance(item, str) or not item or len(item) > MAX_PATTERN_LEN:
            raise _invalid(f"target_parameters entry {str(item)[:60]!r} must be a parameter name")
        parts = item.split(".")
        # PEFT's own conversion of 4.x expert targets writes the bare names (`gate_up_proj`)
        if parts[-1] in PACKED_EXPERT_PARAMS and (len(parts) == 1 or parts[-2] == "experts"):
            names.append(item)
            continue
        module = parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else parts[-1]
        refused = refused_module(module, item.removesuffix(".weight"))
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_TARGET_MODULE,
            refused
            or f"target_parameters entry {item!r} is not served: only the packed experts' "
            "parameters (experts.gate_up_proj, experts.down_proj of a transformers 5 "
            "mixture-of-experts model) are",
        )
    return tuple(names)
