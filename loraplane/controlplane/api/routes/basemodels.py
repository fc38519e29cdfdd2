"""Tenant route: the base models a tenant may upload adapters for (`GET /v1/base-models`).

Only what an upload needs: the served name, whether it can be validated yet, its shapes and
the limits an upload must meet. Pools, namespaces and where the model is stored stay hidden.
"""

from __future__ import annotations

from fastapi import APIRouter

from loraplane.controlplane.api.deps import CallerDep, ContextDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import pools as crud_pools
from loraplane.controlplane.errors import BaseModelPending
from loraplane.controlplane.ingestion import limits_for
from loraplane.controlplane.schemas.basemodels import BaseModelOffer

router = APIRouter(
    prefix="/v1/base-models", tags=["tenant: base models"], responses=errors(401, 429)
)


@router.get("", response_model=list[BaseModelOffer])
def list_base_models(
    ctx: ContextDep, session: SessionDep, caller: CallerDep
) -> list[BaseModelOffer]:
    """The base models that some pool serves, by name, with the limits an upload must meet."""
    names = sorted({pool.base_model_name for pool in crud_pools.list_pools(session)})
    offers = []
    for name in names:
        try:
            spec, limits = limits_for(
                session, tenant=caller.tenant, base_model=name, settings=ctx.settings
            )
        except BaseModelPending:
            offers.append(
                BaseModelOffer(
                    name=name,
                    ready=False,
                    model_type=None,
                    num_layers=None,
                    hidden_size=None,
                    max_lora_rank=None,
                    max_adapter_bytes=None,
                )
            )
            continue
        offers.append(
            BaseModelOffer(
                name=name,
                ready=True,
                model_type=spec.model_type,
                num_layers=spec.num_layers,
                hidden_size=spec.hidden_size,
                max_lora_rank=limits.max_rank,
                max_adapter_bytes=limits.max_bytes,
            )
        )
    return offers
