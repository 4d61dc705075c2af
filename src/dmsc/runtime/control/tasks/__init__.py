"""Tasks: the one way in, the persistent queue and the consumers that run queued tasks.

- :mod:`.door`: both doors' one way in (``dmsc train``'s Train call and the gateway's ``POST
  /v1/tasks``): a request resolved once into its task's parameters, queued, and waited for;
- :mod:`.infer_batch`: a batch of inference requests as one queued task, through the door;
- :mod:`.task_queue`: the queue in the database, its policies, and the exception queue;
- :mod:`.lanes`: the weights between the lanes' consumers (a short task runs inside a paused
  long one);
- :mod:`.work_loop`: the control plane's consumers, one per lane, over queued training tasks,
  and how a task's end is recorded.

Imports run one way: ``infer_batch -> door, work_loop -> lanes, task_queue`` (neither of
``door`` and ``work_loop`` imports the other, nor ``work_loop`` ``infer_batch``). The queue is a
package below the control plane's dispatch because :mod:`..advisors` raises service-level
breaches into its exception queue; below this package are :mod:`..training` (a task's quota)
and :mod:`..launch` (a task with no checkpoint that verifies).
"""
