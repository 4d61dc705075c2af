"""The worker process: READY on standard output, JSON log lines to its log file when named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from runtime_helpers import first_stage

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.worker import STAGE_SERVICE
from dmsc.runtime.transport.rpc import Client, serve
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")


def test_a_worker_with_a_log_file_logs_there_and_not_on_stderr(tmp_path: Path) -> None:
    reg = Registry(ttl_s=60)
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(reg))
    log_file = tmp_path / "logs" / "s0.log"
    cfg = first_stage(f"127.0.0.1:{reg_port}", log_file=str(log_file))
    path = tmp_path / "s0.json"
    path.write_text(json.dumps(asdict(cfg)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dmsc.runtime.compute.worker", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "READY" and reg.lookup(stage=0)[0].address == line[1]
        client = Client(line[1], STAGE_SERVICE)
        assert client.call("Abort", {"epoch": 1}) == {"epoch": 1}
        client.close()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
        reg_server.stop(0)
    assert proc.returncode == 0
    records = [json.loads(x) for x in log_file.read_text().splitlines()]
    assert {"msg": "moved to epoch 1", "sid": "s0", "level": "info"}.items() <= records[-1].items()
    assert "moved to epoch" not in stderr


def test_a_worker_knows_when_the_process_that_launched_it_is_gone() -> None:
    from dmsc.runtime.compute.worker import owner_gone

    assert not owner_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert owner_gone(child.pid)  # exited, not reaped yet: a zombie is gone
    child.wait()
    assert owner_gone(child.pid)  # reaped: no such process
    assert not owner_gone(0)  # 0: its parent, which is alive
