"""A deployment and its workers: started, stepped, checkpointed, recovered.

- :mod:`.launchers`: the :class:`~.launchers.Launcher` protocol and the local launcher (one
  process per stage worker, forked by :mod:`.forked` from a server that imported the worker
  once); :mod:`.ray_launcher` the same on a Ray cluster, after the checks of
  :mod:`.ray_checks`; :mod:`.ray_private` the one-node Ray cluster ``dmsc up --launcher ray``
  starts without ``--ray-address``; :mod:`.ray_logs` the logs each Ray node holds, for
  ``dmsc logs``; :mod:`.spares` warm spares.
- :mod:`.layout`: what a deployment runs (:class:`~.layout.StageLayout`) and a consistent
  snapshot of it (:class:`~.layout.Checkpoint`); :mod:`.staging` writes a checkpoint folder
  whole or not at all.
- :mod:`.deployment`: the :class:`~.deployment.Deployment` (stage workers, their registry, a
  step, a checkpoint), whose forward-only requests (logits, decoding, inference sessions) are
  :mod:`.forwarding`'s; :mod:`.tp_ranks` keeps each replica's tensor-parallel ranks
  past the first (every call to a replica goes to all its ranks) and the TCPStore where their
  process groups meet; a request is decoded token by token with :mod:`.decoding` (or in
  runs drawn at the first stage, :mod:`dmsc.runtime.compute.drawing`), which draws each token
  with :mod:`dmsc.runtime.compute.sampling`.
- :mod:`.failures` finds failed workers; :mod:`.fallback` picks the newest checkpoint that
  verifies; :mod:`.recovery` brings failed workers back (for training and for serving).
- :mod:`.signals`: ``dmsc chaos``'s kill, freeze or thaw of a worker of a running deployment.
- :mod:`.renewal`: every leaf certificate (this process's, the workers', the CLI's) replaced
  before it expires.

Decoding is here, not in :mod:`..serving`, because
:meth:`~.forwarding.ForwardRequests.generate` runs them: every other package of the control layer
builds on this one, and this one on none of them.

Imports run one way, down this list (each module imports only modules on later lines):
``recovery, signals, renewal -> fallback -> deployment -> forwarding, staging, spares
-> decoding, tp_ranks
-> failures, layout -> launchers -> forked``, and
``ray_private -> ray_launcher -> ray_logs, ray_checks, launchers``.
"""
