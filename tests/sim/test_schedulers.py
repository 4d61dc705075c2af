"""The joint scheduler's figures on the example scenario, pinned: recorded before its placement
search was made faster (ranked route options, a path's busy units computed once, states scored
once per search), which must not change a single number."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dmsc.sim import OpticalNetwork, build_profiles, load_scenario, run

SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "nsfnet-cba.yaml"

# load: (blocked, blocked for GPUs, transfer requests, events, jobs measured,
#        sum of iteration times, spectrum utilisation, GPU utilisation, digest of the times)
PINNED = {
    1.0: (20, 20, 73, 379, 160, 487.90289236110493, 0.0030902147081798836, 0.3096362414251231,
          "5dca5574cfc192df"),
    2.0: (50, 50, 49, 349, 130, 434.08998117525545, 0.004075691973910826, 0.4873606698065835,
          "b803be3919869479"),
}  # fmt: skip


@pytest.mark.parametrize("load", sorted(PINNED))
def test_joint_scheduler_figures_are_unchanged(load: float) -> None:
    scenario, cluster = load_scenario(SCENARIO)
    # pinned before the job's attention kernel existed: standard attention, as then
    jobs = [jt.model_copy(update={"attention": "standard"}) for jt in scenario.jobs]
    profiles = build_profiles(cluster, jobs)
    r = run(
        scenario,
        profiles,
        lambda: OpticalNetwork.from_cluster(cluster, scenario.k_paths),
        "joint",
        load,
        seed=4,
        arrivals=200,
    )
    times = r.iteration_times
    digest = hashlib.sha256(",".join(f"{x:.9e}" for x in times).encode()).hexdigest()[:16]
    blocked, gpu, requests, events, jobs, total, spectrum, gpus, pinned_digest = PINNED[load]
    assert (r.blocked, r.blocked_gpu, r.transfer_requests, r.transfer_blocked, r.events) == (
        blocked,
        gpu,
        requests,
        0,
        events,
    )
    assert len(times) == jobs and digest == pinned_digest
    assert sum(times) == pytest.approx(total, rel=1e-12)
    assert r.spectrum_utilization == pytest.approx(spectrum, rel=1e-12)
    assert r.gpu_utilization == pytest.approx(gpus, rel=1e-12)
