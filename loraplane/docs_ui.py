"""`/docs` (Swagger UI) served from this process, never from a CDN.

FastAPI's own pages load their JavaScript and CSS from a CDN, so they stay blank offline. The
assets come from the `fastapi-offline` package (Swagger UI 5, which renders the OpenAPI 3.1
documents FastAPI writes; swagger-ui-bundle's Swagger UI 4 cannot) and are served under
`/docs/static/`. `/redoc` is off: ReDoc's page loads its logo from ReDoc's CDN.
Create the app with `docs_url=None, redoc_url=None` and call `install_docs(app)`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

DOCS_PATH = "/docs"
STATIC_PATH = "/docs/static"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")


def assets_dir() -> Path:
    """The folder holding the files in ASSETS (in the installed `fastapi_offline` package)."""
    return Path(str(files("fastapi_offline") / "static"))


def install_docs(app: FastAPI) -> None:
    """Add /docs and its assets to `app` (kept out of its OpenAPI document)."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("create the app with docs_url=None, redoc_url=None")
    openapi_url = app.openapi_url or "/openapi.json"
    title = app.title

    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title}: API",
            swagger_js_url=f"{STATIC_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_PATH}/favicon.png",
        )

    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(status_code=404, detail=f"no docs asset {name[:64]!r}")
        return FileResponse(assets_dir() / name)

    app.add_api_route(DOCS_PATH, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        STATIC_PATH + "/{name}", asset, methods=["GET", "HEAD"], include_in_schema=False
    )
