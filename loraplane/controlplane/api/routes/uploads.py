"""Tenant routes: background uploads (embedded mode). A tenant sees only its own jobs."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.api.deps import CallerDep, ContextDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import jobs as crud
from loraplane.controlplane.models import Adapter, AdapterVersion, UploadJob
from loraplane.controlplane.schemas.adapters import UploadJobPublic, UploadResult, VersionPublic
from loraplane.controlplane.schemas.common import ErrorDetail

router = APIRouter(prefix="/v1/uploads", tags=["tenant: uploads"], responses=errors(400, 401, 429))
UPLOADS_PATH = router.prefix


def job_public(session: Session, job: UploadJob) -> UploadJobPublic:
    """The API shape of a job; a succeeded one carries the version it stored or matched."""
    result = None
    if job.status == crud.SUCCEEDED and job.version is not None:
        row = session.execute(
            select(Adapter, AdapterVersion)
            .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
            .where(
                Adapter.tenant_id == job.tenant_id,
                Adapter.name == job.adapter,
                AdapterVersion.version == job.version,
            )
        ).first()
        if row is not None:
            adapter, version = row
            result = UploadResult(
                name=adapter.name,
                created=bool(job.created),
                current_version=adapter.current_version,
                version=VersionPublic.model_validate(version),
                ignored=list(job.ignored or []),
            )
    error = None
    if job.status == crud.FAILED:
        error = ErrorDetail(code=job.error_code or "Error", message=job.error_message or "")
    return UploadJobPublic(
        id=job.id,
        name=job.adapter,
        base_model=job.base_model,
        status=job.status,  # type: ignore[arg-type]
        size_bytes=job.size_bytes,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        result=result,
        error=error,
    )


@router.get("", response_model=list[UploadJobPublic])
def list_uploads(ctx: ContextDep, session: SessionDep, caller: CallerDep) -> list[UploadJobPublic]:
    """The caller's 100 newest background uploads, newest first."""
    timeout = timedelta(seconds=ctx.settings.upload_job_timeout_seconds)
    jobs = crud.list_jobs(session, tenant=caller.tenant, timeout=timeout)
    return [job_public(session, j) for j in jobs]


@router.get("/{upload_id}", response_model=UploadJobPublic, responses=errors(404))
def get_upload(
    upload_id: str, ctx: ContextDep, session: SessionDep, caller: CallerDep
) -> UploadJobPublic:
    """One background upload: `pending`, `running`, `succeeded` (with `result`) or `failed`
    (with `error`: the code the upload would have answered synchronously)."""
    timeout = timedelta(seconds=ctx.settings.upload_job_timeout_seconds)
    job = crud.get_job(session, tenant=caller.tenant, job_id=upload_id, timeout=timeout)
    return job_public(session, job)
