"""A Kubernetes API for the operator's tests: kmock's emulator, with the gaps filled.

kmock's `KubernetesEmulator` keeps objects in memory and serves them over real HTTP with
watch streams. This subclass adds what Kopf and kubectl rely on:
- discovery of the built-in resources and of our two CRDs (with the status subresource);
- server-filled metadata on create (uid, generation, creationTimestamp, resourceVersion,
  namespace from the URL), a new resourceVersion on every write, and a generation bump when
  (and only when) the spec changes, as for a CRD with a status subresource;
- the status subresource: `/status` writes touch only status, main writes never touch it;
- kubectl-friendly errors (`reason: NotFound`, `AlreadyExists`) and typed list responses;
- only declared resources are served (kmock would store anything): a custom resource exists
  once its CustomResourceDefinition is created through the API, and goes with it.

It runs in its own thread and event loop (`EmulatorThread`), so shutdowns do not wait on
the operator's watch streams.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import re
import threading
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import enums, k8s

from loraplane.operator import crds
from loraplane.operator.specs import GROUP, VERSION

VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
_OBJECT_ACTIONS = {
    enums.action.LIST, enums.action.WATCH, enums.action.FETCH,
    enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE,
}  # fmt: skip
CRDS = ("apiextensions.k8s.io", "customresourcedefinitions")
# kmock's path parser reads `/api/v1/namespaces/<name>` as a namespace, not a Namespace object:
# such requests are served under this alias instead.
NAMESPACES_ALIAS = "namespaceobjects"
_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces(/[^/]+)?")
_REASONS = {404: "NotFound", 409: "AlreadyExists"}


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


class ClusterEmulator(kmock.KubernetesEmulator):
    """The emulator with server-side metadata, a status subresource and kubectl errors."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1000)
        with warnings.catch_warnings():  # kmock reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        for crd in crds.all_crds():  # discovery as the API server derives it from our CRDs
            self.declare(crd)
        self.resources[f"v1/{NAMESPACES_ALIAS}"] = kmock.ResourceInfo(
            kind="Namespace", singular="namespace", namespaced=False, verbs=VERBS
        )

    def declare(self, crd: dict[str, Any]) -> None:
        """Serve (and list in discovery) the resource of a CRD, each served version."""
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            if version.get("served", True):
                self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = (
                    kmock.ResourceInfo(
                        kind=names["kind"],
                        singular=names.get("singular", names["kind"].lower()),
                        shortnames=names.get("shortNames", []),
                        categories=names.get("categories", []),
                        namespaced=spec["scope"] == "Namespaced",
                        verbs=VERBS,
                        subresources=list(version.get("subresources") or {}),
                    )
                )

    def _forget(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            key = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            for resource in list(self.resources):
                if resource == key:
                    del self.resources[resource]

    def _served(self, request: kmock.Request) -> bool:
        res = request.resource
        if res is None or not res.plural or request.action not in _OBJECT_ACTIONS:
            return True  # discovery and non-resource paths
        return any(res == known for known in self.resources)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        url = raw_request.rel_url
        match = _NAMESPACE_PATH.fullmatch(url.path)
        if match:
            path = f"/api/v1/{NAMESPACES_ALIAS}{match.group(1) or ''}"
            raw_request = raw_request.clone(rel_url=url.with_path(path).with_query(url.query))
        return await super().__call__(raw_request)

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else dict(obj.raw)

    def _has_status(self, request: kmock.Request) -> bool:
        res = request.resource
        return res is not None and res.group == GROUP

    def _fill(self, request: kmock.Request) -> None:
        data = request.data
        if not isinstance(data, dict):
            return
        meta = data.setdefault("metadata", {})
        if request.action == enums.action.CREATE:
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["generation"] = 1
            meta["creationTimestamp"] = now
            meta["resourceVersion"] = str(next(self._versions))
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            if self._has_status(request):
                data.pop("status", None)
        elif request.action == enums.action.UPDATE:
            current = self._current(request)
            if request.subresource == "status":
                for key in list(data):
                    if key not in ("status", "metadata"):
                        del data[key]
                data["metadata"] = meta = {}
            elif self._has_status(request):
                data.pop("status", None)
            spec = current.get("spec") if current is not None else None
            if current is not None and "spec" in data and _merge(spec, data["spec"]) != spec:
                meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._versions))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if not self._served(request):  # as the API server answers for a resource it lacks
            raise k8s.KubernetesError(
                status=404, message="the server could not find the requested resource"
            )
        if request.resource is not None:
            self._fill(request)
        current = self._current(request) if request.action == enums.action.DELETE else None
        response = await super()._handle(request)
        res = request.resource
        is_crd = res is not None and (res.group, res.plural) == CRDS
        if request.action == enums.action.CREATE and response.status == 200:
            response.set_status(201)  # as the API server answers a create
            if is_crd and isinstance(request.data, dict):
                self.declare(request.data)
        if is_crd and current is not None and response.status == 200:
            self._forget(current)
        return response

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, k8s.KubernetesError):
            reason = _REASONS.get(exc.status, exc.reason or type(exc).__name__)
            body = {
                "apiVersion": "v1",
                "kind": "Status",
                "metadata": {},
                "code": exc.status,
                "status": "Failure",
                "reason": reason,
                "message": exc.message or reason,
                "details": {},
            }
            return aiohttp.web.json_response(body, status=exc.status)
        return await super()._render_error(exc)

    async def _serve_version(self, request: kmock.Request) -> Any:
        result = await super()._serve_version(request)
        if isinstance(result, dict):
            result["groupVersion"] = result["groupVersion"].lstrip("/")  # core is "v1"
            result["resources"] = [r for r in result["resources"] if r["name"] != NAMESPACES_ALIAS]
        return result

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        res = request.resource
        if isinstance(result, dict) and res is not None:
            info = self.resources[res]
            kind = info.kind or (res.plural or "").capitalize()
            group = f"{res.group}/{res.version}" if res.group else res.version
            result.update(kind=f"{kind}List", apiVersion=group)
            result["metadata"] = {"resourceVersion": str(next(self._versions))}
        return result


class EmulatorThread:
    """The emulator serving on 127.0.0.1 from its own thread and event loop."""

    def __init__(self) -> None:
        self.emulator: ClusterEmulator | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        emulator = ClusterEmulator()
        async with emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> None:
        """Start serving; returns when the URL is known."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the Kubernetes emulator did not start")

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def objects(self, plural: str, group: str = GROUP, version: str = VERSION) -> list[Any]:
        """Raw stored objects of one resource (a snapshot)."""
        assert self.emulator is not None
        out = []
        for (res, _ns, _name), obj in list(self.emulator.objects.items()):
            if res.plural == plural and res.group == group and not obj.deleted:
                out.append(copy.deepcopy(obj.raw))
        return out


@contextmanager
def running_emulator() -> Iterator[EmulatorThread]:
    """An emulator for the duration of the block."""
    thread = EmulatorThread()
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
