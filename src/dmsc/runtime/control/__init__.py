"""The control layer as it runs: the control plane's dispatch at the top, a package a concept
below it.

At the top, the control plane and the process around it:

- :mod:`.plane`: the :class:`~.plane.ControlPlane` and its ``dmsc.Control`` service (it
  dispatches every call to the packages below); :mod:`.service` is that service's method table,
  each RPC with its request and reply models, and :mod:`.client` its typed client (the CLI's
  one way to a running control plane); :mod:`.daemon` is the process ``dmsc up`` starts;
  :mod:`.watchdog` repairs failed workers between tasks; :mod:`.db_watch` stops the plane when
  its database file goes; :mod:`.replanning` is ``dmsc replan`` against it; :mod:`.status` and
  :mod:`.dashboard_state` are what ``dmsc status`` and the dashboard show.

The packages, each named with its modules in its own docstring:

- :mod:`.loop`: the control loop of ``dmsc up --control-interval``: every tick a snapshot, the
  modules and the user's objectives run on it, decisions applied or proposed, alerts raised;
- :mod:`.advisors`: the functional modules (traffic, paths, policy), the orchestrator's decision
  rule, and the prediction measurements are compared with;
- :mod:`.tasks`: the persistent task queue and the loop over queued training tasks;
- :mod:`.training`: a training session, its resize, shards, learning-rate schedule, retention;
- :mod:`.serving`: replicas, model versions, task heads, streaming and autoscaling;
- :mod:`.launch`: a deployment and its workers (local or on Ray), checkpoints, recovery.

Imports run one way: ``daemon -> watchdog -> plane -> service -> replanning, dashboard_state ->
status`` at the top (``db_watch`` and ``client`` import none of them), the top over the
packages, and among them ``loop -> advisors -> tasks -> training | serving -> launch`` (training and
serving never import each other). No package imports a module at the top; an import contract
in ``pyproject.toml`` keeps these layers.

The rehearsals of failures and the local multi-node Ray clusters of the tests are not here:
:mod:`dmsc.testing`.

Nothing is re-exported here: importing the package must stay cheap for the CLI (the deployment
pulls in torch).
"""
