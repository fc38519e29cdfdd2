"""The operator's pure parts and clients, without a cluster: specs, manifests, conditions,
sources (https, upload://, s3 policy), the catalog client, settings and the CLI."""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.ingest import AdapterVersion
from loraplane.adapters.store import LocalStore
from loraplane.operator import cli, crds, manifests, specs
from loraplane.operator.autoscaling import Pressure, ScalePolicy
from loraplane.operator.catalog import CatalogClient, CatalogError
from loraplane.operator.conditions import Verdict, adapter_status, set_condition
from loraplane.operator.metrics import PoolMetrics
from loraplane.operator.settings import OperatorSettings, SettingsError
from loraplane.operator.sources import (
    SourceError,
    SourcePolicy,
    fetch_https,
    fetch_s3,
    fetch_upload,
)
from loraplane.operator.specs import AdapterSpec, PoolSpec, SpecError

POOL = {
    "baseModel": {"name": "tiny", "uri": "/models/tiny", "volumeClaim": "weights"},
    "image": "img:1",
    "replicas": {"min": 2, "max": 4},
}


def test_pool_spec_applies_the_crd_defaults() -> None:
    pool = PoolSpec.parse(POOL)
    # adapters limited by memory: no count unless asked for, the data plane's default memory
    assert (pool.max_loras, pool.max_lora_rank, pool.max_cpu_loras) == (None, 64, None)
    assert pool.lora_memory is None
    assert pool.device == "cuda" and pool.autoscaling.enabled
    crd_lora = crds.pool_schema()["properties"]["spec"]["properties"]["lora"]["properties"]
    assert crd_lora["maxLoraRank"]["default"] == pool.max_lora_rank
    with pytest.raises(SpecError, match="min 5 is above"):
        PoolSpec.parse({**POOL, "replicas": {"min": 5, "max": 4}})


def test_pool_lora_memory_reaches_serve_as_given_and_auto_max_loras_stays_auto() -> None:
    pool = PoolSpec.parse({**POOL, "lora": {"memory": "2GiB"}})
    args = manifests.serve_args(pool, "http://cp:8080")
    assert args[args.index("--lora-memory") + 1] == "2GiB"
    assert args[args.index("--max-loras") + 1] == "auto"
    assert "--max-cpu-loras" not in args
    fixed = PoolSpec.parse({**POOL, "lora": {"maxLoras": 16, "memory": "0.2"}})
    args = manifests.serve_args(fixed, "http://cp:8080")
    assert args[args.index("--max-loras") + 1] == "16"


def test_pool_cuda_graphs_reach_serve_only_when_asked_and_only_on_cuda() -> None:
    unset = manifests.serve_args(PoolSpec.parse(POOL), "http://cp:8080")
    assert "--cuda-graphs" not in unset and "--no-cuda-graphs" not in unset  # the server's default
    off = manifests.serve_args(PoolSpec.parse({**POOL, "cudaGraphs": False}), "http://cp:8080")
    assert "--no-cuda-graphs" in off and "--cuda-graphs" not in off
    crd_spec = crds.pool_schema()["properties"]["spec"]["properties"]
    assert "default" not in crd_spec["cudaGraphs"]
    args = manifests.serve_args(PoolSpec.parse({**POOL, "cudaGraphs": True}), "http://cp:8080")
    assert "--cuda-graphs" in args and args[args.index("--device") + 1] == "cuda"
    with pytest.raises(SpecError, match=r"spec\.cudaGraphs needs spec\.device cuda"):
        PoolSpec.parse({**POOL, "device": "cpu", "cudaGraphs": True})
    with pytest.raises(SpecError, match="true or false"):
        PoolSpec.parse({**POOL, "cudaGraphs": "yes"})


def test_pool_max_cpu_lora_bytes_reaches_serve_in_bytes_and_unset_leaves_no_byte_limit() -> None:
    pool = PoolSpec.parse({**POOL, "lora": {"maxCpuLoras": 64, "maxCpuLoraBytes": "8GiB"}})
    assert pool.max_cpu_lora_bytes == 8 << 30
    args = manifests.serve_args(pool, "http://cp:8080")
    assert args[args.index("--max-cpu-lora-bytes") + 1] == str(8 << 30)
    assert args[args.index("--max-cpu-loras") + 1] == "64"  # both limits hold
    unset = PoolSpec.parse(POOL)
    assert unset.max_cpu_lora_bytes is None
    assert "--max-cpu-lora-bytes" not in manifests.serve_args(unset, "http://cp:8080")
    crd_lora = crds.pool_schema()["properties"]["spec"]["properties"]["lora"]["properties"]
    assert crd_lora["maxCpuLoraBytes"]["type"] == "string"
    assert "default" not in crd_lora["maxCpuLoraBytes"]


@pytest.mark.parametrize("size", ["2 parsecs", "0.5", "0", "-1GiB", "lots"])
def test_a_pool_max_cpu_lora_bytes_the_data_plane_cannot_read_is_a_spec_error(size: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.lora\.maxCpuLoraBytes"):
        PoolSpec.parse({**POOL, "lora": {"maxCpuLoraBytes": size}})


@pytest.mark.parametrize("memory", ["2 parsecs", "1.5", "0", "-1GiB"])
def test_a_pool_lora_memory_the_data_plane_cannot_read_is_a_spec_error(memory: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.lora\.memory"):
        PoolSpec.parse({**POOL, "lora": {"memory": memory}})


def test_adapter_catalog_name_is_served_name_or_metadata_name() -> None:
    spec = AdapterSpec.parse({"baseModel": "tiny", "source": {"uri": "upload://abc"}})
    assert spec.catalog_name("bot") == "bot"
    named = AdapterSpec.parse(
        {"baseModel": "tiny", "source": {"uri": "upload://a"}, "servedName": "x"}
    )
    assert named.catalog_name("bot") == "x"
    with pytest.raises(SpecError):
        AdapterSpec.parse({"baseModel": "tiny", "source": {"uri": "file:///etc/passwd"}})


def test_deployment_mounts_the_model_and_leaves_replicas_to_an_hpa_when_asked() -> None:
    pool = PoolSpec.parse(POOL)
    dep = manifests.deployment("p", "ns", pool, controlplane_url="http://cp:8080", replicas=None)
    assert "replicas" not in dep["spec"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/models/tiny"
    assert dep["spec"]["selector"]["matchLabels"] == {"loraplane.io/pool": "p"}
    assert manifests.initial_replicas(pool, None) == 2
    assert manifests.initial_replicas(pool, 9) == 4


def test_condition_keeps_its_transition_time_while_its_status_stays() -> None:
    first = set_condition([], "Ready", False, "Pending", "m", generation=1, now="T1")
    same = set_condition(first, "Ready", False, "Other", "m2", generation=2, now="T2")
    flipped = set_condition(same, "Ready", True, "Ready", "", generation=2, now="T3")
    assert [c["lastTransitionTime"] for c in (first[0], same[0], flipped[0])] == ["T1", "T1", "T3"]
    assert same[0]["reason"] == "Other" and same[0]["observedGeneration"] == 2


def test_status_is_never_ready_while_not_stored() -> None:
    status = adapter_status(
        {}, Verdict("Failed", "StoreUnavailable", "down", None, None), generation=3
    )
    ready = {c["type"]: c["status"] for c in status["conditions"]}
    assert ready == {"Validated": "Unknown", "Stored": "Unknown", "Ready": "False"}
    assert status["observedGeneration"] == 3


POLICY = SourcePolicy(max_bytes=1000, source_hosts=("models.example.com",))


def _transport(
    status: int = 200, body: bytes = b"x", headers: dict[str, str] | None = None
) -> httpx.MockTransport:
    return httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers=headers)
    )


def test_https_source_is_fetched_only_from_allowlisted_hosts(tmp_path: Path) -> None:
    got = fetch_https("https://models.example.com/a.tar.gz", tmp_path, POLICY, _transport())
    assert got.name == "adapter.tar.gz" and got.read_bytes() == b"x"
    with pytest.raises(SourceError, match="allowlist") as info:
        fetch_https("https://evil.example.com/a.tar.gz", tmp_path, POLICY, _transport())
    assert info.value.permanent and info.value.reason == "SourceNotAllowed"


def test_https_redirects_are_refused_and_size_is_capped(tmp_path: Path) -> None:
    redirect = _transport(302, headers={"location": "http://169.254.169.254/"})
    with pytest.raises(SourceError, match="redirect"):
        fetch_https("https://models.example.com/a.zip", tmp_path, POLICY, redirect)
    with pytest.raises(AdapterRejected) as info:
        fetch_https(
            "https://models.example.com/a.zip", tmp_path, POLICY, _transport(body=b"y" * 2000)
        )
    assert info.value.code == ReasonCode.TOO_LARGE
    with pytest.raises(SourceError, match="must name"):
        fetch_https("https://models.example.com/a.bin", tmp_path, POLICY, _transport())


def test_s3_without_secret_is_only_allowed_for_import_buckets(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="secretRef") as info:
        fetch_s3("s3://other/key", tmp_path, POLICY, None)
    assert info.value.permanent
    hostile = {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
        "AWS_ENDPOINT_URL": "http://10.0.0.1",
    }
    with pytest.raises(SourceError, match="endpoint host"):
        fetch_s3("s3://bucket/key", tmp_path, POLICY, hostile)


def test_upload_source_reads_the_staged_files_from_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("adapter_config.json")
        tar.addfile(info, io.BytesIO(b""))
    store.put_bytes("uploads/u1/a.tar.gz", buf.getvalue())
    got = fetch_upload("upload://u1", tmp_path / "w1", store, 10_000)
    assert got.read_bytes() == buf.getvalue()
    store.put_bytes("uploads/u2/adapter_config.json", b"{}")
    store.put_bytes("uploads/u2/adapter_model.safetensors", b"x")
    assert (
        fetch_upload("upload://u2", tmp_path / "w2", store, 10_000) / "adapter_config.json"
    ).exists()
    with pytest.raises(SourceError) as missing:
        fetch_upload("upload://nothing", tmp_path / "w3", store, 10_000)
    assert missing.value.reason == "SourceNotFound" and not missing.value.permanent


def _catalog(handler: Any) -> CatalogClient:
    return CatalogClient("http://cp", "svc", transport=httpx.MockTransport(handler))


def test_catalog_delete_is_false_for_a_missing_adapter_and_uses_the_service_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    gone = {"error": {"code": "NotFound", "message": "adapter 'a' not found"}}
    assert not _catalog(lambda r: httpx.Response(404, json=gone)).delete_adapter("t", "a")
    assert _catalog(handler).delete_adapter("t", "a")
    assert seen[0].url.path == "/internal/v1/tenants/t/adapters/a"
    assert seen[0].headers["Authorization"] == "Bearer svc"


def test_catalog_record_sends_the_version_with_the_service_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={})

    version = AdapterVersion("t", "a", 1, "0" * 64, "adapters/t/a/v1-000000000000/", 8, 16.0,
                             ("q_proj",), 10, "tiny", True)  # fmt: skip
    assert _catalog(handler).record_version("t", "a", version) is True
    body = json.loads(seen[0].content)
    assert seen[0].headers["authorization"] == "Bearer svc"
    assert (body["tenant"], body["version"], body["created_by"]) == ("t", 1, "operator")
    down = _catalog(lambda r: httpx.Response(503, json={"error": {"code": "DatabaseUnavailable"}}))
    with pytest.raises(CatalogError) as info:
        down.record_version("t", "a", version)
    assert info.value.transient


def test_catalog_errors_say_whether_the_operator_waits_or_fails() -> None:
    """The operator's decisions by the internal API's one rule: a pool 409 is a permanent
    BaseModelConflict, a missing pool is None, 5xx and no answer are transient."""
    conflict = {"error": {"code": "Conflict", "message": "pool p serves another model"}}
    with pytest.raises(CatalogError) as info:
        _catalog(lambda r: httpx.Response(409, json=conflict)).ensure_pool("ns", "p", {}, {})
    assert (info.value.code, info.value.status, info.value.transient) == (
        "BaseModelConflict", 409, False,
    )  # fmt: skip
    assert info.value.message == "pool p serves another model"
    gone = {"error": {"code": "NotFound", "message": "no pool"}}
    assert _catalog(lambda r: httpx.Response(404, json=gone)).get_pool("ns", "p") is None
    assert not _catalog(lambda r: httpx.Response(404, json=gone)).delete_pool("ns", "p")
    internal = {"error": {"code": "InternalError", "message": "boom"}}
    with pytest.raises(CatalogError) as info:
        _catalog(lambda r: httpx.Response(500, json=internal)).get_pool("ns", "p")
    assert (info.value.code, info.value.transient) == ("ControlPlaneUnavailable", True)
    invalid = {"error": {"code": "InvalidRequest", "message": "bad limits"}}
    with pytest.raises(CatalogError) as info:
        _catalog(lambda r: httpx.Response(400, json=invalid)).ensure_pool("ns", "p", {}, {})
    assert (info.value.code, info.value.transient) == ("InvalidRequest", False)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(CatalogError) as info:
        _catalog(refuse).delete_adapter("t", "a")
    assert (info.value.code, info.value.status, info.value.transient) == (
        "ControlPlaneUnavailable", None, True,
    )  # fmt: skip


def test_settings_come_from_the_environment_and_name_the_bad_variable() -> None:
    env = {
        "LORAPLANE_CONTROLPLANE_URL": "http://cp:8080",
        "LORAPLANE_SERVICE_TOKEN": "s",
        "LORAPLANE_SOURCE_HOSTS": "a.example.com, b.example.com",
        "LORAPLANE_POOL_INTERVAL_SECONDS": "5",
    }
    settings = OperatorSettings.from_env(env)
    assert settings.source_hosts == ("a.example.com", "b.example.com")
    assert settings.pool_interval_seconds == 5.0
    with pytest.raises(SettingsError, match="LORAPLANE_SERVICE_TOKEN"):
        OperatorSettings.from_env({"LORAPLANE_CONTROLPLANE_URL": "http://cp"})
    with pytest.raises(SettingsError, match="LORAPLANE_MAX_SOURCE_BYTES"):
        OperatorSettings.from_env({**env, "LORAPLANE_MAX_SOURCE_BYTES": "lots"})


def test_cli_registers_operator_and_prints_the_crds() -> None:
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "crds"])
    out = io.StringIO()
    with redirect_stdout(out):
        assert args.func(args) == 0
    assert out.getvalue() == "---\n".join(crds.rendered_files().values())
    run = parser.parse_args(["operator", "--all-namespaces"])
    assert run.func is cli.run_operator and run.all_namespaces


def test_operator_imports_neither_the_data_plane_nor_the_control_plane() -> None:
    import subprocess
    import sys

    code = (
        "import sys, loraplane.operator.registry, loraplane.operator.cli;"
        "bad = [m for m in sys.modules if m.startswith(('loraplane.dataplane', "
        "'loraplane.controlplane', 'torch', 'fastapi'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _samples(metrics: PoolMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("pool", "pool_namespace")}
            out[s.name + "".join(f",{v}" for _, v in sorted(extra.items()))] = s.value
    return out


def test_pool_metrics_without_fresh_pressure_hold_the_need_at_the_current_count() -> None:
    metrics = PoolMetrics()
    policy = ScalePolicy(1, 5, 4.0, 2.0, 0.0, 60.0)
    metrics.observe("ns", "p", replicas=2, ready=1, policy=policy, pressure=Pressure(deferred=17))
    seen = _samples(metrics)
    assert seen["loraplane_pool_needed_replicas"] == 5  # ceil(17 / 4) = 5, within max
    assert seen["loraplane_pool_pressure,deferred"] == 17
    metrics.scaled("ns", "p", 2, 5)
    metrics.scaled("ns", "p", 5, 5)  # no change, no event
    metrics.observe("ns", "p", replicas=5, ready=2, policy=policy, pressure=None)
    seen = _samples(metrics)
    assert seen["loraplane_pool_needed_replicas"] == 5  # holds: the need is the current count
    assert not any(k.startswith("loraplane_pool_pressure") for k in seen)
    assert seen["loraplane_pool_scale_events_total,up"] == 1
    assert seen["loraplane_pool_scale_events_total,down"] == 0
    metrics.forget("ns", "p")
    assert _samples(metrics) == {}


def test_operator_refuses_a_bad_metrics_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_CONTROLPLANE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LORAPLANE_SERVICE_TOKEN", "s" * 40)
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "-A", "--metrics-port", "70000"])
    assert args.func(args) == cli.EXIT_USAGE


def test_operator_help_lists_every_setting_with_its_default() -> None:
    from dataclasses import fields

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["operator", "--help"])
    text = out.getvalue()
    for f in fields(OperatorSettings):
        if f.name != "finalizer":
            assert f"LORAPLANE_{f.name.upper()} (default: " in text, f.name
    assert "LORAPLANE_POOL_INTERVAL_SECONDS (default: 15.0)" in text


def test_a_rank_over_a_pools_max_lora_rank_is_refused_naming_the_servingpool(
    tmp_path: Path,
) -> None:
    from loraplane.adapters.source import open_adapter_source
    from loraplane.adapters.validate import validate_adapter
    from loraplane.operator.ingestion import IndexedPool, pool_limits
    from tests.adapters.crafting import TINY_BASE, lora_config, lora_tensors, write_adapter

    pools = [
        IndexedPool("team-a", name, PoolSpec.parse({**POOL, "lora": {"maxLoraRank": rank}}))
        for name, rank in (("wide", 64), ("narrow", 8))
    ]
    limits = pool_limits(1 << 30, pools)
    assert limits.max_rank == 8
    folder = write_adapter(tmp_path / "r16", lora_config(r=16), lora_tensors(TINY_BASE, 16))
    with open_adapter_source(folder, limits) as files, pytest.raises(AdapterRejected) as info:
        validate_adapter(files, TINY_BASE, limits)
    assert info.value.code == ReasonCode.RANK_TOO_LARGE
    assert "rank 16 exceeds the ServingPool team-a/narrow's maxLoraRank 8" in str(info.value)
    assert pool_limits(1 << 30, []).max_rank is None


def test_pool_quantization_reaches_serve_and_a_format_it_cannot_serve_is_refused() -> None:
    from loraplane.dataplane.config import QUANTIZATIONS

    assert specs.QUANTIZATIONS == QUANTIZATIONS  # what serve --quantization takes
    assert "--quantization" not in manifests.serve_args(PoolSpec.parse(POOL), "http://cp:8080")
    args = manifests.serve_args(PoolSpec.parse({**POOL, "quantization": "fp8"}), "http://cp:8080")
    assert args[args.index("--quantization") + 1] == "fp8"
    crd_spec = crds.pool_schema()["properties"]["spec"]["properties"]
    assert crd_spec["quantization"]["enum"] == ["fp8"]
    with pytest.raises(SpecError, match=r"spec\.quantization must be one of fp8, got 'awq'"):
        PoolSpec.parse({**POOL, "quantization": "awq"})


def test_pool_tensor_parallel_size_reaches_serve_with_its_gpus_and_bad_layouts_are_refused() -> (
    None
):
    from loraplane.adapters.base_model import BaseModelSpec

    one = PoolSpec.parse(POOL)
    assert one.tensor_parallel_size == 1
    assert "--tensor-parallel-size" not in manifests.serve_args(one, "http://cp:8080")
    split = PoolSpec.parse({**POOL, "device": "cuda", "tensorParallelSize": 4})
    args = manifests.serve_args(split, "http://cp:8080")
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert manifests.resources(split)["limits"]["nvidia.com/gpu"] == "4"
    assert manifests.resources(split)["requests"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in manifests.resources(one).get("limits", {})
    fp8 = PoolSpec.parse({**POOL, "device": "cuda", "tensorParallelSize": 2, "quantization": "fp8"})
    args = manifests.serve_args(fp8, "http://cp:8080")  # FP8 splits as 16-bit weights do
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--quantization") + 1] == "fp8"
    crd_spec = crds.pool_schema()["properties"]["spec"]["properties"]
    tp = crd_spec["tensorParallelSize"]
    assert (tp["minimum"], tp["maximum"]) == (1, 8)
    for bad, reason in (
        ({"tensorParallelSize": 0}, r"tensorParallelSize must be an integer in \[1, 8\]"),
        ({"device": "cuda", "tensorParallelSize": 2,
          "resources": {"limits": {"nvidia.com/gpu": 1}}}, r"nvidia.com/gpu is 1, but"),
    ):  # fmt: skip
        with pytest.raises(SpecError, match=reason):
            PoolSpec.parse({**POOL, **bad})
    llama = BaseModelSpec("m", "llama", 2, 64, 100, 8, 2, 8)
    specs.check_tensor_parallel(4, llama)  # 8 heads, KV 2 heads each held by two ranks
    with pytest.raises(
        SpecError,
        match=r"spec.tensorParallelSize 8: tensor parallel size 8 does not divide intermediate",
    ):
        specs.check_tensor_parallel(8, llama)
    mixtral = BaseModelSpec("m", "mixtral", 2, 64, 96, 8, 2, 8, 4, 96, (0, 1))
    specs.check_tensor_parallel(2, mixtral)  # experts split as the data plane splits them
    odd = BaseModelSpec("m", "qwen3_moe", 2, 64, 96, 8, 2, 8, 4, 45, (0, 1))
    with pytest.raises(SpecError, match=r"does not divide moe_intermediate_size \(45\)"):
        specs.check_tensor_parallel(2, odd)


def test_a_quantization_the_data_plane_would_refuse_for_its_checkpoint_is_a_spec_error() -> None:
    from loraplane.adapters.base_model import BaseModelSpec

    llama = BaseModelSpec("m", "llama", 2, 64, 128, 8, 2, 8)
    mixtral = BaseModelSpec("m", "mixtral", 2, 64, 96, 8, 2, 8, 4, 96, (0, 1))
    for asked, stored in ((None, None), ("fp8", None), ("fp8", "fp8"), (None, "int4")):
        specs.check_quantization(asked, stored, llama)  # served
    for asked, stored in ((None, None), ("fp8", None), (None, "fp8"), (None, "int4")):
        specs.check_quantization(asked, stored, mixtral)  # experts quantized as the rest
    specs.check_quantization(None, "int4", mixtral, 2, 16)  # an expert's 48 inputs per rank
    for asked, stored, base, reason in (
        ("fp8", "int4", llama, "spec.quantization fp8: the base model is a 4-bit checkpoint"),
        (None, "unsupported", llama, "quantization_config is a form the data plane does not"),
    ):  # fmt: skip
        with pytest.raises(SpecError, match=re.escape(reason)):
            specs.check_quantization(asked, stored, base)
    # split: o_proj's 64 inputs (8 heads of 8) leave 32 per rank, whole groups of 32, not of 64
    specs.check_quantization(None, "int4", llama, 2, 32)
    specs.check_quantization(None, "int4", llama, 2, -1)  # one group per row
    cut = "spec.tensorParallelSize 2: 4-bit weights in groups of 64 inputs do not split over 2"
    with pytest.raises(SpecError, match=re.escape(cut)):
        specs.check_quantization(None, "int4", llama, 2, 64)
    # an expert's down projection splits as down_proj does: 96 inputs leave 48, not groups of 32
    expert = "an expert's down projection's 96 inputs leave 48 per GPU, not whole groups"
    with pytest.raises(SpecError, match=re.escape(expert)):
        specs.check_quantization(None, "int4", mixtral, 2, 32)
    # block-wise FP8: a rank's slice may start inside a block, but a fused projection's parts
    # (Phi-3's q rows in qkv_proj: 32 a rank) must be whole blocks
    specs.check_quantization(None, "fp8", llama, 2, 0, (48, 40))
    phi3 = BaseModelSpec("m", "phi3", 2, 64, 96, 4, 2, 16)
    blocks = "FP8 weights in blocks of 48x40 do not split over 2 GPUs: qkv_proj's q rows"
    with pytest.raises(SpecError, match=re.escape(f"spec.tensorParallelSize 2: {blocks}")):
        specs.check_quantization(None, "fp8", phi3, 2, 0, (48, 40))
    specs.check_quantization(None, "fp8", phi3, 2, 0, (16, 16))
    specs.check_quantization(None, "fp8", phi3, 1, 0, (48, 40))  # unsplit: any block
    # every layer sparse: no dense down_proj to split (its unused width does not count)
    sparse = BaseModelSpec("m", "qwen3_moe", 2, 64, 100, 8, 2, 8, 4, 64, (0, 1))
    specs.check_quantization(None, "int4", sparse, 2, 16)


def test_pool_kv_cache_dtype_reaches_serve_and_an_unknown_one_is_refused() -> None:
    from loraplane.dataplane.config import KV_CACHE_DTYPES

    assert specs.KV_CACHE_DTYPES == KV_CACHE_DTYPES  # what serve --kv-cache-dtype takes
    assert "--kv-cache-dtype" not in manifests.serve_args(PoolSpec.parse(POOL), "http://cp:8080")
    pool = PoolSpec.parse({**POOL, "kvCacheDtype": "fp8"})
    args = manifests.serve_args(pool, "http://cp:8080")
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    crd_spec = crds.pool_schema()["properties"]["spec"]["properties"]
    assert crd_spec["kvCacheDtype"]["enum"] == ["auto", "fp8"]
    with pytest.raises(SpecError, match=r"spec\.kvCacheDtype must be one of auto, fp8, got 'int8'"):
        PoolSpec.parse({**POOL, "kvCacheDtype": "int8"})
