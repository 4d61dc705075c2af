"""Network-aware placement: pipeline stages onto datacenters, stage boundaries onto paths.

One model of the problem (:mod:`.problem`, scored in integer microseconds), built from the specs
by :mod:`.from_specs`, and many solvers over it: the exact CP-SAT model (:mod:`.milp`), tabu
search (:mod:`.tabu`), baselines (:mod:`.baselines`) and the brute-force reference
(:mod:`.bruteforce`). :mod:`.instance_generator` makes seeded random problems for tests and the
optimality benchmark.
"""

from dmsc.planner.placement.baselines import solve_compute_first, solve_greedy, solve_random
from dmsc.planner.placement.bruteforce import pack_exactly, solve_bruteforce
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.tabu import solve_tabu

__all__ = [
    "pack_exactly",
    "solve_bruteforce",
    "solve_compute_first",
    "solve_greedy",
    "solve_milp",
    "solve_random",
    "solve_tabu",
]
