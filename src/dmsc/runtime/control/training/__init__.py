"""A training task on a deployment: its session, its data, its size and its checkpoints.

- :mod:`.session`: the training session (steps, validation, checkpoints, recovery, metrics)
  and a task's parameters (:class:`~.session.TrainParams`);
- :mod:`.resize`: the task's data-parallel degree grown or shrunk between checkpoints;
- :mod:`.local_data`: each datacenter's replicas train on their own shard of the task's files;
- :mod:`.lr_schedule`: the learning rate of each step;
- :mod:`.retention`: how many checkpoints a task keeps and how many bytes a tenant's may take.

Imports run one way: ``resize, local_data -> session -> retention``; ``lr_schedule`` imports none
of them. Below this package only :mod:`..launch`; it never imports :mod:`..serving` (nor
serving this one).
"""
