"""The Gateway API Inference Extension's InferencePool CRD (`inference.networking.k8s.io/v1`), for
the emulated cluster: written here from the fields and bounds of the upstream Go types
(kubernetes-sigs/gateway-api-inference-extension `api/v1/inferencepool_types.go` and
`api/v1/shared_types.go`), so the operator's InferencePool is checked against the real shape.

CEL rules (unique port numbers, a port when the picker is a Service) and the label keys' pattern
(a map's keys have no schema in a CRD) are not enforced offline; `validate` checks them by hand.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

GROUP, VERSION, PLURAL, KIND = (
    "inference.networking.k8s.io",
    "v1",
    "inferencepools",
    "InferencePool",
)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
GROUP_NAME = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KIND_NAME = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _port() -> dict[str, Any]:
    number = {"type": "integer", "format": "int32", "minimum": 1, "maximum": 65535}
    return {"type": "object", "properties": {"number": number}, "required": ["number"]}


def _str(min_length: int, max_length: int, pattern: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "minLength": min_length, "maxLength": max_length}
    if pattern:
        out["pattern"] = pattern
    return out


def schema() -> dict[str, Any]:
    """The InferencePool's openAPIV3Schema (spec and status)."""
    selector = {
        "type": "object",
        "properties": {
            "matchLabels": {
                "type": "object",
                "minProperties": 1,
                "maxProperties": 64,
                "additionalProperties": _str(0, 63, LABEL_VALUE),
            }
        },
        "required": ["matchLabels"],
    }
    picker = {
        "type": "object",
        "properties": {
            "group": {**_str(0, 253, GROUP_NAME), "default": ""},
            "kind": {**_str(1, 63, KIND_NAME), "default": "Service"},
            "name": _str(1, 253),
            "port": _port(),
            "failureMode": {
                "type": "string",
                "enum": ["FailOpen", "FailClose"],
                "default": "FailClose",
            },
        },
        "required": ["name"],
    }
    spec = {
        "type": "object",
        "properties": {
            "selector": selector,
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _port()},
            "appProtocol": {
                "type": "string",
                "enum": ["http", "kubernetes.io/h2c"],
                "default": "http",
            },
            "endpointPickerRef": picker,
        },
        "required": ["selector", "targetPorts"],
    }
    condition = {
        "type": "object",
        "properties": {
            "type": _str(1, 316),
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": _str(1, 1024),
            "message": _str(0, 32768),
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
        "required": ["type", "status", "reason", "message", "lastTransitionTime"],
    }
    parent = {
        "type": "object",
        "properties": {
            "conditions": {"type": "array", "maxItems": 8, "items": condition},
            "parentRef": {
                "type": "object",
                "properties": {
                    "group": {**_str(0, 253, GROUP_NAME), "default": "gateway.networking.k8s.io"},
                    "kind": {**_str(1, 63, KIND_NAME), "default": "Gateway"},
                    "name": _str(1, 253),
                    "namespace": _str(1, 63, DNS_LABEL),
                },
                "required": ["name"],
            },
            "controllerName": _str(1, 253),
        },
        "required": ["parentRef"],
    }
    return {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": {
                "type": "object",
                "properties": {"parents": {"type": "array", "maxItems": 32, "items": parent}},
            },
        },
        "required": ["spec"],
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition, as a cluster with the extension installed serves it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["infpool"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema()},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def validate(obj: dict[str, Any]) -> None:
    """Raise unless `obj` is a valid InferencePool (schema plus the CEL rules, by hand)."""
    jsonschema.Draft4Validator(schema()).validate(obj)
    for key in obj["spec"]["selector"]["matchLabels"]:
        assert re.match(LABEL_KEY, key) and len(key) <= 253, f"label key {key!r}"
    numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"
    ref = obj["spec"].get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service":
        assert "port" in ref, "port is required when kind is 'Service'"
