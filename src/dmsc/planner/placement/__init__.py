"""Network-aware placement: pipeline stages onto datacenters, stage boundaries onto paths.

One model of the problem (:mod:`.problem`, scored in integer microseconds), built from the specs
by :mod:`.from_specs`, and many solvers over it: the exact CP-SAT model (:mod:`.milp`), tabu
search (:mod:`.tabu`), baselines (:mod:`.baselines`) and the brute-force reference
(:mod:`.bruteforce`). :mod:`.instance_generator` makes seeded random problems for tests and the
optimality benchmark.

The solvers load on first use (PEP 562), so the problem's model loads without OR-Tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmsc._lazy import lazy_getattr

if TYPE_CHECKING:
    from dmsc.planner.placement.baselines import (
        solve_compute_first,
        solve_greedy,
        solve_random,
    )
    from dmsc.planner.placement.bruteforce import (
        pack_exactly,
        solve_bruteforce,
    )
    from dmsc.planner.placement.milp import (
        solve_milp,
    )
    from dmsc.planner.placement.tabu import (
        solve_tabu,
    )

_WHERE = {
    "pack_exactly": "dmsc.planner.placement.bruteforce",
    "solve_bruteforce": "dmsc.planner.placement.bruteforce",
    "solve_compute_first": "dmsc.planner.placement.baselines",
    "solve_greedy": "dmsc.planner.placement.baselines",
    "solve_milp": "dmsc.planner.placement.milp",
    "solve_random": "dmsc.planner.placement.baselines",
    "solve_tabu": "dmsc.planner.placement.tabu",
}


__getattr__ = lazy_getattr(_WHERE, globals())


__all__ = [
    "pack_exactly",
    "solve_bruteforce",
    "solve_compute_first",
    "solve_greedy",
    "solve_milp",
    "solve_random",
    "solve_tabu",
]
