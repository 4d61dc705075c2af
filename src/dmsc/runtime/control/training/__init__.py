"""A training task on a deployment: its session, its data, its size and its checkpoints.

- :mod:`.params`: a task's parameters (:class:`~.params.TrainParams`), its request resolved
  against the plan once, when it is submitted;
- :mod:`.corpora`: a task's text: inside the control plane's data roots, read once;
- :mod:`.session`: the training session (steps, validation, checkpoints, recovery, metrics);
- :mod:`.placement`: where a plan's stage replicas run (their devices and cores), read of the
  plan alone;
- :mod:`.report`: what a session reports, its steps cut in segments of one dp each;
- :mod:`.resize`: the task's data-parallel degree grown or shrunk between checkpoints;
- :mod:`.shrink`: the replicas a lost node took, dropped when no node has room for them;
- :mod:`.online`: the cluster spec cut down to the devices online, for the shrink's re-plan;
- :mod:`.restart`: a layout started again at the largest dp that starts (the shrink's fallback);
- :mod:`.local_data`: each datacenter's replicas train on their own shard of the task's files;
- :mod:`.lr_schedule`: the learning rate of each step;
- :mod:`.retention`: how many checkpoints a task keeps and how many bytes a tenant's may take;
- :mod:`.residency`: the cluster's residency rules on a task (where its data is read, where its
  checkpoints are stored) and on a move of the deployment;
- :mod:`.recalibration`: after a task, its traces refit the cluster spec its plan was made for.

Imports run one way: ``shrink -> restart``, ``shrink, online -> resize -> session ->
params, placement, report, lr_schedule, retention``, ``local_data -> params`` and ``recalibration ->
report, params``; ``corpora``, ``report``, ``params``,
``placement``, ``lr_schedule``, ``retention`` and ``residency`` import none of the others.
Below this package only :mod:`..launch`; it never imports :mod:`..serving` (nor serving this
one).
"""
