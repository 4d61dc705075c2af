"""What ``dmsc calibrate`` times for a device's ``dispatch_ns``: the runtime's mixture less its
experts and its router, per routed element each way."""

from __future__ import annotations

import math

import pytest

from dmsc.runtime.compute.mixture_rate import measure_dispatch_seconds


def test_the_routing_is_timed_per_routed_element_and_a_dense_model_is_refused() -> None:
    seconds = measure_dispatch_seconds(micro_batch=1, rounds=3)
    # a finite, positive figure well under the whole mixture's time per routed element
    # (moe-mini: 2.5 ms a sequence forward and backward over 2 x 128 x 128 x 2 element passes)
    assert math.isfinite(seconds) and 0 <= seconds < 2.5e-3 / (2 * 128 * 2 * 128)
    with pytest.raises(ValueError, match="not a mixture of experts"):
        measure_dispatch_seconds(model="gpt-mini", rounds=1)
