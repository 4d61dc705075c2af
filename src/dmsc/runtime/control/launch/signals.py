"""``dmsc chaos`` on a running control plane: the signal sent to a stage worker's process.

The rehearsals that measure the runtime's answer (:mod:`dmsc.testing.chaos`) send the same
signals (:data:`SIGNALS`).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.transport.rpc import BadRequest

SIGNALS: dict[str, signal.Signals] = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


def signal_worker(dep: Deployment, sid: str, fault: str) -> dict[str, Any]:
    """``dmsc chaos`` on a running control plane: ``kill`` or ``freeze`` the serving worker
    ``sid``, or ``thaw`` every frozen instance of it (the one serving, or one already replaced
    and fenced). BadRequest when no worker has that SID."""
    serving = [h for h in dep.handles if h.config.sid == sid]
    targets = (
        serving
        if fault != "thaw"
        else [*serving, *(h for h in dep.abandoned if h.config.sid == sid)]
    )
    if not targets:
        raise BadRequest(f"sid: no worker {sid!r} in this deployment")
    sig = signal.SIGCONT if fault == "thaw" else SIGNALS[fault]
    for h in targets:
        h.process.send_signal(sig)
    return {"sid": sid, "fault": fault, "pids": [h.process.pid for h in targets], "at": time.time()}
