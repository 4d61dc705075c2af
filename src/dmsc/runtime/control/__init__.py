"""The control layer as it runs: deployments, recovery, training sessions, queues, versions.

- :mod:`.launchers` starts and stops worker processes (:mod:`.ray_launcher` on a Ray cluster,
  :mod:`.ray_local` such a cluster on one machine); :mod:`.spares` keeps warm spares.
- :mod:`.deployment` deploys a plan's stage workers and drives their steps and checkpoints;
  :mod:`.failures` finds failed workers, :mod:`.recovery` brings them back.
- :mod:`.training` is a training session with checkpoints and recovery; :mod:`.chaos` rehearses
  faults against it.
- :mod:`.plane` is the control plane and its ``dmsc.Control`` service, with :mod:`.inference`
  (replicas, failover, model versions), :mod:`.watchdog`, :mod:`.status`, :mod:`.task_queue` and
  :mod:`.model_store`; :mod:`.daemon` is the process ``dmsc up`` starts.

Nothing is re-exported here: importing the package must stay cheap for the CLI (the deployment
pulls in torch).
"""
