"""The gateway's API docs at ``/docs``, from files of this package.

FastAPI's own ``/docs`` loads Swagger UI's script, style and icon from a CDN: offline, or where
the gateway's users cannot reach the internet, the page stays blank. Here the same page (FastAPI's
:func:`~fastapi.openapi.docs.get_swagger_ui_html`) takes them from the gateway:
``swagger-ui-bundle.js`` and ``swagger-ui.css`` of ``swagger-ui-dist`` 5.35.0 (the npm registry,
Apache-2.0, in ``ui/vendor/`` beside the dashboard's Chart.js; its source-map comment taken out),
and the dashboard's icon. Swagger UI's online validator is off (it sends the schema out), and so
is ``/redoc``, whose page loads ReDoc from a CDN too. ``/openapi.json`` is FastAPI's.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

UI = Path(__file__).parent / "ui"
# what /docs/NAME serves: the file and its type
FILES = {
    "swagger-ui-bundle.js": (UI / "vendor" / "swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui.css": (UI / "vendor" / "swagger-ui.css", "text/css"),
    "favicon.svg": (UI / "favicon.svg", "image/svg+xml"),
}


def mount_docs(app: FastAPI) -> None:
    """``/docs`` and its files on ``app`` (made with ``docs_url=None, redoc_url=None``)."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title}: API",
            swagger_js_url="/docs/swagger-ui-bundle.js",
            swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="/docs/favicon.svg",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/docs/{name}", include_in_schema=False)
    def docs_file(name: str) -> Response:
        if name not in FILES:
            raise HTTPException(404, f"no docs file {name!r}: one of {', '.join(FILES)}")
        path, media_type = FILES[name]
        headers = {"Cache-Control": "public, max-age=86400"}
        return Response(path.read_bytes(), media_type=media_type, headers=headers)
