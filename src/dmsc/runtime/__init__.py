"""The running system: every micro-model a service, driven by a control plane.

The draft's roles (002_0021f8a50f21532c.txt), one sub-package each:

- :mod:`.control`: the Service Mesh Orchestrator: deployments, failure detection and recovery,
  training sessions, the task queue, model storage, launchers, the control-plane process;
- :mod:`.business`: the API gateway (keys, scopes, rate limits, circuit breakers), the service
  registry and the router;
- :mod:`.compute`: stage workers executing micro-models (PyTorch), pipeline schedules, gradient
  averaging, checkpoints, calibration;
- :mod:`.transport`: what both sides share: gRPC helpers, tensor wire frames, typed control
  messages, logs and metrics.

Imports point down that list: ``control`` uses ``business`` and ``compute``, which use only
``transport`` (``make check`` enforces it). The runtime deploys a :class:`dmsc.planner.Plan`.
"""
