"""The API's documentation pages, Swagger UI at /docs and ReDoc at /redoc, with their scripts,
styles and icon served from the installed `fastapi-offline` package rather than a CDN: the pages
work on a machine without internet, like the admin UI. Their Content-Security-Policy keeps them
from reaching other hosts at all (ReDoc would fetch its maker's logo)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_PATH = "/docs"
REDOC_PATH = "/redoc"
ASSETS_PATH = "/docs-assets"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")
"""Only this server; the pages' own inline start-up code and styles; ReDoc's search worker."""


def install_api_docs(app: FastAPI) -> None:
    """Add the pages to an app created with `docs_url=None, redoc_url=None`."""
    app.mount(ASSETS_PATH, StaticFiles(directory=str(files("fastapi_offline") / "static")),
              name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = f"{DOCS_PATH}/oauth2-redirect"

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return _local(get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} API", oauth2_redirect_url=oauth2_redirect,
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png"))

    @app.get(oauth2_redirect, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_PATH, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return _local(get_redoc_html(openapi_url=openapi_url, title=f"{app.title} API",
                                     redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
                                     redoc_favicon_url=f"{ASSETS_PATH}/favicon.png", with_google_fonts=False))


def _local(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return page
