"""Tenant routes: adapters and their versions. A tenant sees only its own adapters: any other
name, whoever owns it, is 404."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loraplane.controlplane import staging
from loraplane.controlplane.api.deps import Caller, CallerDep, ContextDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.api.routes.uploads import UPLOADS_PATH, job_public
from loraplane.controlplane.context import AppContext
from loraplane.controlplane.crud import adapters as crud
from loraplane.controlplane.crud import rollouts
from loraplane.controlplane.errors import InvalidRequest, PayloadTooLarge, describe_errors
from loraplane.controlplane.ingestion import (
    fetch_import,
    import_location,
    ingest_adapter,
    precheck,
)
from loraplane.controlplane.schemas.adapters import (
    AdapterImport,
    AdapterPublic,
    AdapterUpdate,
    RolloutPromote,
    RolloutVersion,
    StagedAdapter,
    UploadJobPublic,
    UploadResult,
    VersionPublic,
)
from loraplane.controlplane.signatures import SignatureClaim
from loraplane.controlplane.uploads import FILE_FIELD, receive_multipart

router = APIRouter(
    prefix="/v1/adapters", tags=["tenant: adapters"], responses=errors(400, 401, 429)
)
MAX_JSON_BYTES = 64 << 10

UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "base_model", FILE_FIELD],
                    "properties": {
                        "name": {"type": "string"},
                        "base_model": {"type": "string"},
                        "signature": {
                            "type": "string",
                            "description": "base64 signature of `sha256:<canonical digest>` "
                            "by a registered signing key (ECDSA P-256 or Ed25519; cosign "
                            "sign-blob's output as is)",
                        },
                        "signature_key_id": {
                            "type": "string",
                            "description": "the signing key's id (optional: without it every "
                            "live key of the tenant is tried)",
                        },
                        FILE_FIELD: {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": "adapter_config.json + adapter_model.safetensors, "
                            "or one .tar.gz/.zip holding them",
                        },
                    },
                }
            },
            "application/json": {"schema": AdapterImport.model_json_schema()},
        },
    }
}


def adapter_public(view: crud.AdapterView) -> AdapterPublic:
    """The API shape of an adapter and the version it serves."""
    a = view.adapter
    return AdapterPublic(
        name=a.name,
        base_model=a.base_model,
        current_version=a.current_version,
        latest_version=view.latest_version,
        follow_latest=a.follow_latest,
        rollout=[RolloutVersion(version=v, weight=w) for v, w in rollouts.parse(a.rollout).items()]
        or None,
        created_at=a.created_at,
        updated_at=a.updated_at,
        current=VersionPublic.model_validate(view.current) if view.current else None,
    )


@router.post(
    "",
    response_model=UploadResult,
    status_code=status.HTTP_201_CREATED,
    responses={
        **errors(409, 413, 422, 503),
        200: {"model": UploadResult, "description": "identical content: that version"},
        202: {
            "model": UploadJobPublic | StagedAdapter,
            "description": "embedded mode, a big upload or `Prefer: respond-async`: an "
            "UploadJob to poll at its Location; cluster mode: staged (StagedAdapter), the "
            "operator ingests it",
        },
    },
    openapi_extra=UPLOAD_BODY,
)
async def upload_adapter(
    request: Request,
    response: Response,
    ctx: ContextDep,
    session: SessionDep,
    caller: CallerDep,
) -> UploadResult | JSONResponse:
    """Upload an adapter (multipart) or import one from an allowlisted S3 bucket (JSON).

    New content becomes the next version (201); content identical to a version answers that
    version (200); a rejected adapter answers 422 with its reason code and stores nothing.
    Uploads of at least LORAPLANE_BACKGROUND_INGEST_BYTES (default 64 MiB), and any upload or
    import sent with `Prefer: respond-async`, are ingested in the background: 202 with an
    UploadJob whose `Location` (`/v1/uploads/{id}`) the client polls.
    In cluster mode a valid adapter is staged and the tenant's LoRAAdapter points at it
    (202); the operator ingests it and records the version.
    """
    # authentication ran in a transaction: end it before the body streams in (that may take
    # minutes), so the connection goes back to the pool; the session opens a new one later
    await run_in_threadpool(session.commit)
    cap = ctx.settings.max_upload_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise PayloadTooLarge(f"the upload is larger than the limit of {cap} bytes")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    respond_async = "respond-async" in request.headers.get("prefer", "").lower()
    workdir = Path(tempfile.mkdtemp(prefix="upload-", dir=ctx.store.staging_dir()))
    owned = True  # the request removes its work folder, unless a background job takes it
    try:
        size = 0
        if kind == "multipart/form-data":
            upload = await receive_multipart(
                request.stream(), request.headers["content-type"], workdir, max_bytes=cap
            )
            missing = [f for f in ("name", "base_model") if not upload.fields.get(f)]
            if missing:
                raise InvalidRequest(f"missing form field(s): {', '.join(missing)}")
            name, base_model = upload.fields["name"], upload.fields["base_model"]
            claim = SignatureClaim.of(
                upload.fields.get("signature"), upload.fields.get("signature_key_id")
            )
            source: Path | str = upload.source()
            size = sum(f.stat().st_size for f in upload.files)
        elif kind == "application/json":
            body = await _json_body(request)
            name, base_model, source = body.name, body.base_model, body.source_uri
            claim = SignatureClaim.of(body.signature, body.signature_key_id)
        else:
            raise InvalidRequest("send multipart/form-data (files) or application/json (import)")
        if ctx.cluster is not None:
            return await _staged(ctx, session, caller, name, base_model, source, claim)
        uploads = ctx.uploads
        # Imports are downloaded by their job: only `Prefer: respond-async` moves them.
        big = isinstance(source, Path) and size >= ctx.settings.background_ingest_bytes
        if uploads is not None and (respond_async or big):
            if isinstance(source, str):
                import_location(ctx.settings, source)  # refuse a disallowed URI at once
            await run_in_threadpool(
                lambda: precheck(
                    session,
                    tenant=caller.tenant,
                    name=name,
                    base_model=base_model,
                    settings=ctx.settings,
                )
            )
            job = await run_in_threadpool(
                lambda: uploads.submit(
                    session,
                    tenant=caller.tenant,
                    name=name,
                    base_model=base_model,
                    source=source,
                    workdir=workdir,
                    size_bytes=size,
                    actor=caller.actor,
                    signature=claim,
                )
            )
            owned = False
            return _accepted(job_public(session, job), respond_async)
        if isinstance(source, str):
            source = await run_in_threadpool(
                fetch_import, ctx.settings, source, workdir, max_bytes=cap
            )
        local = source
        result = await run_in_threadpool(
            lambda: ingest_adapter(
                session,
                factory=ctx.sessions,
                store=ctx.store,
                settings=ctx.settings,
                tenant=caller.tenant,
                name=name,
                base_model=base_model,
                source=local,
                actor=caller.actor,
                signature=claim,
            )
        )
    finally:
        if owned:
            await run_in_threadpool(shutil.rmtree, workdir, True)
    response.status_code = status.HTTP_201_CREATED if result.created else status.HTTP_200_OK
    return UploadResult(
        name=result.adapter.name,
        created=result.created,
        current_version=result.adapter.current_version,
        version=VersionPublic.model_validate(result.version),
        ignored=list(result.ignored),
    )


def _accepted(job: UploadJobPublic, respond_async: bool) -> JSONResponse:
    """202 for a background upload: the job, and where to poll it."""
    headers = {"Location": f"{UPLOADS_PATH}/{job.id}"}
    if respond_async:
        headers["Preference-Applied"] = "respond-async"
    return JSONResponse(
        job.model_dump(mode="json"), status_code=status.HTTP_202_ACCEPTED, headers=headers
    )


async def _staged(
    ctx: AppContext,
    session: Session,
    caller: Caller,
    name: str,
    base_model: str,
    source: Path | str,
    claim: SignatureClaim,
) -> JSONResponse:
    """Cluster mode: stage an upload (a local path) or point at an import (an s3:// URI)."""
    resources = ctx.cluster
    assert resources is not None
    if isinstance(source, Path):
        staged = await run_in_threadpool(
            lambda: staging.stage_upload(
                session,
                factory=ctx.sessions,
                store=ctx.store,
                resources=resources,
                settings=ctx.settings,
                tenant=caller.tenant,
                name=name,
                base_model=base_model,
                source=source,
                actor=caller.actor,
                signature=claim,
            )
        )
    else:
        staged = await run_in_threadpool(
            lambda: staging.stage_import(
                session,
                resources=resources,
                settings=ctx.settings,
                tenant=caller.tenant,
                name=name,
                base_model=base_model,
                source_uri=source,
                actor=caller.actor,
                signature=claim,
            )
        )
    body = StagedAdapter(
        name=staged.name,
        source_uri=staged.source_uri,
        resource=staged.resource,
        ignored=list(staged.ignored),
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=status.HTTP_202_ACCEPTED)


async def _json_body(request: Request) -> AdapterImport:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BYTES:
            raise PayloadTooLarge(f"a JSON body is limited to {MAX_JSON_BYTES} bytes")
    try:
        return AdapterImport.model_validate_json(bytes(raw))
    except ValidationError as exc:
        raise describe_errors(exc.errors()) from None


@router.get("", response_model=list[AdapterPublic])
def list_adapters(session: SessionDep, caller: CallerDep) -> list[AdapterPublic]:
    """The caller's adapters."""
    return [adapter_public(v) for v in crud.list_adapters(session, tenant=caller.tenant)]


@router.get("/{name}", response_model=AdapterPublic, responses=errors(404))
def get_adapter(name: str, session: SessionDep, caller: CallerDep) -> AdapterPublic:
    """One of the caller's adapters."""
    return adapter_public(crud.get_adapter_view(session, tenant=caller.tenant, name=name))


@router.get("/{name}/versions", response_model=list[VersionPublic], responses=errors(404))
def list_versions(name: str, session: SessionDep, caller: CallerDep) -> list[VersionPublic]:
    """Every version of one of the caller's adapters, oldest first."""
    rows = crud.list_versions(session, tenant=caller.tenant, name=name)
    return [VersionPublic.model_validate(v) for v in rows]


@router.patch("/{name}", response_model=AdapterPublic, responses=errors(404))
def update_adapter(
    name: str, body: AdapterUpdate, session: SessionDep, caller: CallerDep
) -> AdapterPublic:
    """Choose what the adapter's plain name serves.

    `{"current_version": n}` serves version n and holds it: later pushes add versions but n
    keeps serving (roll back, or forward, by choosing another). `{"current_version": null}`
    serves the latest version and follows later pushes again. Either ends a running rollout.
    `{"rollout": {"3": 90, "4": 10}}` splits the plain name's requests across versions by
    weight (integers summing to 100, at most 4 versions; one at 100 promotes it) and holds
    the adapter; replicas load each version with weight before its first request. A version
    never recorded is 404, naming the versions there are. Replicas pick the change up within
    their resolve cache's lifetime (seconds); `name@version` requests are not affected."""
    if body.rollout is not None:
        rollouts.set_rollout(
            session, tenant=caller.tenant, name=name, weights=body.rollout, actor=caller.actor
        )
    else:
        crud.set_current_version(
            session,
            tenant=caller.tenant,
            name=name,
            version=body.current_version,
            actor=caller.actor,
        )
    return adapter_public(crud.get_adapter_view(session, tenant=caller.tenant, name=name))


@router.post("/{name}/rollout/promote", response_model=AdapterPublic, responses=errors(404, 409))
def promote_rollout(
    name: str, session: SessionDep, caller: CallerDep, body: RolloutPromote | None = None
) -> AdapterPublic:
    """End the running rollout by serving one of its versions alone (held, as a chosen
    version is): `{"version": n}`, or with no body the rollout's one version besides the
    current. 409 when no rollout runs or the version to promote is ambiguous."""
    version = body.version if body is not None else None
    rollouts.promote(session, tenant=caller.tenant, name=name, version=version, actor=caller.actor)
    return adapter_public(crud.get_adapter_view(session, tenant=caller.tenant, name=name))


@router.post("/{name}/rollout/rollback", response_model=AdapterPublic, responses=errors(404, 409))
def rollback_rollout(name: str, session: SessionDep, caller: CallerDep) -> AdapterPublic:
    """End the running rollout: the plain name serves `current_version` (the version it
    served before the rollout) alone again. 409 when no rollout runs."""
    rollouts.rollback(session, tenant=caller.tenant, name=name, actor=caller.actor)
    return adapter_public(crud.get_adapter_view(session, tenant=caller.tenant, name=name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404, 503))
def delete_adapter(name: str, ctx: ContextDep, session: SessionDep, caller: CallerDep) -> None:
    """Stop serving an adapter; its versions stay recorded and their files stored.

    Its name answers 404 from now on and no longer counts against the max_adapters quota; the
    stored files stay until a retention job removes them. Pushing the name again starts it
    afresh, following its latest version.

    In cluster mode the tenant's LoRAAdapter is deleted (the operator's finalizer then marks
    the catalog); with no such resource the catalog's adapter is marked here.
    """
    if ctx.cluster is not None and ctx.cluster.delete(caller.tenant.namespace, name):
        staging.audit_delete(session, tenant=caller.tenant, name=name, actor=caller.actor)
        return
    crud.delete_adapter(session, tenant=caller.tenant, name=name, actor=caller.actor)
