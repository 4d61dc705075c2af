"""A checkpoint save that meets a failed worker: the other workers' saves are waited for (none
writes into the folder after it goes), the failed worker's is not (a frozen worker never
answers: waiting held the recovery for the save's whole 120 s deadline)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.staging import save_checkpoint


class _Frozen:
    """Two stages; stage 1's worker is frozen: its Save never answers, and the deployment's
    watch reports it failed."""

    def __init__(self) -> None:
        self.layout: Any = SimpleNamespace(ep=1)  # replica 0 of each stage saves
        self.futures: dict[tuple[int, int], Future[str]] = {}

    @property
    def stages(self) -> int:
        return 2

    def calls(self, method: str, message: Any, keys: Any, t: float) -> dict[Any, Any]:
        assert method == "Save"
        (key,) = keys
        fut: Future[str] = Future()
        if key == (0, 0):
            fut.set_result('{"path": "x", "tensors": []}')
        self.futures[key] = fut
        return {key: fut}

    def gather(self, futures: dict[Any, Any], deadline_s: float) -> dict[Any, Any]:
        raise WorkerFailure({(1, 0): "silent (frozen)"}, {})


def test_a_save_does_not_wait_for_the_worker_that_failed(tmp_path: Path) -> None:
    dep = _Frozen()
    raised: list[BaseException] = []

    def save() -> None:
        try:
            save_checkpoint(dep, 4, tmp_path / "step4")  # type: ignore[arg-type]
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(5.0)
    assert not worker.is_alive(), "the save waited for the frozen worker's answer"
    assert isinstance(raised[0], WorkerFailure)
    assert dep.futures[(1, 0)].cancelled()  # its call is given up, not left to its deadline
    assert list(tmp_path.iterdir()) == []  # the partial folder is gone
    with pytest.raises(WorkerFailure):
        raise raised[0]
