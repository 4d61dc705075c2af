"""The control layer as it runs: deployments, recovery, training sessions, queues, versions."""
