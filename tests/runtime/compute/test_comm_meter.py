"""The per-mode communication meter and the accounting of a step's bytes by mode."""

from __future__ import annotations

import threading
import time

import pytest

from dmsc.runtime.compute.comm_meter import (
    MAX_WALLS,
    CommMeter,
    group_exposed,
    replicas_exposed,
    ring_allreduce_bytes,
    split_sent,
    step_comm,
    with_commit,
    without_walls,
)


def test_meter_adds_by_mode_and_take_starts_afresh() -> None:
    meter = CommMeter()
    meter.add("tp", 0.25, 100)
    meter.add("tp", 0.5, 50)
    meter.add("ep", 1.0, 8)
    assert meter.take() == {
        "tp": {"s": 0.75, "bytes": 150, "calls": 2},
        "ep": {"s": 1.0, "bytes": 8, "calls": 1},
    }
    assert meter.take() == {}


def test_timed_counts_a_block_that_raises() -> None:
    meter = CommMeter()
    with pytest.raises(RuntimeError), meter.timed("dp", 4):
        raise RuntimeError("a failed all-reduce")
    got = meter.take()["dp"]
    assert got["calls"] == 1 and got["bytes"] == 4 and got["s"] >= 0.0


def test_timed_keeps_the_wall_clock_of_the_first_entry_and_the_last_exit() -> None:
    """The replicas of a stage are compared on these (dmsc.data.comm_modes.exposed_wait)."""
    meter = CommMeter()
    before = time.time()
    with meter.timed("dp"):
        time.sleep(0.01)
    with meter.timed("dp"):
        time.sleep(0.01)
    after = time.time()
    meter.add("tp", 0.5)  # counted without a wall clock: none kept
    got = meter.take()
    dp = got["dp"]
    assert before <= dp["t0"] < dp["t0"] + 0.02 <= dp["t1"] <= after
    assert dp["t1"] - dp["t0"] >= dp["s"] - 1e-6 and "t0" not in got["tp"]
    assert "t0" not in meter.take().get("dp", {})


def test_each_tensor_parallel_call_keeps_its_walls_up_to_a_bound() -> None:
    meter = CommMeter()
    for _ in range(3):
        with meter.timed("tp"):
            pass
    with meter.timed("dp"):
        pass
    got = meter.take()
    assert len(got["tp"]["walls"]) == 3 and "walls" not in got["dp"]
    assert all(a <= b for a, b in got["tp"]["walls"])
    for _ in range(MAX_WALLS + 1):  # a serving worker's meter, taken rarely: none kept past it
        meter.add("tp", 0.0, 0, (1.0, 1.0))
    assert "walls" not in meter.take()["tp"]
    meter.add("tp", 0.1, 0, (1.0, 1.1))
    meter.add("tp", 0.1)  # one call without its wall clock: the calls no longer pair up
    assert "walls" not in meter.take()["tp"]


def test_a_groups_exposed_time_runs_call_by_call_from_the_last_entry_to_the_last_exit() -> None:
    """Rank 0 reached the first call 5 ms early (its partner's compute) and the second 1 ms
    late: the group's exposure is 2 + 3 ms where rank 0 waited 7 + 3."""
    rank0 = {"s": 0.010, "bytes": 8, "calls": 2, "walls": [[0.0, 0.007], [0.021, 0.024]]}
    rank1 = {"s": 0.008, "bytes": 8, "calls": 2, "walls": [[0.005, 0.007], [0.020, 0.024]]}
    got = group_exposed([rank0, rank1])
    assert got["s"] == pytest.approx(0.005) and got["wait_s"] == 0.010
    assert got["bytes"] == 8 and "walls" not in got
    # clocks apart: each call kept between the least and the most wait
    skewed = dict(rank1, walls=[[0.009, 0.011], [0.030, 0.031]])
    assert group_exposed([rank0, skewed])["s"] == pytest.approx(0.002 + 0.001)
    # calls that do not pair up: rank 0's own wait
    assert group_exposed([rank0, dict(rank1, walls=[[0.0, 0.1]])])["s"] == 0.010
    assert group_exposed([rank0, {"s": 0.008}])["s"] == 0.010
    assert group_exposed([rank0]) == {k: v for k, v in rank0.items() if k != "walls"}
    assert without_walls({"tp": rank0, "pp": {"s": 1.0}}) == {
        "tp": {"s": 0.010, "bytes": 8, "calls": 2},
        "pp": {"s": 1.0},
    }


def test_a_commits_exchange_widens_the_steps_wall_clock_span() -> None:
    step = {"dp": {"s": 0.1, "bytes": 1, "calls": 1, "t0": 10.0, "t1": 10.1}}
    commit = {"dp": {"s": 0.2, "bytes": 2, "calls": 1, "t0": 10.5, "t1": 10.7}}
    got = with_commit(step, commit)["dp"]
    assert got == {"s": pytest.approx(0.3), "bytes": 3, "calls": 2, "t0": 10.0, "t1": 10.7}
    assert with_commit({}, commit)["dp"]["t0"] == 10.5


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="'sp' is not one of tp, dp, ep, pp"):
        CommMeter().add("sp", 1.0)


def test_threads_add_without_losing_counts() -> None:
    meter = CommMeter()

    def work() -> None:
        for _ in range(1000):
            meter.add("dp", 0.001, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = meter.take()["dp"]
    assert got["calls"] == 4000 and got["bytes"] == 4000
    assert got["s"] == pytest.approx(4.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_bytes_equal_a_simulated_ring(n: int) -> None:
    # reference: count the chunks one member sends in a ring's reduce-scatter and all-gather
    numel, size = 1200, 4
    chunk = numel // n
    sent = sum(chunk for _ in range(n - 1)) * 2 * size if n > 1 else 0
    assert ring_allreduce_bytes(numel, size, n) == sent


def test_sent_bytes_split_between_pipeline_and_data_parallel() -> None:
    # stage 1, replica 0: to stage 2 (pp), from its ring to replica 1 (dp), and to itself
    sent = {"2/0": 300, "0/0": 200, "1/1": 1000, "1/0": 7}
    got = split_sent(1, 0, sent)
    assert got == {
        "pp": {"bytes": 500, "links": {"2/0": 300, "0/0": 200}},
        "dp": {"bytes": 1000, "links": {"1/1": 1000}},
    }


def test_step_comm_takes_pp_and_dp_bytes_from_the_peers() -> None:
    taken = {"pp": {"s": 0.2, "bytes": 0, "calls": 3}, "tp": {"s": 0.1, "bytes": 64, "calls": 4}}
    got = step_comm(taken, 0, 0, {"1/0": 80, "0/1": 40})
    assert got["pp"] == {"s": 0.2, "bytes": 80, "calls": 3, "links": {"1/0": 80}}
    assert got["tp"] == {"s": 0.1, "bytes": 64, "calls": 4}
    # dp bytes without a timed wait (a replica whose exchange was all hidden): zero seconds
    assert got["dp"] == {"s": 0.0, "calls": 0, "bytes": 40, "links": {"0/1": 40}}


def test_expert_parallel_calls_are_put_together_over_each_group_of_replicas() -> None:
    """Two groups of two replicas (ep = 2 at dp = 4) in one stage: in group (0, 1) replica 0
    came 3 ms late to the one call, in group (2, 3) replica 3 came 1 ms late; a group whose
    member has no walls keeps its own waits (without walls)."""
    ep = {
        (0, 0): {"ep": {"s": 0.002, "calls": 1, "walls": [[0.003, 0.005]]}},
        (0, 1): {"ep": {"s": 0.005, "calls": 1, "walls": [[0.0, 0.005]]}},
        (0, 2): {"ep": {"s": 0.003, "calls": 1, "walls": [[0.0, 0.003]]}},
        (0, 3): {"ep": {"s": 0.002, "calls": 1, "walls": [[0.001, 0.003]]}, "pp": {"s": 1.0}},
    }
    got = replicas_exposed(ep, "ep", [(0, 1), (2, 3)])
    assert [got[(0, r)]["ep"]["s"] for r in range(4)] == pytest.approx([0.002, 0.002, 0.002, 0.002])
    assert [got[(0, r)]["ep"]["wait_s"] for r in range(4)] == [0.002, 0.005, 0.003, 0.002]
    assert got[(0, 3)]["pp"] == {"s": 1.0} and "walls" not in got[(0, 0)]["ep"]
    ep[(0, 3)] = {"ep": {"s": 0.002, "calls": 1}}
    got = replicas_exposed(ep, "ep", [(0, 1), (2, 3)])
    assert got[(0, 2)]["ep"] == {"s": 0.003, "calls": 1} and "wait_s" not in got[(0, 3)]["ep"]


def test_a_mixtures_routed_and_received_tokens_ride_with_the_expert_parallel_figure() -> None:
    meter = CommMeter()
    meter.count_tokens(256, 300)
    meter.count_tokens(256, 212)
    assert meter.take() == {}  # no expert-parallel exchange timed: nothing to carry them
    meter.count_tokens(256, 300)
    meter.add("ep", 0.01, 64)
    got = meter.take()["ep"]
    assert (got["routed"], got["received"], got["tokens"]) == (256, 300, [[256, 300]])
    meter.add("ep", 0.01, 64)
    assert "routed" not in meter.take()["ep"]  # taken: a fresh start


def test_a_groups_busiest_rank_is_put_together_mixture_by_mixture_and_the_calls_not_kept() -> None:
    """Each mixture waits for the member that received most: ``busiest`` is the sum over the
    calls of that most (by hand: 140 + 150), the same on every member; a group whose members
    did not keep their calls gets the most any received in all; the trace drops the calls."""
    from dmsc.runtime.compute.comm_meter import group_routing, without_walls

    def ep(tokens: list[list[int]] | None) -> dict:
        fig = {"s": 0.01, "calls": 2, "routed": 200, "received": sum(t[1] for t in tokens or [])}
        return {"ep": fig | ({"tokens": tokens} if tokens else {})}

    comm = {
        (0, 0): ep([[100, 140], [100, 50]]),
        (0, 1): ep([[100, 60], [100, 150]]),
        (0, 2): ep([[100, 100], [100, 90]]),
        (0, 3): {"ep": {"s": 0.01, "calls": 2, "routed": 200, "received": 210}},  # no calls
    }
    got = group_routing(comm, [[0, 1], [2, 3]])
    assert got[(0, 0)]["ep"]["busiest"] == got[(0, 1)]["ep"]["busiest"] == 290
    assert got[(0, 2)]["ep"]["busiest"] == got[(0, 3)]["ep"]["busiest"] == 210
    assert "busiest" not in comm[(0, 0)]["ep"]  # the figures given are left as they were
    kept = without_walls(got[(0, 0)])
    assert "tokens" not in kept["ep"] and kept["ep"]["busiest"] == 290
