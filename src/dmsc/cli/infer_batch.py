"""``dmsc infer --batch FILE``: a JSON-lines file of inference requests (each line the request
``dmsc infer`` and the gateway's ``/v1/infer`` take, at least a ``prompt``) queued as one task of
kind ``infer`` (:mod:`dmsc.runtime.control.tasks.infer_batch`), waited for, and its answers
printed in order when it ends. Every line is checked before anything is queued: a bad one names
the file, the line and the field (exit 2). Ctrl-C cancels the call, and the control plane
cancels the task with it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import grpc
import typer
from pydantic import ValidationError

from dmsc.cli.app import err_console
from dmsc.cli.options import message_from_flags
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import MAX_BATCH_REQUESTS, InferBatch, InferRequest
from dmsc.spec import SpecError
from dmsc.spec.errors import spec_error_from_validation

POLL_S = 0.2


def read_batch(path: Path) -> tuple[list[InferRequest], list[int]]:
    """The requests of a JSON-lines file (blank lines skipped) and the line each came from;
    a SpecError names the file, the line and the field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), "", f"cannot read it: {exc}") from None
    requests, lines = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(str(path), f"line {n}", f"not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise SpecError(str(path), f"line {n}", "a request is a JSON object")
        try:
            requests.append(InferRequest.model_validate(obj))
        except ValidationError as exc:
            err = spec_error_from_validation(str(path), exc, model=InferRequest)
            raise SpecError(str(path), f"line {n}: {err.field or 'request'}", err.reason) from None
        lines.append(n)
    if not requests:
        raise SpecError(str(path), "", "no request in it (one JSON object per line)")
    if len(requests) > MAX_BATCH_REQUESTS:
        why = f"{len(requests)} requests: at most {MAX_BATCH_REQUESTS} in one batch"
        raise SpecError(str(path), "", why)
    return requests, lines


def run_batch(path: Path, priority: int, lane: str, as_json: bool) -> None:
    """Queue the file's requests as one task, wait for its end and print the answers."""
    requests, lines = read_batch(path)
    batch = message_from_flags(InferBatch, {}, requests=requests, priority=priority, lane=lane)
    future = control_client().rpc.send_future("InferBatch", batch)
    try:
        while not future.done():
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        future.cancel()
        err_console.print(
            "stopped: the InferBatch call is cancelled and the control plane cancels its task "
            "with it (dmsc tasks list shows it)",
            highlight=False,
        )
        raise typer.Exit(130) from None
    try:
        reply = json.loads(future.result())
    except grpc.RpcError as exc:
        _refused(exc, path, lines)
        raise
    _print(reply, lines, as_json)


def _refused(exc: grpc.RpcError, path: Path, lines: list[int]) -> None:
    """A request the control plane cannot serve (``requests.N.field: reason``): the file, line
    and field, exit 2."""
    said = str(exc.details() or "")
    found = re.match(r"requests\.(\d+)\.(\w+): (.*)", said, re.S)
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and found:
        i, field, why = int(found[1]), found[2], found[3]
        raise SpecError(str(path), f"line {lines[i]}: {field}", why) from None


def one_line(text: str) -> str:
    """An answer's text on one line: escaped as inside a JSON string (``\\n``, ``\\r``, ...)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _print(reply: dict[str, Any], lines: list[int], as_json: bool) -> None:
    answers: list[dict[str, Any]] = reply["answers"]
    for line, answer in zip(lines, answers, strict=False):
        if as_json:
            print(json.dumps({"task": reply["task"], "line": line, **answer}), flush=True)
        elif "error" in answer:
            err_console.print(f"line {line}: {answer['error']}", highlight=False, markup=False)
        else:
            print(one_line(answer["text"]), flush=True)
    if reply["state"] != "done" or len(answers) < len(lines):
        err_console.print(
            f"task {reply['task']} {reply['state']}: {len(answers)} of {len(lines)} answered",
            highlight=False,
        )
