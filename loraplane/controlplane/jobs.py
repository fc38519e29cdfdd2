"""Background ingest (embedded mode): big uploads, or any with `Prefer: respond-async`.

The request has already received the upload (or knows the import's URI); `UploadJobs.submit`
records a pending job and hands the work to a small thread pool, and the tenant polls
`GET /v1/uploads/{id}`. A job fails with the same code its synchronous upload would have
answered (a ReasonCode, UnknownBaseModel, QuotaExceeded...). The number of jobs waiting at
once is capped (each holds its upload on disk): past the cap, uploads answer 429.
"""

from __future__ import annotations

import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplane.adapters.errors import AdapterRejected, ReasonCode, StoreError
from loraplane.adapters.store.base import ObjectStore
from loraplane.controlplane.crud import jobs as crud
from loraplane.controlplane.db import session_scope
from loraplane.controlplane.errors import ControlPlaneError, RateLimited
from loraplane.controlplane.ingestion import fetch_import, ingest_adapter
from loraplane.controlplane.models import Tenant, UploadJob
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.signatures import SignatureClaim

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobWork:
    """What one job ingests: an upload already on disk (a Path) or an import (an s3:// URI),
    and the work folder it owns (removed when the job ends)."""

    job_id: str
    tenant_id: int
    name: str
    base_model: str
    source: Path | str
    workdir: Path
    actor: str
    signature: SignatureClaim | None = None  # checked by the ingest, like a synchronous one's


class UploadJobs:
    """The process's background ingest: a bounded queue in front of a few worker threads."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        store: ObjectStore,
        settings: Settings,
    ) -> None:
        self.sessions = sessions
        self.store = store
        self.settings = settings
        self._pool = ThreadPoolExecutor(settings.ingest_workers, thread_name_prefix="ingest")
        self._lock = threading.Lock()
        self._queued: dict[str, JobWork] = {}  # submitted, not finished
        self._closed = False

    def submit(
        self,
        session: Session,
        *,
        tenant: Tenant,
        name: str,
        base_model: str,
        source: Path | str,
        workdir: Path,
        size_bytes: int,
        actor: str,
        signature: SignatureClaim | None = None,
    ) -> UploadJob:
        """Record a pending job and queue it; it owns `workdir` from here on.

        RateLimited (429) when `max_pending_uploads` jobs are already waiting or running.
        """
        cap = self.settings.max_pending_uploads
        with self._lock:
            if self._closed:
                raise RateLimited("the control plane is shutting down", retry_after=5)
            if len(self._queued) >= cap:
                raise RateLimited(
                    f"{cap} uploads are already being ingested in the background; try again",
                    retry_after=self.settings.retry_after_seconds,
                )
            job = crud.create_job(
                session,
                tenant=tenant,
                adapter=name,
                base_model=base_model,
                size_bytes=size_bytes,
                actor=actor,
            )
            work = JobWork(job.id, tenant.id, name, base_model, source, workdir, actor, signature)
            self._queued[job.id] = work
        retention = timedelta(days=self.settings.upload_job_retention_days)
        crud.prune_finished(session, older_than=retention)  # the table stays small
        self._pool.submit(self._run, work)
        log.info("upload %s queued: %s for %s (%d bytes)", job.id, name, actor, size_bytes)
        return job

    def pending(self) -> int:
        """Jobs submitted and not finished."""
        with self._lock:
            return len(self._queued)

    def _run(self, work: JobWork) -> None:
        with self._lock:
            if self._closed:  # a worker freed while close() shuts the pool down: left queued,
                return  # for close() to fail as Interrupted
        try:
            with session_scope(self.sessions) as session:
                self._ingest(session, work)
        except SQLAlchemyError as exc:  # the database is away: the outcome cannot be written
            log.error("upload %s: cannot record its outcome: %s", work.job_id, exc)
        finally:
            shutil.rmtree(work.workdir, ignore_errors=True)
            with self._lock:
                self._queued.pop(work.job_id, None)

    def _ingest(self, session: Session, work: JobWork) -> None:
        crud.mark_running(session, work.job_id)
        try:
            tenant = session.get(Tenant, work.tenant_id)
            if tenant is None or tenant.deleted:
                raise ControlPlaneError("the tenant was deleted", code="NotFound")
            source = work.source
            if isinstance(source, str):
                source = fetch_import(
                    self.settings, source, work.workdir, max_bytes=self.settings.max_upload_bytes
                )
            result = ingest_adapter(
                session,
                factory=self.sessions,
                store=self.store,
                settings=self.settings,
                tenant=tenant,
                name=work.name,
                base_model=work.base_model,
                source=source,
                actor=work.actor,
                signature=work.signature,
            )
        except AdapterRejected as exc:
            code, message = ReasonCode(exc.code).value, exc.message
        except ControlPlaneError as exc:
            code, message = exc.code, exc.message
        except StoreError as exc:
            code, message = "StoreUnavailable", f"the adapter store failed: {exc}"
        except SQLAlchemyError:
            raise
        except Exception as exc:  # a bug: keep the job honest, log the details
            log.exception("upload %s failed unexpectedly", work.job_id)
            code, message = "InternalError", f"ingest failed: {type(exc).__name__}"
        else:
            session.rollback()
            crud.mark_succeeded(
                session,
                work.job_id,
                version=result.version.version,
                created=result.created,
                ignored=list(result.ignored),
            )
            log.info("upload %s stored %s v%d", work.job_id, work.name, result.version.version)
            return
        session.rollback()
        crud.mark_failed(session, [work.job_id], code=code, message=message)
        log.info("upload %s failed: %s: %s", work.job_id, code, message)

    def close(self) -> None:
        """Stop taking jobs, let running ones finish, and fail the queued ones as Interrupted."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = list(self._queued.values())
            self._queued.clear()
        if not left:
            return
        try:
            with session_scope(self.sessions) as session:
                crud.mark_failed(
                    session,
                    [w.job_id for w in left],
                    code=crud.INTERRUPTED,
                    message=crud.INTERRUPTED_MESSAGE,
                )
        except SQLAlchemyError as exc:
            log.warning("could not fail %d queued uploads: %s", len(left), exc)
        for work in left:
            shutil.rmtree(work.workdir, ignore_errors=True)
