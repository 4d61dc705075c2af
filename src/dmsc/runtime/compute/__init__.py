"""The computing-power layer: stage workers that run micro-models, and calibration.

Parallelism inside a stage: :mod:`.tensor_parallel` splits a replica's blocks over the ranks of
a tensor-parallel group (:mod:`.sequence_parallel` its residual stream along the sequence,
:mod:`.vocab_parallel` its embedding, head and loss over the vocabulary);
:mod:`.expert_parallel` shares a mixture of experts' experts over an expert-parallel group of
data-parallel replicas, tokens exchanged by all-to-all (at tp > 1 each expert split over the
replica's tp ranks too); :mod:`.tp_worker` and :mod:`.ep_worker` are a stage worker's side of
each (its groups, its gathered checkpoints); :mod:`.tp_ops` holds the tensor-parallel group's
operators (Megatron's ``f`` and ``g``) the three splits and the experts share, and
:mod:`.tp_sync` what a sync mode computes over a replica's whole update at tp > 1.
Across replicas, :mod:`.dp_collective` averages the gradients by the all-reduce the plan chose
(:mod:`.allreduce`: ring, tree or hierarchical), after a quorum (:mod:`.quorum`). Between
stages, :mod:`.peers` sends frames over gRPC, or, a training step's activations and gradients
where the stages share a datacenter, over a TCP stream to each neighbour (:mod:`.pipe_stream`,
the default) or where the deployment asks :mod:`.pipe_group`'s gloo point-to-point; a decoded
token's step goes from stage to stage in calls of their own (:mod:`.relay`), each stage keeping
the request's keys and values (:mod:`.sessions`); a session's tokens may be drawn in runs at its
first stage (:mod:`.drawing`, with :mod:`.sampling`'s draw, the one the control plane uses).
While a CPU
stage decodes, :mod:`.decode_layout` keeps its linear weights in the memory layout measured the
faster for one row; while a GPU stage decodes, :mod:`.decode_weights` gives its linear layers
their autocast casts made once a weight update, not once a token.
"""
