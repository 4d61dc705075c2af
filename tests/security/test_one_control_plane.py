"""Two ``dmsc up`` on one home at the same moment (issue 11, item 6): one control plane runs,
the other refuses with the reason, and the survivor's workers are the only ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import ROOT, dmsc, make_plan

pytestmark = pytest.mark.integration


def test_two_ups_at_once_start_one_control_plane(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    env = {**os.environ, "DMSC_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "dmsc", "up", "--plan", str(plan)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        results = [(p.wait(timeout=180), p.stderr.read().decode()) for p in procs if p.stderr]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 2], results
        refused = next(err for code, err in results if code == 2)
        assert "another control plane runs" in refused or "already running" in refused
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert len(status["services"]) == 2
        assert all(s["health"] == "ok" for s in status["services"])
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
