"""The API gateway: one HTTP entry for clients (FastAPI; OpenAPI at ``/docs``).

Per request: authentication (API key -> tenant and scopes), the tenant's rate limit (429 with
Retry-After), the body size limit (413), then the endpoint. Inference goes through the service
router to a pipeline replica under a circuit breaker per replica, failing over to another
replica when one fails or misses its deadline (``redundant``: two replicas at once, the first
answer wins and the other is cancelled); training and other long work goes into the persistent
task queue. Prometheus metrics at ``/metrics``.
"""

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from dmsc.data.db import Database, TaskRecord
from dmsc.runtime.business.auth import Principal, authenticate
from dmsc.runtime.business.protection import CircuitBreaker, RateLimiter
from dmsc.runtime.business.router import POLICIES, NoReplica, Router, pick_version
from dmsc.runtime.transport.messages import GatewayInferRequest as InferRequest
from dmsc.runtime.transport.messages import GatewayTaskRequest as TaskRequest


class Backend(Protocol):
    """What the gateway serves from: pipeline replicas that answer inference."""

    def replicas(self) -> list[str]: ...

    def infer_on(
        self, replica: str, prompt: str, tokens: int, cancel: threading.Event | None = None
    ) -> str: ...

    def services(self) -> list[dict[str, Any]]: ...


class TaskQueue(Protocol):
    """Where the gateway puts long work: the control plane's persistent task queue
    (:class:`dmsc.runtime.control.task_queue.TaskQueue`)."""

    def submit(
        self,
        kind: str,
        params: dict[str, Any],
        tenant: str = "default",
        priority: int = 0,
        weight: float = 1.0,
        lane: str = "sync",
        max_attempts: int = 3,
    ) -> TaskRecord: ...

    def requeue(self, task_id: int) -> None: ...

    def exceptions(self) -> list[TaskRecord]: ...


def _task_json(t: TaskRecord) -> dict[str, Any]:
    return {
        "id": t.id,
        "kind": t.kind,
        "state": t.state,
        "tenant": t.tenant,
        "priority": t.priority,
        "attempts": t.attempts,
        "error": t.error,
        "exception_type": t.exception_type,
    }


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


def _finished_later(route: Router, replica: str, _fut: Future[str]) -> None:
    route.finished(replica, 0.0)


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
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    app = FastAPI(title="dmsc gateway", version="1")
    calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="dmsc-backend")
    limiter = RateLimiter(rate, burst, clock)
    route: Router = POLICIES[router]()
    breakers: dict[str, CircuitBreaker] = {}

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

    @app.middleware("http")
    async def limits(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        t0 = time.perf_counter()
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            response: Response = JSONResponse(
                {"detail": f"body over {max_body_bytes} bytes"}, status_code=413
            )
        else:
            response = await call_next(request)
        # The route's template, never the raw path: a label per unknown URL would let anyone grow
        # /metrics without bound.
        found = request.scope.get("route")
        path = getattr(found, "path", None) or "<unmatched>"
        requests.labels(path, str(response.status_code)).inc()
        latency.labels(path).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 with where and why, never the offending value: a NaN or a lone surrogate echoed
        back cannot be rendered as JSON (it was a 500)."""
        return JSONResponse({"detail": _safe_errors(exc.errors())}, status_code=422)

    def principal(scope: str) -> Callable[[Request], Principal]:
        def check(request: Request) -> Principal:
            who = authenticate(db, request.headers.get("authorization"))
            if who is None:
                raise HTTPException(
                    401,
                    "missing, unknown or revoked API key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if not who.may(scope):
                raise HTTPException(403, f"this key lacks the {scope!r} scope")
            ok, retry = limiter.check(who.tenant)
            if not ok:
                raise HTTPException(429, "rate limit exceeded", headers={"Retry-After": str(retry)})
            return who

        return check

    TaskId = Annotated[int, PathParam(ge=1, le=2**62, description="Task id")]
    InferWho = Annotated[Principal, Depends(principal("infer"))]
    SubmitWho = Annotated[Principal, Depends(principal("submit"))]
    ReadWho = Annotated[Principal, Depends(principal("read"))]

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "replicas": len(backend.replicas())}

    @app.post("/v1/infer")
    def infer(req: InferRequest, who: InferWho) -> dict[str, Any]:
        tried: set[str] = set()
        # Gray release: the version that serves this request (sticky per session), and the
        # replicas that serve that version.
        request_key = req.session or f"{who.tenant}/{time.perf_counter_ns()}"
        version = pick_version(db.model_versions(), request_key)
        by_version = getattr(backend, "replicas_for_version", None)
        replicas = by_version(version.id if version else None) if by_version else backend.replicas()
        last_error = "no replica answered"
        while True:
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
            cancel = threading.Event()
            started = time.perf_counter()
            # A per-backend deadline: a stuck replica counts as failed (its call is left to
            # finish in the background) and the request fails over.
            futures: dict[Future[str], str] = {}
            for p in picks:
                route.started(p)
                if req.redundant:
                    fut = calls.submit(backend.infer_on, p, req.prompt, req.tokens, cancel)
                else:
                    fut = calls.submit(backend.infer_on, p, req.prompt, req.tokens)
                futures[fut] = p
            winner: tuple[str, str] | None = None
            pending = set(futures)
            deadline = time.monotonic() + backend_timeout_s
            while pending and winner is None:
                left = deadline - time.monotonic()
                done, pending = wait(pending, timeout=max(0.0, left), return_when=FIRST_COMPLETED)
                if not done:
                    break
                for fut in done:
                    p, dt = futures[fut], time.perf_counter() - started
                    exc = fut.exception()
                    if exc is None and winner is None:
                        winner = (p, fut.result())
                        route.finished(p, dt)
                        breaker(p).success()
                    elif exc is None:  # the slower copy also finished
                        route.finished(p, dt)
                    else:
                        route.finished(p, dt, ok=False)
                        breaker(p).failure()
                        last_error = f"replica {p} failed: {type(exc).__name__}: {exc}"
            cancel.set()  # the slower copy stops at its next token
            for fut in pending:
                p = futures[fut]
                if winner is None:  # past the deadline
                    route.finished(p, time.perf_counter() - started, ok=False)
                    breaker(p).failure()
                    last_error = f"replica {p} failed: no answer within {backend_timeout_s:g} s"
                else:  # cancelled: count it done when it stops
                    fut.add_done_callback(partial(_finished_later, route, p))
            if winner is not None:
                return {
                    "text": winner[1],
                    "replica": winner[0],
                    "raced": picks if len(picks) > 1 else None,
                    "tenant": who.tenant,
                    "model_version": version.id if version else None,
                }
            if len(tried) >= len(replicas):
                raise HTTPException(502, last_error)

    @app.post("/v1/tasks", status_code=202)
    def submit(req: TaskRequest, who: SubmitWho) -> dict[str, Any]:
        params = req.model_dump(include={"steps", "checkpoint_every", "late_policy", "grad_wait_s"})
        task = queue.submit(
            "train", params, tenant=who.tenant, priority=req.priority, lane=req.lane
        )
        return _task_json(task)

    def _own_task(task_id: int, who: Principal) -> TaskRecord:
        with db.sessions() as s:
            task = s.get(TaskRecord, task_id)
        if task is None or (task.tenant != who.tenant and not who.may("admin")):
            raise HTTPException(404, f"no task {task_id}")
        return task

    @app.get("/v1/tasks/{task_id}")
    def get_task(task_id: TaskId, who: ReadWho) -> dict[str, Any]:
        return _task_json(_own_task(task_id, who))

    @app.delete("/v1/tasks/{task_id}")
    def cancel(task_id: TaskId, who: SubmitWho) -> dict[str, Any]:
        task = _own_task(task_id, who)
        if task.state != "queued":
            raise HTTPException(409, f"task {task_id} is {task.state}, only queued tasks cancel")
        db.set_task_state(task_id, "cancelled")
        return {"id": task_id, "state": "cancelled"}

    AdminWho = Annotated[Principal, Depends(principal("admin"))]

    @app.post("/v1/tasks/{task_id}/requeue")
    def requeue(task_id: TaskId, who: AdminWho) -> dict[str, Any]:
        try:
            queue.requeue(task_id)
        except KeyError as exc:
            raise HTTPException(409, str(exc).strip("'")) from None
        return {"id": task_id, "state": "queued"}

    @app.get("/v1/exceptions")
    def exceptions(who: ReadWho) -> list[dict[str, Any]]:
        return [
            {**_task_json(t), "log_excerpt": t.log_excerpt}
            for t in queue.exceptions()
            if t.tenant == who.tenant or who.may("admin")
        ]

    @app.get("/v1/models")
    def models(who: ReadWho) -> list[dict[str, Any]]:
        return [
            {
                "id": v.id,
                "run": v.run_id,
                "step": v.step,
                "sha256": v.sha256,
                "status": v.status,
                "canary_percent": v.canary_percent,
            }
            for v in db.model_versions()
        ]

    @app.get("/v1/services")
    def services(who: ReadWho) -> list[dict[str, Any]]:
        return backend.services()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
