"""The gateway test: with the chart's defaults (routing on, no adapterAffinity anywhere), the
port the endpoint picker scrapes names the adapter a replica holds, and the API port names none.

The chain is the one a cluster runs: the chart renders the EndpointPickerConfig (its
`metrics-data-source` port, or the InferencePool's target port when it gives none); the
operator builds a routed ServingPool's Deployment; a real `loraplane serve` process runs that
Deployment's args and env in catalog mode against a real control plane (each container port
moved to a free loopback port, the same move for every port, so a port's role is kept); a
tenant's request makes its adapter resident; then the picker's port is scraped as the picker
scrapes it. Pointing the picker at the API port fails the test (the negative control below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.operator import inferencepool, manifests
from loraplane.operator.specs import PoolSpec
from tests.charts.render import NAMESPACE, RELEASE, one, render
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.dataplane.server.conftest import spawn, wait_ready
from tests.operator.conftest import BASE_NAME, pool_body
from tests.servers import free_port, serve_in_thread

POOL = "llama"
ADAPTER = "support"
EPP_CONFIG = f"{RELEASE}-loraplane-epp-config"


def _scraped_port(values: dict[str, Any], spec: PoolSpec) -> int:
    """The container port the picker scrapes: the EndpointPickerConfig's metrics source port,
    else the InferencePool's target port (the picker's rule)."""
    cm = one(render(values), "ConfigMap", EPP_CONFIG)
    config = yaml.safe_load(cm["data"]["epp-config.yaml"])
    (source,) = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"]["path"] == "/metrics"
    if "port" in source["parameters"]:
        return int(source["parameters"]["port"])
    (target,) = inferencepool.manifest(POOL, NAMESPACE, spec)["spec"]["targetPorts"]
    return int(target["number"])


@contextlib.contextmanager
def _controlplane(tmp: Path, model: Path) -> Iterator[tuple[str, str, Path]]:
    """A control plane over real HTTP with the pool, a tenant, its key and its uploaded
    adapter; its URL, the tenant's key and the store's path."""
    settings = make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}")
    app = create_controlplane(settings)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        with serve_in_thread(app) as url:
            pool = {"namespace": NAMESPACE, "name": POOL,
                    "base_model": {"name": BASE_NAME, "uri": str(model)}}  # fmt: skip
            assert httpx.post(url + "/v1/pools", json=pool, headers=admin).status_code == 201
            assert httpx.post(url + "/v1/tenants", json={"name": "acme"},
                              headers=admin).status_code == 201  # fmt: skip
            r = httpx.post(url + "/v1/tenants/acme/keys", json={"name": "k"}, headers=admin)
            key = r.json()["key"]
            yield url, key, Path(str(settings.store))
    finally:
        app.state.ctx.close()


def _upload(url: str, key: str, adapter: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir())]
    r = httpx.post(url + "/v1/adapters", data={"name": ADAPTER, "base_model": BASE_NAME},
                   files=files, headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 201, r.text


def _pod_command(
    container: dict[str, Any], moved: dict[int, int], spool: Path
) -> tuple[list[str], dict[str, str]]:
    """The container's `loraplane` args and env as a process on this machine runs them: every
    port value moved by `moved`, the pod's own address on loopback, the spool's emptyDir a
    temporary folder, the pod's name and the service token Secret filled in."""
    args = list(container["args"])
    assert container["command"] == ["loraplane"] and args[0] == "serve"
    for i, arg in enumerate(args[:-1]):
        if arg.endswith("-port"):
            args[i + 1] = str(moved[int(args[i + 1])])
        if arg == "--host":
            args[i + 1] = "127.0.0.1"
    env: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = f"{POOL}-0"
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("loraplane-tokens", "service"), ref
            env[var["name"]] = SERVICE
    env["LORAPLANE_USAGE_SPOOL_DIR"] = str(spool)
    env["LORAPLANE_NUM_KV_BLOCKS"] = "64"  # engine sizing for a small machine
    return args[1:], env


def _adapter_names(url: str) -> set[str]:
    """The adapters `vllm:lora_requests_info` names at `url`'s /metrics (none without it)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:lora_requests_info":
            for sample in family.samples:
                for key in ("running_lora_adapters", "waiting_lora_adapters"):
                    names |= {n for n in sample.labels[key].split(",") if n}
    return names


def test_with_the_charts_defaults_the_picker_sees_the_resident_adapter_and_the_api_port_none(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    values = {"routing": {"enabled": True}}  # the chart's defaults otherwise
    assert "adapterAffinity" not in yaml.safe_dump(values)
    with _controlplane(tmp_path, tiny_llama_dir) as (cp, key, store):
        _upload(cp, key, peft_adapters["r16"])
        body = pool_body(POOL, tiny_llama_dir, routing={"inferencePool": {"enabled": True}},
                         store=str(store))  # fmt: skip
        assert "adapterAffinity" not in yaml.safe_dump(body)
        spec = PoolSpec.parse(body["spec"])
        deployment = manifests.deployment(POOL, NAMESPACE, spec, controlplane_url=cp, replicas=1)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        scraped = _scraped_port(values, spec)
        assert scraped in ports.values(), (scraped, ports)  # a port the pods declare
        moved = {port: free_port() for port in ports.values()}
        args, env = _pod_command(container, moved, tmp_path / "spool")
        proc = spawn(args, env=env)
        try:
            api = f"http://127.0.0.1:{moved[ports['http']]}"
            wait_ready(api, proc=proc)
            client = openai.OpenAI(base_url=api + "/v1", api_key=key, max_retries=0)
            out = client.completions.create(model=ADAPTER, prompt="hello", max_tokens=3)
            assert out.choices[0].text
            picker = f"http://127.0.0.1:{moved[scraped]}"
            assert ADAPTER in _adapter_names(picker)
            api_metrics = httpx.get(api + "/metrics").text
            assert "lora_requests_info" not in api_metrics and ADAPTER not in api_metrics
            assert "vllm:num_requests_running" in api_metrics  # the protocol gauges stay
            # negative control: a chart that points the picker at the InferencePool's target
            # port (the API port) gives the LoRA affinity scorer no adapter to see
            to_api = {"routing": {"enabled": True, "endpointPicker": {"metricsPort": 0}}}
            at_api = _scraped_port(to_api, spec)
            assert at_api == ports["http"]
            assert _adapter_names(f"http://127.0.0.1:{moved[at_api]}") == set()
        finally:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except Exception:
                proc.kill()
                proc.wait()
