"""ServingPools of the families beyond Llama, through the operator (Kopf) against the emulated
API server, moto S3 and the control plane on SQLite: a pool's base model is a tiny Qwen3 (or
Gemma 3, text-only or the vision-language checkpoint, Phi-3, Mixtral, Qwen3-MoE) in HF
format; LoRAAdapter CRs whose source is a PEFT adapter folder of that family, as
`save_pretrained` leaves it, are validated against the family's config.json and stored; those
that do not fit it are Rejected with their reason and a message naming what is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from safetensors.numpy import load_file

from loraplane.adapters.ingest import list_versions
from loraplane.adapters.store import LocalStore
from tests.factories import (
    FAMILY_LORA_EXTRA,
    FAMILY_TARGET_PARAMETERS,
    FAMILY_TARGETS,
    build_family_adapter,
    build_model,
    build_peft_adapter,
    shrink_projection,
)
from tests.operator.conftest import (
    PLATFORM,
    TENANT,
    Cluster,
    ControlPlane,
    StartOperator,
    adapter_body,
    pool_body,
    upload_source,
)
from tests.operator.harness import wait_for

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

pytestmark = pytest.mark.k8s
KINDS = ["qwen3", "gemma3_text", "gemma3", "phi3", "mixtral", "qwen3_moe"]


def _dashed(kind: str) -> str:
    return kind.replace("_", "-")


@dataclass(frozen=True)
class Built:
    """A family's base model folder and the adapter folders a tenant points CRs at."""

    model: Path
    good: Path  # every linear layer (the packed experts of an MoE), rank 8
    wrong: Path  # `good` with one projection's B half as tall (`shrunk` names the tensor)
    shrunk: str
    head: Path  # LoRA on lm_head too

    def rows(self) -> int:
        """The shrunk tensor's rows in `good`: what the family's config makes them."""
        return int(load_file(str(self.good / "adapter_model.safetensors"))[self.shrunk].shape[0])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """kind -> its Built, for every family."""
    root = tmp_path_factory.mktemp("operator-families")
    out = {}
    for i, kind in enumerate(KINDS):
        model = build_model(root / kind, kind, seed=50 + i)
        good = build_family_adapter(model, root / f"{kind}-good", kind, seed=60 + i)
        wrong, shrunk = shrink_projection(good, root / f"{kind}-wrong")
        head = build_peft_adapter(model, root / f"{kind}-head", seed=70 + i, r=4, lora_alpha=8,
                                  target_modules=[FAMILY_TARGETS[kind][0], "lm_head"],
                                  **FAMILY_LORA_EXTRA.get(kind, {}))  # fmt: skip
        out[kind] = Built(model, good, wrong, shrunk, head)
    return out


def _family_pool(kind: str, model: Path) -> dict[str, Any]:
    body = pool_body(f"{_dashed(kind)}-pool", model)
    body["spec"]["baseModel"]["name"] = f"tiny-{_dashed(kind)}"
    return body


def _family_adapter(name: str, kind: str, uri: str) -> dict[str, Any]:
    body = adapter_body(name, uri)
    body["spec"]["baseModel"] = f"tiny-{_dashed(kind)}"
    return body


def _mirrored(controlplane: ControlPlane, pool: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        r = controlplane.admin.get(f"/v1/pools/{pool}", params={"namespace": PLATFORM})
        found: dict[str, Any] | None = r.json() if r.status_code == 200 else None
        return found

    mirrored: dict[str, Any] = wait_for(probe, what=f"the catalog's {pool}")
    return mirrored


def test_a_qwen3_pool_stores_a_qwen3_adapter_and_rejects_ones_that_do_not_fit(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    built: dict[str, Built],
    tmp_path: Path,
) -> None:
    qwen3 = built["qwen3"]
    start_operator()
    cluster.create("servingpools", PLATFORM, _family_pool("qwen3", qwen3.model))
    mirrored = _mirrored(controlplane, "qwen3-pool")
    assert mirrored["base_model"] == {"name": "tiny-qwen3", "uri": str(qwen3.model)}

    sources = {name: upload_source(s3, folder)
               for name, folder in (("qwen3-bot", qwen3.good), ("wrong-heads", qwen3.wrong),
                                    ("head-bot", qwen3.head))}  # fmt: skip
    for name, uri in sources.items():
        cluster.create("loraadapters", TENANT, _family_adapter(name, "qwen3", uri))

    ready = cluster.wait_phase("qwen3-bot", "Ready", "Rejected", "Failed")["status"]
    assert ready["phase"] == "Ready", ready
    assert (ready["rank"], ready["alpha"], ready["version"]) == (8, 16, 1)
    assert ready["targetModules"] == FAMILY_TARGETS["qwen3"]
    assert ready["storedPath"] == f"adapters/{TENANT}/qwen3-bot/v1-{ready['digest'][:12]}/"
    versions = controlplane.versions(TENANT, "qwen3-bot")
    assert [(v["version"], v["digest"]) for v in versions] == [(1, ready["digest"])]

    # q_proj shaped as if head_dim were hidden / heads (64): the config's head_dim 32 makes it
    # 4 x 32 = 128 rows
    wrong = cluster.wait_phase("wrong-heads", "Rejected", "Ready", "Failed")["status"]
    assert (wrong["phase"], wrong["reason"]) == ("Rejected", "ShapeMismatch"), wrong
    assert wrong["message"] == (
        "layer 0 q_proj: lora_A is 8x64 and lora_B 64x8, but tiny-qwen3 needs A 8x64 and B 128x8"
    )
    conditions = {c["type"]: (c["status"], c["reason"]) for c in wrong["conditions"]}
    assert conditions["Validated"] == ("False", "ShapeMismatch")

    head = cluster.wait_phase("head-bot", "Rejected", "Ready", "Failed")["status"]
    assert (head["phase"], head["reason"]) == ("Rejected", "UnsupportedTargetModule"), head
    assert "LoRA on `lm_head` (the output projection) is not supported" in head["message"]

    # only the adapter that fits was stored
    store = LocalStore(tmp_path / "store")
    assert [v.version for v in list_versions(store, TENANT, "qwen3-bot")] == [1]
    for name in ("wrong-heads", "head-bot"):
        assert list_versions(store, TENANT, name) == []
        assert controlplane.versions(TENANT, name) == []


def test_pools_of_each_family_validate_adapters_against_their_own_config(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    built: dict[str, Built],
) -> None:
    """One pool per family in one cluster: each family's adapter (fused names on Phi-3, packed
    experts on the MoE bases) is Ready with its modules; the same adapter with a projection
    too short for the family's heads is Rejected naming the module and the shape the config
    makes; and an adapter of another family's base is refused by this one's shapes."""
    start_operator()
    for kind in KINDS:
        cluster.create("servingpools", PLATFORM, _family_pool(kind, built[kind].model))
    for kind in KINDS:
        config = _mirrored(controlplane, f"{_dashed(kind)}-pool")["base_model_config"]
        assert config is not None and config["model_type"] == kind
    for kind in KINDS:
        for part, folder in (("good", built[kind].good), ("wrong", built[kind].wrong)):
            uri = upload_source(s3, folder)
            body = _family_adapter(f"{_dashed(kind)}-{part}", kind, uri)
            cluster.create("loraadapters", TENANT, body)
    # Qwen3's adapter on the Gemma 3 pool: both have head_dim 32, but Gemma 3's one KV head
    # makes k_proj 32 rows where Qwen3's two make 64 (and its MLP is wider)
    uri = upload_source(s3, built["qwen3"].good)
    cluster.create("loraadapters", TENANT, _family_adapter("qwen3-on-gemma3", "gemma3_text", uri))

    for kind in KINDS:
        status = cluster.wait_phase(f"{_dashed(kind)}-good", "Ready", "Rejected", "Failed")
        status = status["status"]
        assert status["phase"] == "Ready", (kind, status)
        expected = FAMILY_TARGETS[kind] + FAMILY_TARGET_PARAMETERS.get(kind, [])
        assert sorted(status["targetModules"]) == sorted(expected), (kind, status)

        wrong = cluster.wait_phase(f"{_dashed(kind)}-wrong", "Rejected", "Ready", "Failed")
        wrong = wrong["status"]
        assert (wrong["phase"], wrong["reason"]) == ("Rejected", "ShapeMismatch"), (kind, wrong)
        module = built[kind].shrunk.removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
        rows = built[kind].rows()
        assert wrong["message"] == (
            f"layer 0 {module}: lora_A is 8x64 and lora_B {rows // 2}x8, but"
            f" tiny-{_dashed(kind)} needs A 8x64 and B {rows}x8"
        ), kind

    cross = cluster.wait_phase("qwen3-on-gemma3", "Rejected", "Ready", "Failed")["status"]
    assert (cross["phase"], cross["reason"]) == ("Rejected", "ShapeMismatch"), cross
    assert cross["message"].startswith("layer "), cross
    assert "but tiny-gemma3-text needs" in cross["message"], cross
