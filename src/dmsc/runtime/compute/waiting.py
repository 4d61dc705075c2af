"""How a rank waits for its share of a collective on the CPU: awake for a while, then asleep.

A gloo collective's work is done by gloo's own threads; the rank that called it waits for
them. Blocked in ``work.wait()``, its core may go idle, and on a virtual machine an idle
virtual CPU is woken by its host's scheduler, not at once: on this project's 2-core VM
(Firecracker, HZ 250) a 4 KB all-reduce of two processes, one a core, took 3.7-4.0 ms when
each waited blocked and 0.2-0.6 ms when each waited yielding its core in a loop (a median over
15 rounds, each right after a barrier or a 16 ms sleep; unpinned, 0.8-3.5 against 0.6-0.7
ms; ``benchmarks/collective_wait.py``). A tensor-parallel step runs one such all-reduce after
each block's attention and MLP.

Used where a rank waits on a small, latency-bound collective with nothing of its own to compute
meanwhile: the tensor-parallel all-reduces (:mod:`.tp_ops`), sequence parallelism's gathers and
reduce-scatters, the expert-parallel all-to-alls and the tensor-parallel ranks' agreement on a
drawn token. With it ``benchmarks/parallel_modes.py``'s tp = 2 step took 89.8 ms against
107.3, ep = 2 100.5 against 113.2 and tp = 2 x ep = 2 159.6 against 192.0 (one run each,
minutes apart, 2026-12-04). ``dmsc calibrate`` times its all-reduce both ways, and the cost
model prices each kind of call with its own figures
(:meth:`dmsc.netmodel.comm.CommModel.awake_view`).

The step's wait for its data-parallel all-reduces after the backward
(:mod:`.dp_collective`) is awake too, for at most :data:`DP_SPIN_S`: it also waits for the
other replicas' backward, which can take tens of milliseconds, and blocked that long the
waiting replica's core goes idle, so the last bucket's data woke it late. On this machine a
replica that had waited longest left the all-reduce up to 5 ms after the one that came last
(2026-12-05). Measured side by side with the tree before (``benchmarks/parallel_modes.py
--only dp2-ring,dp4-ring --rounds 1``, three runs of each, alternated), the exposed exchange at
dp = 2 took 2.5-5.3 ms against 4.1-5.7 blocked, at dp = 4 (four workers on two cores)
7.9-14.7 against 14.0-18.4, and dp = 2 against ``DistributedDataParallel`` 1.009-1.140 of its
step (median of the nine pairs 1.016) against 1.021-1.243 (1.108); the steps themselves moved
less than the machine's noise. Only gloo's own all-reduce is waited so: the point-to-point
algorithms (tree, hierarchical, the int8 ring) run on Python threads, and a spinning thread on
a machine with fewer cores than runnable threads takes their turns (Linux's EEVDF scheduler may
pick a yielding thread again at once): the int8 ring's exposed exchange took 22-24 ms spun
against 12-13 blocked. The cost model prices the buckets so waited for, where each worker has a
core of its own, at the measured awake call (:data:`dmsc.netmodel.topology.SPUN_CALL`); where
the workers share cores, with the blocked figures.

So :func:`finish` looks whether the work is done and yields the core (``os.sched_yield``,
offering it to another runnable thread) until it is, for at most :data:`SPIN_S`, then
waits blocked as before: a wait longer than that (a late peer, a pipeline's bubble) costs at
most that much CPU more. A work of NCCL is not spun on: its ``wait`` only makes the current
CUDA stream wait, and spinning on it would hold the host until the device is done.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

SPIN_S = 0.004  # about the wake-up it saves (a tick at HZ 250), so it costs at most twice that
# the step's data-parallel wait (module docstring): the other replicas' lateness, at most this
DP_SPIN_S = 0.05


def awake_until(done: Callable[[], bool], spin_s: float = SPIN_S) -> bool:
    """Yield the core until ``done()`` holds, at most ``spin_s``; whether it holds."""
    end = time.perf_counter() + spin_s
    while not done():
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def finish(work: Any, spin_s: float = SPIN_S, cpu: bool = True) -> None:
    """Wait for the collective ``work`` (a ``torch.distributed`` work object) to complete:
    yielding the core while it runs, at most ``spin_s``, then blocked in ``work.wait()``,
    which also raises what the work raised. ``cpu`` False (a CUDA tensor's work) waits at
    once."""
    if cpu and spin_s > 0:
        awake_until(work.is_completed, spin_s)
    work.wait()


def sleep_until(deadline: float) -> None:
    """Sleep until ``deadline`` (``time.monotonic()``), not at all once it has passed (a thin
    link's turn that has come). ``time.sleep(0)`` is no free call: it gives the interpreter up,
    and took 77 us at the median alone on this project's 2-core VM and 5.2 ms beside a busy
    Python thread (the interpreter's switch interval; 2026-12-05). Every data-parallel exchange
    slept so on an unshaped link, on the step's path."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)
