"""The operator's dashboard: web pages the gateway serves at ``/ui``, behind the same API keys.

Pages (static HTML, the data fetched by the page's script every :data:`POLL_S` seconds from
``/ui/api/state``, so they update live without a reload):

- ``/ui``: the plan's topology (datacenters, the stages placed in each, the reserved paths
  between them) and the services (SID, stage, replica, device, health, heartbeat age, epoch);
- ``/ui/tasks``: tasks and queues (lanes, the exception queue), model versions and the canary's
  share, faults;
- ``/ui/charts``: step time measured beside predicted (for a task whose dp changed while it
  ran, each dp's steps beside that dp's prediction, and a table of them), loss, throughput,
  per-link traffic, and the measured pipeline Gantt of the last steps (Chart.js, vendored from
  the npm registry).

Access needs a key with the ``read`` scope: an ``Authorization: Bearer`` header, or the session
cookie that the login form (``POST /ui/login``) sets (HttpOnly, SameSite=Strict, for ``/ui``
only; the key is checked again on every request, so revoking it ends the session). Anything else
is answered 401 with the login form. The form is taken from the dashboard's own pages only: a
login POST whose ``Origin`` is another site (or ``null``), or that the browser marks
``Sec-Fetch-Site: cross-site``, is refused 403 (a page elsewhere cannot log a visitor in under
its own key). The pages run no inline script and load nothing from
elsewhere (a Content-Security-Policy of ``'self'``), and login attempts are rate limited per
client address. A tenant's key sees its own tasks, metrics and traffic only (the state is built
for its tenant, :func:`dmsc.runtime.control.dashboard_state.tenant_rows`); an admin key sees
every tenant's.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from anyio import to_thread
from cachetools import TTLCache
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse

from dmsc.runtime.business.auth import Principal, PrincipalCache
from dmsc.runtime.business.http_guard import LOGIN_PATH, SESSION_COOKIE, UI_PREFIX
from dmsc.runtime.business.protection import RateLimiter

ASSETS = Path(__file__).parent / "ui"
# path -> (page name, title); each page is layout.html around its own NAME.html sections
PAGES = {
    "": ("overview", "Topology &amp; services"),
    "tasks": ("tasks", "Tasks, models &amp; faults"),
    "charts": ("charts", "Charts &amp; pipeline"),
}
# the files a page may load: nothing else under ASSETS is served
STATIC = {
    "dashboard.css": "text/css",
    "favicon.svg": "image/svg+xml",
    "dashboard.js": "text/javascript",
    "vendor/chart.umd.min.js": "text/javascript",
}
POLL_S = 2.0
SESSION_TTL_S = 8 * 3600.0
STATE_TTL_S = 1.0  # pages polling at once share one read of the state
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

State = Callable[[str | None], dict[str, Any]]  # the document for a tenant (None: every one)
Authorize = Callable[[Request, str], Principal]


class UiSessions:
    """Dashboard sessions: a random token -> the Authorization header given at login, for
    ``ttl_s``; at most ``maxsize`` (the oldest go first). Thread-safe."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        maxsize: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.maxsize, self.clock = ttl_s, maxsize, clock
        self._tokens: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, authorization: str) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = (authorization, self.clock() + self.ttl_s)
            while len(self._tokens) > self.maxsize:
                self._tokens.popitem(last=False)
        return token

    def authorization(self, token: str) -> str | None:
        with self._lock:
            found = self._tokens.get(token)
            if found is None:
                return None
            if self.clock() >= found[1]:
                del self._tokens[token]
                return None
            return found[0]

    def drop(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(token, None)


class _CachedState:
    """The state document of each tenant, built at most once per ``ttl_s`` (in a worker
    thread); the documents of at most ``maxsize`` tenants are kept."""

    def __init__(self, build: State, ttl_s: float = STATE_TTL_S, maxsize: int = 1024) -> None:
        self.build, self.ttl_s = build, ttl_s
        self._docs: TTLCache[str | None, bytes] = TTLCache(maxsize=maxsize, ttl=ttl_s)
        self._lock = threading.Lock()

    def get(self, tenant: str | None) -> bytes:
        import json

        with self._lock:  # one build at a time; the others wait for it and share it
            doc = self._docs.get(tenant)
            if doc is None:
                doc = json.dumps(self.build(tenant), default=str).encode()
                self._docs[tenant] = doc
            return doc


def _page(name: str, status: int = 200, message: str = "") -> HTMLResponse:
    html = (ASSETS / name).read_text(encoding="utf-8")
    if message:  # the login form's reason, escaped: it never carries what the client sent
        from html import escape

        html = html.replace("<!--message-->", f'<p class="error">{escape(message)}</p>')
    headers = dict(HEADERS)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return HTMLResponse(html, status_code=status, headers=headers)


def _same_origin(request: Request) -> bool:
    """Whether a form POST comes from this site: its ``Origin`` (when the client sends one) is
    the origin the request was made to, and the browser does not mark it cross-site."""
    site = request.headers.get("sec-fetch-site")
    if site not in (None, "same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin == "null":
        # The pages send Referrer-Policy: no-referrer, under which Chromium sends "Origin: null"
        # on the login page's own form POST; it still says where the POST came from.
        return site == "same-origin"
    return origin is None or origin == f"{request.url.scheme}://{request.url.netloc}"


def _layout(name: str, title: str) -> HTMLResponse:
    """Page ``name``: the shared layout (head, navigation, status) around its sections."""
    html = (ASSETS / "layout.html").read_text(encoding="utf-8")
    html = html.replace("<!--title-->", title).replace("<!--page-->", name)
    html = html.replace(f'data-nav="{name}"', f'data-nav="{name}" class="here"')
    body = (ASSETS / f"{name}.html").read_text(encoding="utf-8")
    return HTMLResponse(html.replace("<!--body-->", body), headers=HEADERS)


def mount_dashboard(
    app: FastAPI,
    state: State,
    principals: PrincipalCache,
    sessions: UiSessions,
    authorize: Authorize,
    login_rate: float = 0.2,
    login_burst: float = 5.0,
) -> None:
    """Add the dashboard's routes to the gateway ``app`` (module docstring). ``state`` builds
    the document the pages draw; ``authorize(request, scope)`` is the gateway's own check (401,
    403, 429). Login attempts: ``login_rate`` per second and ``login_burst`` per address."""
    logins = RateLimiter(login_rate, login_burst)
    doc = _CachedState(state)

    def who(request: Request) -> Principal | None:
        try:
            return authorize(request, "read")
        except HTTPException as exc:
            if exc.status_code == 401:
                return None
            raise

    @app.get(UI_PREFIX + "/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        return FileResponse(ASSETS / name, media_type=STATIC[name], headers=HEADERS)

    @app.get(UI_PREFIX + "/api/state", include_in_schema=False)
    async def api_state(request: Request) -> Response:
        reader = who(request)
        if reader is None:
            raise HTTPException(401, "log in at /ui/login", headers={"WWW-Authenticate": "Bearer"})
        tenant = None if reader.may("admin") else reader.tenant  # as GET /v1/tasks
        body = await to_thread.run_sync(doc.get, tenant)
        return Response(body, media_type="application/json", headers=HEADERS)

    @app.post(LOGIN_PATH, include_in_schema=False)
    async def login(request: Request) -> Response:
        if not _same_origin(request):
            return _page("login.html", 403, "a login from another site is refused")
        address = request.client.host if request.client else "?"
        ok, retry = logins.check(address)
        if not ok:
            return JSONResponse(
                {"detail": "too many login attempts"},
                status_code=429,
                headers={"Retry-After": str(retry)},
            )
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        key = (form.get("key") or [""])[0].strip()
        authorization = f"Bearer {key}"
        found = await to_thread.run_sync(principals.lookup, authorization) if key else None
        if found is None:
            return _page("login.html", 401, "unknown or revoked key")
        if not found.may("read"):
            return _page("login.html", 403, "this key lacks the 'read' scope")
        token = sessions.create(authorization)
        out = RedirectResponse(UI_PREFIX, status_code=303, headers=HEADERS)
        out.set_cookie(
            SESSION_COOKIE,
            token,
            max_age=int(SESSION_TTL_S),
            path=UI_PREFIX,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",  # never sent back over plain HTTP
        )
        return out

    @app.get(UI_PREFIX + "/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        token = request.cookies.get(SESSION_COOKIE)
        if token:
            sessions.drop(token)
        out = _page("login.html", 401, "logged out")
        out.delete_cookie(SESSION_COOKIE, path=UI_PREFIX)
        return out

    @app.get(UI_PREFIX, response_class=HTMLResponse, include_in_schema=False)
    @app.get(UI_PREFIX + "/{page}", response_class=HTMLResponse, include_in_schema=False)
    async def page(request: Request, page: str = "") -> Response:
        if page not in PAGES:
            raise HTTPException(
                404, f"no dashboard page {page!r}: one of /ui, /ui/tasks, /ui/charts"
            )
        if who(request) is None:
            return _page("login.html", 401)
        return _layout(*PAGES[page])
