"""A thin link between two stages' datacenters, shaped in the data plane: a step's pipeline
frames take at least their bytes over the link's rate longer, and the traces count them."""

from __future__ import annotations

import pytest

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.transport.wire import Kind, encode
from dmsc.spec import TransformerSpec, resolve_model

pytestmark = pytest.mark.integration


def test_a_slow_link_between_stages_costs_its_bytes_over_its_rate() -> None:
    import torch

    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    train, _ = stdlib_text(max_bytes=200_000)
    x, y = Corpus(train, model.seq, seed=1).batch(0, 4)
    m, mbps = 2, 2.0  # about 2 s of shaping a step: far above the noise of a loaded machine
    ranges = [("embedding", "block_1"), ("block_2", "head")]
    where = {(0, 0): "a", (1, 0): "b"}
    steps: dict[str, float] = {}
    for name, links in (("open", {}), ("thin", {("a", "b"): mbps})):
        layout = StageLayout(model, ranges, datacenters=where, link_mbps=links)
        with Deployment(layout) as dep:
            dep.train_step(0, x, y, m)  # warm-up
            out = dep.train_step(1, x, y, m)
        steps[name] = out["step_s"]
    frame = len(encode(Kind.ACTIVATION, 1, 0, torch.zeros(4 // m, model.seq, model.hidden), 0))
    # m activations forward and m gradients back, each a frame over the link
    assert out["traces"][(0, 0)][1]["1/0"] == m * frame
    # Each direction has a shaper of its own (in its sender), so the gradients going back overlap
    # the activations still going forward: under 1F1B at pp = 2 the link's critical path is the
    # m forward sends one after the other, then the last micro-batch's gradient back. That is a
    # floor no machine can beat: a send waits for its bytes at the link's rate.
    shaped_s = (m + 1) * frame * 8 / (mbps * 1e6)
    # The thin step is not 'open + shaped': the compute of the micro-batches behind a send runs
    # while the send waits for the link. (The test subtracted the open step, and a loaded
    # machine's open step of 0.85 s overlapped the 1.57 s of shaping: thin - open left 0.54 of it.)
    assert steps["open"] < shaped_s, steps  # else the floor below would prove nothing
    assert steps["thin"] >= 0.98 * shaped_s, (steps, shaped_s)
    assert steps["thin"] - steps["open"] <= 2 * m * frame * 8 / (mbps * 1e6) + 1.0, steps
