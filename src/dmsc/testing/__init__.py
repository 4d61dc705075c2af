"""Rehearsals for tests and benchmarks, kept out of the library: nothing in ``dmsc`` imports
this package (an import contract in ``pyproject.toml`` says so).

- :mod:`.chaos` kills or freezes a stage worker while a deployment trains
  (:func:`~.chaos.train_under_fault`) or serves (:func:`~.chaos.serve_under_fault`) and measures
  the runtime's answer (:class:`~.chaos.FaultReport`);
- :mod:`.ray_local` starts a Ray cluster of several datacenter nodes on this machine and makes
  node faults on it (lost, partitioned); it reports with :mod:`.chaos`'s ``FaultReport``.

One direction: ``ray_local -> chaos -> dmsc.runtime``.
"""
