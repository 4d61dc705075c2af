"""The API gateway: one HTTP entry for clients (FastAPI; OpenAPI at ``/docs``).

Per request (:mod:`.http_guard` first): authentication before any body is read (API key ->
tenant and scopes, cached), the body limit on the stream (413) and a read deadline (408), then
the endpoint's scope (403) and the tenant's rate limit (429 with Retry-After). Inference is
admitted per tenant by requests and cost in flight (tokens x stages; 429 over either), then goes
through the service router to a pipeline replica under a circuit breaker per replica, failing
over to another replica when one fails; the request's deadline holds everywhere: past it, its
calls stop and free their replica (504). ``redundant``: two replicas at once, the first answer
wins and the other is cancelled. Training and other long work goes into the persistent task
queue. Prometheus metrics at ``/metrics``.

The hot path stays on the event loop: health, inference (which waits on its backend calls
without a thread of its own), model versions (cached for a second) and authentication of a
known key touch neither the database nor the thread pool.
"""

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from dmsc.data.db import Database, ModelVersionRecord, StorageError
from dmsc.runtime.business.alert_routes import mount_alerts
from dmsc.runtime.business.api_docs import mount_docs
from dmsc.runtime.business.auth import Principal, PrincipalCache
from dmsc.runtime.business.dashboard import UiSessions, mount_dashboard
from dmsc.runtime.business.http_guard import UNAUTHORIZED, Guard
from dmsc.runtime.business.protection import CircuitBreaker, RateLimiter, TenantAdmission
from dmsc.runtime.business.queueing import TaskQueue
from dmsc.runtime.business.router import POLICIES, NoReplica, Router, pick_version
from dmsc.runtime.business.task_routes import mount_tasks
from dmsc.runtime.business.versions import ModelVersions
from dmsc.runtime.transport.messages import InferRequest, Sampling
from dmsc.runtime.transport.rpc import NoRoom


class Backend(Protocol):
    """What the gateway serves from: pipeline replicas that answer inference (and, when it has
    them, ``submit_task(req, tenant)``: the control plane's one way in for a training task;
    ``answer(req, cancel)``: its answer to a whole request, an ``aggregate`` one here)."""

    def replicas(self) -> list[str]: ...

    def infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        sampling: Sampling | None = None,
    ) -> str:
        """Generate on ``replica`` for ``tenant``, drawing tokens as ``sampling`` says; stop
        when ``cancel`` is set or at ``deadline`` (``time.monotonic()``)."""
        ...

    def services(self) -> list[dict[str, Any]]: ...

    def stage_count(self) -> int:
        """Stages a request passes (its cost is tokens times this)."""
        ...


def wait_ready(base: str, timeout_s: float = 10.0) -> bool:
    """Wait until a gateway at ``base`` answers ``/v1/health``; False if it did not in time."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/v1/health", timeout=2.0)
            return True
        except httpx.TransportError:
            time.sleep(0.05)
    return False


def _printable(part: object) -> str | int:
    if isinstance(part, int):
        return part
    return str(part).encode("utf-8", "backslashreplace").decode("utf-8")


def _safe_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Validation errors as JSON can carry them: location, message and type, no input."""
    return [
        {
            "loc": [_printable(p) for p in e.get("loc", ())],
            "msg": _printable(e.get("msg", "")),
            "type": _printable(e.get("type", "")),
        }
        for e in errors
    ]


# aggregate through a backend that has no task heads to combine (a test's)
NO_HEADS = "aggregate: this gateway's backend combines no task heads"
DEADLINE_GRACE_S = 0.25  # for a backend that stopped at the deadline to say so


def _finished_later(route: Router, replica: str, _fut: Future[str]) -> None:
    route.finished(replica, 0.0)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its connection closed)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _served_version(text: str, picked: ModelVersionRecord | None) -> int | None:
    """The model version of the weights that produced ``text``, as the backend says (the
    control plane's answers carry it; :mod:`dmsc.runtime.control.serving.held`), else the version
    the request was routed for."""
    if hasattr(text, "model_version"):
        return text.model_version  # type: ignore[no-any-return]
    return picked.id if picked else None


def create_app(
    backend: Backend,
    db: Database,
    queue: TaskQueue,
    rate: float = 20.0,
    burst: float = 40.0,
    max_body_bytes: int = 64 * 1024,
    router: str = "least_outstanding",
    breaker_threshold: int = 3,
    breaker_reset_s: float = 5.0,
    backend_timeout_s: float = 60.0,
    request_timeout_s: float = 120.0,
    clock: Callable[[], float] = time.monotonic,
    principals: PrincipalCache | None = None,
    tenant_requests: int = 4,
    tenant_cost_tokens: int = 2048,
    read_timeout_s: float = 10.0,
    dashboard: Callable[[str | None], dict[str, Any]] | None = None,
) -> FastAPI:
    """The gateway over ``backend``. Per tenant: ``rate``/``burst`` requests per second, and
    at most ``tenant_requests`` inference requests and ``tenant_cost_tokens`` tokens (times the
    stages they pass) in flight. A request has ``request_timeout_s`` (or its own ``timeout_s``)
    in all, one replica ``backend_timeout_s`` of it. ``principals``: the key cache (shared with
    whoever revokes keys). ``dashboard``: the document of the operator's pages at ``/ui``
    (:mod:`.dashboard`; no pages without it)."""
    app = FastAPI(title="dmsc gateway", version="1", docs_url=None, redoc_url=None)
    mount_docs(app)  # /docs from files of this package: FastAPI's loads them from a CDN
    calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="dmsc-backend")
    limiter = RateLimiter(rate, burst, clock)
    stages = max(1, backend.stage_count())
    admission = TenantAdmission(tenant_requests, float(tenant_cost_tokens * stages))
    route: Router = POLICIES[router]()
    breakers: dict[str, CircuitBreaker] = {}
    versions = ModelVersions(db)
    principals = principals or PrincipalCache(db)
    sessions = UiSessions() if dashboard is not None else None

    def breaker(replica: str) -> CircuitBreaker:
        return breakers.setdefault(
            replica, CircuitBreaker(breaker_threshold, breaker_reset_s, clock=clock)
        )

    reg = CollectorRegistry()
    requests = Counter(
        "dmsc_gateway_requests_total", "Requests", ["endpoint", "status"], registry=reg
    )
    latency = Histogram(
        "dmsc_gateway_latency_seconds", "Request latency", ["endpoint"], registry=reg
    )
    app.add_middleware(
        Guard,
        principals=principals,
        requests=requests,
        latency=latency,
        max_body_bytes=max_body_bytes,
        read_timeout_s=read_timeout_s,
        sessions=sessions,
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 with where and why, never the offending value: a NaN or a lone surrogate echoed
        back cannot be rendered as JSON (it was a 500)."""
        return JSONResponse({"detail": _safe_errors(exc.errors())}, status_code=422)

    @app.exception_handler(StorageError)
    async def storage(request: Request, exc: StorageError) -> JSONResponse:
        """The database cannot be used (read-only, full, gone): the service is unavailable, and
        the reason names the database, never a statement or a key's hash."""
        return JSONResponse({"detail": str(exc)}, status_code=503)

    def authorize(request: Request, scope: str) -> Principal:
        """The caller (found by the Guard, cache first, before the body was read) if its key
        has ``scope`` and it is within its rate limit. A plain call rather than a FastAPI
        dependency: resolving one took 15 of the 105 microseconds of an authenticated read."""
        who: Principal | None = request.scope.get("state", {}).get("principal")
        if who is None:
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        if not who.may(scope):
            raise HTTPException(403, f"this key lacks the {scope!r} scope")
        ok, retry = limiter.check(who.tenant, rate=who.rate, burst=who.burst)
        if not ok:
            raise HTTPException(429, "rate limit exceeded", headers={"Retry-After": str(retry)})
        return who

    if dashboard is not None and sessions is not None:
        mount_dashboard(app, dashboard, principals, sessions, authorize)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "replicas": len(backend.replicas())}

    # The hot reads first: routes are matched in order.
    @app.get("/v1/models", response_class=Response)
    async def models(request: Request) -> Response:
        """Every model version (id, run, step, sha256, status, canary_percent, task: the
        training task, shown to its own tenant only)."""
        who = authorize(request, "read")
        tenant = None if who.may("admin") else who.tenant
        return Response(await versions.json_for(tenant), media_type="application/json")

    @app.post("/v1/infer")
    async def infer(req: InferRequest, request: Request) -> dict[str, Any]:
        who = authorize(request, "infer")
        cost = float(req.tokens * stages)
        refused = admission.enter(who.tenant, cost)
        if refused is not None:
            raise HTTPException(429, refused, headers={"Retry-After": "1"})
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            return await _infer(req, who, gone)
        finally:
            gone.cancel()
            admission.leave(who.tenant, cost)

    async def _aggregated(
        req: InferRequest, who: Principal, gone: asyncio.Future[None], budget: float
    ) -> dict[str, Any]:
        """``aggregate``: the task heads of every replica at once, through the backend's own
        answer (the control plane's, as its Infer call: the same checks, the same words)."""
        answer = getattr(backend, "answer", None)
        if answer is None:
            raise HTTPException(422, NO_HEADS)
        cancel = threading.Event()
        timed = req.model_copy(update={"timeout_s": budget})
        fut = asyncio.wrap_future(calls.submit(answer, timed, cancel))
        done, _ = await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
        if fut not in done:  # nobody waits for the answer: stop computing it
            cancel.set()
            raise HTTPException(499, "the client closed the request")
        try:
            out = dict(fut.result())
        except TimeoutError as exc:
            raise HTTPException(504, str(exc)) from None
        except NoRoom as exc:
            raise HTTPException(503, f"no room for a new inference session ({exc})") from None
        except ValueError as exc:  # BadRequest: no heads to combine, none up
            raise HTTPException(422, str(exc)) from None
        out.pop("token_ids", None)
        return {"raced": None, "tenant": who.tenant, **out}

    async def _infer(
        req: InferRequest, who: Principal, gone: asyncio.Future[None]
    ) -> dict[str, Any]:
        budget = req.timeout_s or request_timeout_s
        if req.aggregate is not None:
            return await _aggregated(req, who, gone, budget)
        deadline = time.monotonic() + budget
        sampling = req.sampling()  # one seed for every replica that tries the request
        tried: set[str] = set()
        # Gray release: the version that serves this request (sticky per session), and the
        # replicas that serve that version.
        request_key = req.session or f"{who.tenant}/{time.perf_counter_ns()}"
        version = pick_version(await versions.get(), request_key)
        by_version = getattr(backend, "replicas_for_version", None)
        replicas = by_version(version.id if version else None) if by_version else backend.replicas()
        last_error = "no replica answered"
        full: dict[str, str] = {}  # replicas that refused for lack of room, and why
        while True:
            if time.monotonic() >= deadline:
                raise HTTPException(504, f"no answer within {budget:g} s ({last_error})")
            try:
                picks = [route.choose(replicas, key=req.session, exclude=tried)]
            except NoReplica:
                raise HTTPException(
                    503,
                    "no replica could serve the request "
                    f"(tried {', '.join(sorted(tried)) or 'none'})",
                ) from None
            tried.add(picks[0])
            if req.redundant:
                with contextlib.suppress(NoReplica):
                    picks.append(route.choose(replicas, exclude=tried))
                    tried.add(picks[-1])
            picks = [p for p in picks if breaker(p).allow()]
            if not picks:
                continue
            # One attempt's deadline: a replica that has not answered by then counts as failed
            # and the request fails over; the backend stops there itself, freeing the replica.
            until = min(time.monotonic() + backend_timeout_s, deadline)
            cancel = threading.Event()
            started = time.perf_counter()
            futures: dict[asyncio.Future[str], tuple[str, Future[str]]] = {}
            for p in picks:
                route.started(p)
                call = partial(
                    backend.infer_on,
                    p,
                    req.prompt,
                    req.tokens,
                    cancel=cancel,
                    tenant=who.tenant,
                    deadline=until,
                    sampling=sampling,
                )
                fut = calls.submit(call)
                futures[asyncio.wrap_future(fut)] = (p, fut)
            winner: tuple[str, str] | None = None
            pending, late = set(futures), set[asyncio.Future[str]]()
            while pending and winner is None:
                left = until - time.monotonic() + DEADLINE_GRACE_S
                done, _ = await asyncio.wait(
                    pending | {gone}, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:  # nobody waits for the answer: stop computing it
                    cancel.set()
                    for afut in pending:
                        futures[afut][1].add_done_callback(
                            partial(_finished_later, route, futures[afut][0])
                        )
                    raise HTTPException(499, "the client closed the request")
                finished = {f for f in pending if f in done}
                pending -= finished
                if not finished:
                    break
                for afut in finished:
                    p, dt = futures[afut][0], time.perf_counter() - started
                    exc = afut.exception()
                    if exc is None and winner is None:
                        winner = (p, afut.result())
                        route.finished(p, dt)
                        breaker(p).success()
                    elif exc is None:  # the slower copy also finished
                        route.finished(p, dt)
                    elif time.monotonic() >= until:  # stopped at the attempt's deadline
                        late.add(afut)
                    elif isinstance(exc, NoRoom):  # full, not failing: no breaker count
                        route.finished(p, dt, ok=False)
                        full[p] = str(exc)
                        last_error = f"replica {p} has no room: {exc}"
                    else:
                        route.finished(p, dt, ok=False)
                        breaker(p).failure()
                        last_error = f"replica {p} failed: {type(exc).__name__}: {exc}"
            cancel.set()  # whatever still runs stops at its next token
            out_of_time = time.monotonic() >= deadline
            for afut in pending | late:
                p, fut = futures[afut]
                if winner is None and not out_of_time:  # stuck, or too slow: fail over
                    breaker(p).failure()
                    last_error = f"replica {p} gave no answer within {backend_timeout_s:g} s"
                if fut.done():
                    route.finished(p, time.perf_counter() - started, ok=winner is not None)
                else:  # cancelled: count it done when it stops
                    fut.add_done_callback(partial(_finished_later, route, p))
            if winner is not None:
                return {
                    "text": winner[1],
                    "replica": winner[0],
                    "raced": picks if len(picks) > 1 else None,
                    "tenant": who.tenant,
                    "model_version": _served_version(winner[1], version),
                    "seed": sampling.seed,
                }
            if out_of_time:
                raise HTTPException(504, f"no answer within {budget:g} s ({last_error})")
            if len(tried) >= len(replicas):
                if full and set(full) == tried:  # every replica full: retry later
                    raise HTTPException(503, f"no room for a new inference session ({last_error})")
                raise HTTPException(502, last_error)

    mount_tasks(app, backend, db, queue, authorize)  # /v1/tasks, /v1/exceptions
    mount_alerts(app, db, authorize)  # /v1/alerts: the control loop's

    @app.get("/v1/services")
    def services(request: Request) -> list[dict[str, Any]]:
        authorize(request, "read")
        return backend.services()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
