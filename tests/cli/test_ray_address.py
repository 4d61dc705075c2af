"""``dmsc up --ray-address``: a head's HOST:PORT or nothing (issue 29, point 8). ``auto`` joins
whichever Ray cluster this machine last started, on a shared machine maybe another user's."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import dmsc, make_plan


@pytest.mark.parametrize("address", ["auto", "127.0.0.1", "head:port"])
def test_up_refuses_a_ray_address_that_is_not_a_heads_host_and_port(
    tmp_path: Path, address: str
) -> None:
    plan = make_plan(tmp_path)
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--launcher", "ray", "--ray-address", address)
    assert res.returncode == 2, res.stderr
    assert "--ray-address" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "control.json").exists()
