"""Upload jobs: uploads ingested in the background, and what their tenants see of them.

A job goes pending -> running -> succeeded | failed, each step committed on its own so a poll
sees it at once. A job whose process stopped before it finished would stay unfinished
forever; such jobs read as failed with code `Interrupted` (the upload can simply be sent
again: identical content gets the same version).
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from loraplane.controlplane.errors import NotFound
from loraplane.controlplane.models import Tenant, UploadJob, utcnow

PENDING, RUNNING, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
UNFINISHED = (PENDING, RUNNING)
INTERRUPTED = "Interrupted"
INTERRUPTED_MESSAGE = (
    "the control plane stopped before this upload was ingested; send it again (identical "
    "content gets the same version)"
)
MESSAGE_LEN = 1000


def create_job(
    session: Session, *, tenant: Tenant, adapter: str, base_model: str, size_bytes: int, actor: str
) -> UploadJob:
    """A pending job, committed (its id is random: polling needs the id and the tenant's key)."""
    job = UploadJob(
        id=secrets.token_hex(16),
        tenant_id=tenant.id,
        adapter=adapter,
        base_model=base_model,
        size_bytes=size_bytes,
        status=PENDING,
        actor=actor,
    )
    session.add(job)
    session.commit()
    return job


def mark_running(session: Session, job_id: str) -> None:
    """The job has started."""
    session.execute(
        update(UploadJob).where(UploadJob.id == job_id).values(status=RUNNING, started_at=utcnow())
    )
    session.commit()


def mark_succeeded(
    session: Session, job_id: str, *, version: int, created: bool, ignored: list[str]
) -> None:
    """The job stored (or matched) `version`; `ignored`: the upload's files it never opened."""
    session.execute(
        update(UploadJob)
        .where(UploadJob.id == job_id)
        .values(
            status=SUCCEEDED,
            version=version,
            created=created,
            ignored=ignored,
            finished_at=utcnow(),
        )
    )
    session.commit()


def mark_failed(session: Session, job_ids: list[str], *, code: str, message: str) -> None:
    """The jobs ended with an error (`code` as the synchronous answer would have had it)."""
    if not job_ids:
        return
    session.execute(
        update(UploadJob)
        .where(UploadJob.id.in_(job_ids), UploadJob.status.in_(UNFINISHED))
        .values(
            status=FAILED,
            error_code=code,
            error_message=message[:MESSAGE_LEN],
            finished_at=utcnow(),
        )
    )
    session.commit()


def fail_unfinished(
    session: Session, *, older_than: timedelta | None = None, tenant: Tenant | None = None
) -> int:
    """Fail the unfinished jobs (of `tenant`, created more than `older_than` ago): the
    process that held them is gone. Returns how many were failed."""
    stmt = update(UploadJob).where(UploadJob.status.in_(UNFINISHED))
    if older_than is not None:
        stmt = stmt.where(UploadJob.created_at < utcnow() - older_than)
    if tenant is not None:
        stmt = stmt.where(UploadJob.tenant_id == tenant.id)
    result = session.execute(
        stmt.values(
            status=FAILED,
            error_code=INTERRUPTED,
            error_message=INTERRUPTED_MESSAGE,
            finished_at=utcnow(),
        )
    )
    session.commit()
    return int(getattr(result, "rowcount", 0) or 0)


def prune_finished(session: Session, *, older_than: timedelta) -> int:
    """Delete jobs that ended more than `older_than` ago; how many went."""
    result = session.execute(
        delete(UploadJob).where(
            UploadJob.status.not_in(UNFINISHED), UploadJob.finished_at < utcnow() - older_than
        )
    )
    session.commit()
    return int(getattr(result, "rowcount", 0) or 0)


def get_job(session: Session, *, tenant: Tenant, job_id: str, timeout: timedelta) -> UploadJob:
    """The tenant's job `job_id` (NotFound for anyone else's); an unfinished job older than
    `timeout` is failed as Interrupted first."""
    job = session.scalar(
        select(UploadJob).where(UploadJob.id == job_id, UploadJob.tenant_id == tenant.id)
    )
    if job is None:
        raise NotFound(f"upload {job_id[:40]!r} not found")
    if job.status in UNFINISHED and job.created_at < utcnow() - timeout:
        mark_failed(session, [job.id], code=INTERRUPTED, message=INTERRUPTED_MESSAGE)
        session.refresh(job)
    return job


def list_jobs(
    session: Session, *, tenant: Tenant, timeout: timedelta, limit: int = 100
) -> list[UploadJob]:
    """The tenant's newest jobs first (unfinished ones older than `timeout` failed first)."""
    fail_unfinished(session, older_than=timeout, tenant=tenant)
    stmt = (
        select(UploadJob)
        .where(UploadJob.tenant_id == tenant.id)
        .order_by(UploadJob.created_at.desc(), UploadJob.id)
        .limit(limit)
    )
    return list(session.scalars(stmt))
