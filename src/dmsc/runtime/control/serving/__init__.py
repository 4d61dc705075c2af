"""Inference on a deployment: its replicas, the versions they serve, task heads, autoscaling.

- :mod:`.infer_calls`: the control plane's ``Infer`` and ``InferStream``, one request recorded
  as a task; text handed on as whole characters by :mod:`.streaming`;
- :mod:`.head_inference`: inference over task heads, their next-token distributions combined
  by :mod:`.combiners`;
- :mod:`.inference`: the data-parallel replicas (routing, failover, model versions), each taken
  per token through a :class:`~.turns.FairLock` (:mod:`.turns`);
- :mod:`.elastic`: elastic serving replicas added and removed with the load, as the rule of
  :mod:`.autoscale` says;
- :mod:`.version_sync`: loading the versions the replicas should serve, all or nothing;
  :mod:`.held`: the record of what each replica holds; :mod:`.model_store`: the model versions
  (promote, canary, rollback), which say what should serve.

Imports run one way, down this list: ``infer_calls -> head_inference -> inference -> elastic,
version_sync -> held, model_store, turns, autoscale, combiners, streaming``. Below this
package only :mod:`..launch`; it never imports :mod:`..training` (nor training this one).
The model store is here rather than beside the control plane because the serving replicas and
the version sync read it.
"""
