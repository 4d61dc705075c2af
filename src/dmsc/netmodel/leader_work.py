"""What the stage leader's own work costs when the replicas agree through it (``via: leader``).

Through the leader (:mod:`dmsc.netmodel.sync`: a star) each of the ``n`` replicas sends its fp32
update of ``E`` elements to the stage's first replica, which combines them by its rule before it
answers: the followers wait for that too. The rules are dmsc's runtime's
(:mod:`dmsc.runtime.compute.aggregators`, the plain mean as
:mod:`dmsc.runtime.compute.outer_sync` takes it), each a few passes of torch operations over the
updates. Such passes are bound by memory bandwidth on a CPU as on a GPU, so the leader's time is
the bytes its operations read and write over its device's memory bandwidth at the calibration's
memory efficiency, as the optimizer step is priced (:mod:`dmsc.netmodel.iteration`).

The median and the trimmed mean sort each element's ``n`` values with a sorting network
(:func:`sorting_network`: Batcher's odd-even merge sort, ``n log2(n)^2 / 4`` compare-exchanges
or fewer, each a ``torch.minimum`` and a ``torch.maximum`` of two rows) rather than
``torch.sort`` along the replicas: on this project's CPU the whole median of 8 replicas' 1M
elements took 35 ms where ``torch.sort`` alone took 172 ms (``benchmarks/leader_work.py``), the
same values; its passes are memory-bound and so priced like the others.

Bytes an element, each operation reading its inputs and writing its output once (fp32 4 bytes,
float64 8):

- ``mean``: the first update copied (``8``), each other added to it (``12``), the sum divided
  by ``n`` (``8``): ``12n + 4`` (:func:`dmsc.runtime.compute.aggregators.summed`);
- every rule but the mean first checks each update finite (a sum: ``4n``);
- ``median``: the updates stacked into one buffer (``8n``), the network's ``c(n)``
  compare-exchanges on its rows in place (``24`` each: two rows read twice, two written), then
  the middle row copied (``8``: odd ``n``) or the float64 mean of the two middle ones (``76``:
  even ``n``);
- ``trimmed-mean``: stacked and sorted as the median, then the ``k = n - 2 floor(trim n)``
  kept rows summed in float64 (``12`` for the first, ``20`` for each other), divided (``16``)
  and back to fp32 (``12``): ``12n + 24 c(n) + 20k + 20``;
- ``krum``: for each of the ``n (n - 1) / 2`` pairs the difference (``8`` read, ``4`` written)
  and its float64 norm (``4``): ``16`` a pair, then the chosen update copied (``8``);
- ``multi-krum``: Krum's pairs, then the mean of the ``n - f`` best in float64 one update at a
  time (``8`` to start, ``20`` an update, ``12`` back to fp32).

Central differential privacy (:func:`privacy_work_s`, the runtime's
:mod:`dmsc.runtime.compute.privacy`): each replica clips its update before it sends it (the
finite check ``4``, the norm in float64: the widening ``12`` and its read ``8``, the scaled copy
``8``: ``32``), and with noise the leader draws a Gaussian an element, at the host's measured
rate (compute-bound: about 6 ns, where a memory pass of ``12`` bytes takes under 1), and adds it
to the sum (the check ``4``, the scaling ``8``, the addition ``12``: ``24``). At tensor-parallel
``tp`` each rank draws the whole replica's noise and cuts its share: ``tp`` draws an element.

Secure aggregation (:func:`secure_work_s`, the runtime's
:mod:`dmsc.runtime.compute.secure_agg`; always the plain mean, uncompressed): each replica puts
its update in fixed point on the ring Z_2^32, held in int64 (checked finite by its sum ``4``,
widened to float64 ``12``, scaled ``16`` and rounded ``16`` in place, its range ``8``, to int64
``16`` and reduced ``16``: ``88``), adds or subtracts the mask of each of its ``n - 1`` pairs (a
ChaCha20 keystream widened to int64, at the host's measured rate: about 1.4 ns an element; the
addition ``24``), reduces the result (``16``) and narrows it to int32 for the wire (its range
``8``, the narrowing ``12``); the leader widens, reduces, checks and adds each of the ``n``
payloads (``60`` each) into a zeroed sum (``8``), reduces it (``16``), decodes it to fp32 (its
range ``8``, narrowed to int32 ``12``, checked ``4``, to fp32 ``8``, scaled ``8``) and divides
by ``n`` (``8``). These are the bytes the runtime's torch operations read and write, counted
by ``tests/runtime/compute/test_secure_agg.py``. The key agreement, once a session, is not
priced (``n`` public keys of 32 bytes and an X25519 exchange per pair).
A codec's decoding at the leader is :mod:`dmsc.netmodel.codec_work`'s.
``benchmarks/leader_work.py`` measures every rule on the machine against these figures.
"""

from __future__ import annotations

import math

from dmsc.spec.sync_forms import DEFAULT_BYZANTINE, DEFAULT_TRIM, parse_aggregator

FP32, FP64 = 4.0, 8.0
EXCHANGE = 4 * FP32 + 2 * FP32  # a compare-exchange: min and max, each reading two rows


def sorting_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort on ``n`` positions: compare-exchanges ``(i, j)``, ``i <
    j``, in order, after which position ``i`` holds the ``i``-th smallest value. Built for the
    next power of two and cut to the pairs inside ``n`` (the positions past ``n`` hold +inf:
    they never move)."""
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return pairs


def _float64_mean(k: int) -> float:
    """The mean of ``k`` fp32 rows summed in float64 one at a time, and back to fp32."""
    return (FP32 + FP64) + (FP32 + 2 * FP64) * (k - 1) + 2 * FP64 + FP64 + FP32


def _pairs(n: int) -> float:
    return n * (n - 1) / 2 * (2 * FP32 + FP32 + FP32)


def bytes_per_element(aggregator: str, n: int) -> float:
    """Bytes the leader's rule ``aggregator`` (a form: ``krum:1``) reads and writes per element
    of ``n`` updates (module docstring); 0 for fewer than two."""
    if n < 2:
        return 0.0
    name, options = parse_aggregator(aggregator)
    if name == "mean":
        return 2 * FP32 + 3 * FP32 * (n - 1) + 2 * FP32
    # every rule but the mean goes through the runtime's aggregate(), which first checks each
    # update finite (a sum: 4n read)
    network = FP32 * n + FP32 * 2 * n + EXCHANGE * len(sorting_network(n))
    if name == "median":
        middle = 2 * FP32 if n % 2 else 2 * (FP32 + FP64) + 3 * FP64 + 2 * FP64 + FP64 + FP32
        return network + middle
    if name == "trimmed-mean":
        cut = math.floor(options.get("trim", DEFAULT_TRIM) * n)
        return network + _float64_mean(n - 2 * cut)
    byzantine = options.get("byzantine", DEFAULT_BYZANTINE)
    pairs = FP32 * n + _pairs(n)
    if name == "krum":
        return pairs + 2 * FP32
    kept = max(1, n - byzantine)
    return pairs + FP64 + (FP32 + 2 * FP64) * kept + FP64 + FP32


def leader_work_s(aggregator: str, n: int, elements: float, memory_bytes_s: float) -> float:
    """Seconds the leader's rule takes on ``n`` updates of ``elements`` fp32 elements at a
    memory bandwidth of ``memory_bytes_s`` (already times the calibration's efficiency)."""
    if memory_bytes_s <= 0:
        raise ValueError(f"memory bandwidth must be > 0 bytes/s, got {memory_bytes_s}")
    return elements * bytes_per_element(aggregator, n) / memory_bytes_s


CLIP = 32.0  # a replica's update clipped (module docstring)
NOISE_PASSES = 24.0  # the leader's noise scaled and added to the sum, after the check


def privacy_work_s(
    privacy: str, elements: float, memory_bytes_s: float, gaussian_s: float, tp: int = 1
) -> float:
    """Seconds of central differential privacy's work on the path a replica waits on, for
    ``elements`` fp32 elements an update: the clip's passes at ``memory_bytes_s`` and, under
    ``noise``, the leader's draws at ``gaussian_s`` each (``tp`` draws an element) and its
    passes (module docstring); 0 for ``none``."""
    if privacy == "none":
        return 0.0
    if memory_bytes_s <= 0:
        raise ValueError(f"memory bandwidth must be > 0 bytes/s, got {memory_bytes_s}")
    work = elements * CLIP / memory_bytes_s
    if privacy == "noise":
        work += elements * (tp * gaussian_s + NOISE_PASSES / memory_bytes_s)
    return work


MASK_ENCODE = 88.0  # a replica's update in fixed point on the ring (module docstring)
MASK_PAIR = 24.0  # a pair's mask added or subtracted, in place
MASK_PAYLOAD = 36.0  # the masked ring reduced and narrowed to int32 for the wire
UNMASK_PARTY = 60.0  # a payload widened, reduced, checked and added to the leader's sum
UNMASK_SUM = 72.0  # the sum zeroed, reduced, decoded to fp32 and divided by n


def secure_bytes_per_element(n: int) -> float:
    """Bytes an element that secure aggregation's passes read and write on the path a replica
    waits on among ``n`` replicas: one replica's masking and the leader's unmasking (module
    docstring), without the masks' keystreams; 0 for fewer than two."""
    if n < 2:
        return 0.0
    replica = MASK_ENCODE + MASK_PAIR * (n - 1) + MASK_PAYLOAD
    return replica + UNMASK_PARTY * n + UNMASK_SUM


def secure_work_s(n: int, elements: float, memory_bytes_s: float, mask_s: float) -> float:
    """Seconds of secure aggregation's work on the path a replica waits on, among ``n``
    replicas of ``elements`` fp32 elements an update: its passes at ``memory_bytes_s`` and one
    replica's ``n - 1`` pair masks at ``mask_s`` an element each (module docstring)."""
    if n < 2:
        return 0.0
    if memory_bytes_s <= 0:
        raise ValueError(f"memory bandwidth must be > 0 bytes/s, got {memory_bytes_s}")
    return elements * (secure_bytes_per_element(n) / memory_bytes_s + (n - 1) * mask_s)
