"""A deployment whose replicas share out a mixture's experts, against single-process training of
the whole model (issue 31, point 6): dp = 4, ep = 2 is four worker processes in two runs of two,
each replica with two of moe-mini's four experts, exchanging tokens by all-to-all within its run
over a gloo group formed through the control plane's store; the shared weights' gradients
averaged over the four, each expert's over the two replicas holding it. A request runs on every
replica of a run and decodes as one process (and as ``transformers`` for a Mixtral)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from runtime_helpers import reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.checkpoints import read_checkpoint
from dmsc.runtime.compute.models.chain import layer_names, loss_fn
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.compute.outer_sync import make_optimizer
from dmsc.runtime.control.launch import recovery
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.transport.messages import Sampling
from dmsc.spec import TransformerSpec, resolve_model

pytestmark = pytest.mark.integration

STEPS = 10
GREEDY = Sampling(temperature=0)
WHOLE = [("embedding", "head")]


def test_ep2_trains_ten_steps_as_one_process_and_saves_the_whole_stage(tmp_path: Path) -> None:
    """Ten steps at ep = 2 (dp = 4, one sequence per replica) give the losses of one process
    on the whole batch (four micro-batches of one); the checkpoint taken before
    the last step is the ep = 1 stage, with every expert: it loads into one whole module, which
    computes the last step's loss as the four replicas did, and decodes greedily the tokens a
    run of two replicas decoded before (a request runs on both: it used to be refused), with the
    stages' keys and values and without. A replica killed before the last step fails it; the
    recovery replaces it from the checkpoint, its run's group forms again around it, and the
    last step gives the reference's loss; then both runs serve, with the same logits."""
    spec = resolve_model("moe-mini")
    assert isinstance(spec, TransformerSpec) and spec.experts == 4
    spec = spec.model_copy(update={"layers": 2, "seq": 64})  # two mixtures; a quicker reference
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=1)
    batches = [corpus.batch(s, 4) for s in range(STEPS)]
    reference = reference_losses(spec, 0, 1e-3, batches, 4)
    with Deployment(StageLayout(spec, WHOLE, replicas=4, ep=2), home=tmp_path) as dep:
        outs = [dep.train_step(s, *batches[s], 1) for s in range(STEPS - 1)]
        losses = [o["loss"] for o in outs]
        # each replica's mixtures route its sequence's tokens, top_k choices each, once a
        # forward; every pair is received by one rank of its expert-parallel group
        for out in outs:
            ep = {r: out["comm"][(0, r)]["ep"] for r in range(4)}
            assert all(f["routed"] == spec.seq * spec.top_k * spec.layers for f in ep.values())
            for group in ((0, 1), (2, 3)):
                got = sum(ep[r]["received"] for r in group)
                assert got == sum(ep[r]["routed"] for r in group)
                # mixture by mixture the busiest member: at least any member's total, at most
                # every token of the group; the same on both, the calls themselves not kept
                busiest = {ep[r]["busiest"] for r in group}
                assert len(busiest) == 1 and "tokens" not in ep[group[0]]
                assert max(ep[r]["received"] for r in group) <= busiest.pop() <= got
        prompt = batches[0][0][0, :12].tolist()
        # a request runs on both replicas of its run (their all-to-alls pair them), the
        # replica asked answers: greedy decoding, with the stages' keys and values and without;
        # saved meanwhile, each token and the Save take turns (the Save's gathers would pair
        # with a forward's all-to-alls)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(dep.generate, prompt, 6, sampling=GREEDY)
            ckpt = dep.checkpoint(STEPS - 1)
            decoded = request.result()
        assert dep.generate(prompt, 6, sampling=GREEDY, replica=3, use_cache=False) == decoded
        dep.handle((0, 1)).process.kill()  # a replica of the first run dies: the step fails,
        with pytest.raises(WorkerFailure) as failure:  # its partner does not hang
            dep.train_step(STEPS - 1, *batches[-1], 1)
        assert failure.value.failed.keys() == {(0, 1)}
        rec = recovery.recover(dep, failure.value, [ckpt])  # the run's group formed anew
        assert rec.failed == ["stage0-r1"] and rec.checkpoint_step == STEPS - 1
        losses.append(dep.train_step(STEPS - 1, *batches[-1], 1)["loss"])
        # the recovered run serves again, and as the other run does (the same weights)
        x = batches[0][0][:1]
        assert torch.allclose(dep.logits(STEPS, x, 1), dep.logits(STEPS + 1, x, 2), atol=1e-5)
    diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"dp=4 ep=2 against one process, {STEPS} steps: max loss difference {diff:.2e}")
    assert diff < 1e-4
    assert list(ckpt.files) == [0] and not ckpt.replicas  # one file, written by replica 0
    module = stage_module(spec, 0, *WHOLE[0])
    path = Path(ckpt.files[0][0])
    assert read_checkpoint(path, spec, module, make_optimizer("adamw", module, 1e-3)) == 9
    assert {k for k in module.state_dict() if ".experts." in k} == {  # every expert, ep = 1
        k for k in stage_module(spec, 0, *WHOLE[0]).state_dict() if ".experts." in k
    }
    with torch.no_grad():  # the whole stage computes the last step's loss the replicas did
        x, y = batches[-1]
        assert abs(float(loss_fn(module(x), y)) - losses[-1]) < 1e-4
        out = list(prompt)  # and decodes as the deployment did, one process, no cache
        for _ in range(6):
            out.append(int(module(torch.tensor([out]))[0, -1].argmax()))
    assert decoded == out[len(prompt) :]


def test_ep2_tp2_trains_ten_steps_as_one_process_and_saves_the_whole_stage(
    tmp_path: Path,
) -> None:
    """ep = 2 with tp = 2 (dp = 2): four worker processes, each replica's two experts split
    Megatron-style over its two tp ranks, tp rank t of one replica exchanging tokens with tp
    rank t of the other. Ten steps give the losses of one process on the whole batch; the
    checkpoint taken before the last step is the ep = 1, tp = 1 stage: a tp rank killed before
    the last step, the recovery loads it back into the replaced replica's two ranks, and the
    last step gives the reference's loss; it loads into one whole module too, which computes
    the last step's loss as the deployment did and decodes greedily the tokens the four
    processes decoded from it."""
    spec = resolve_model("moe-mini")
    assert isinstance(spec, TransformerSpec)
    spec = spec.model_copy(update={"layers": 2, "seq": 64})
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=1)
    batches = [corpus.batch(s, 2) for s in range(STEPS)]
    reference = reference_losses(spec, 0, 1e-3, batches, 2)
    with Deployment(StageLayout(spec, WHOLE, replicas=2, tp=2, ep=2), home=tmp_path) as dep:
        sids = sorted(s.sid for s in dep.registry.lookup(stage=0))
        assert sids == ["stage0-r0-t0", "stage0-r0-t1", "stage0-r1-t0", "stage0-r1-t1"]
        outs = [dep.train_step(s, *batches[s], 1) for s in range(STEPS - 1)]
        losses = [o["loss"] for o in outs]
        # the all-to-alls measured as the group's, call by call over both replicas (their
        # own waits kept beside), the tp all-reduces over each replica's ranks; no walls kept
        ep = [outs[-1]["comm"][(0, r)]["ep"] for r in (0, 1)]
        assert ep[0]["s"] == ep[1]["s"] > 0 and all("wait_s" in f for f in ep)
        assert all("walls" not in f for c in outs[-1]["comm"].values() for f in c.values())
        ckpt = dep.checkpoint(STEPS - 1)
        prompt = batches[0][0][0, :12].tolist()  # a request on all four processes
        decoded = dep.generate(prompt, 6, sampling=GREEDY, replica=1)
        # a tp rank of replica 1 dies: the step fails at once, the recovery replaces the
        # replica's whole tp group from the checkpoint (the whole stage cut back into each
        # rank's experts and tp shard) and the expert-parallel groups form anew around it
        next(h for h in dep.tp.handles if h.config.replica == 1).process.kill()
        with pytest.raises(WorkerFailure) as failure:
            dep.train_step(STEPS - 1, *batches[-1], 1)
        rec = recovery.recover(dep, failure.value, [ckpt])
        assert rec.failed == ["stage0-r1-t0", "stage0-r1-t1"] and rec.checkpoint_step == 9
        losses.append(dep.train_step(STEPS - 1, *batches[-1], 1)["loss"])
    diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"dp=2 ep=2 tp=2 against one process, {STEPS} steps: max loss difference {diff:.2e}")
    assert diff < 1e-4
    assert list(ckpt.files) == [0] and not ckpt.replicas  # one file: replica 0's tp rank 0
    module = stage_module(spec, 0, *WHOLE[0])
    path = Path(ckpt.files[0][0])
    assert read_checkpoint(path, spec, module, make_optimizer("adamw", module, 1e-3)) == 9
    with torch.no_grad():  # the whole stage computes the last step's loss the replicas did
        x, y = batches[-1]
        assert abs(float(loss_fn(module(x), y)) - losses[-1]) < 1e-4
        out = list(prompt)  # and decodes as the deployment did
        for _ in range(6):
            out.append(int(module(torch.tensor([out]))[0, -1].argmax()))
    assert decoded == out[len(prompt) :]


def test_ep2_pp2_greedy_decoding_equals_transformers_generate(tmp_path: Path) -> None:
    """A tiny random Mixtral saved with ``save_pretrained``, deployed from ``hf:DIR`` as two
    stages of two replicas sharing its four experts (ep = 2: four processes, each stage's
    replicas exchanging tokens): greedy decoding with the stages' keys and values, asked of the
    second replica, gives the tokens ``transformers``' own ``generate`` gives."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(5)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # visible norms: ones would hide a mapping error
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mixtral")
    spec = resolve_model(f"hf:{tmp_path / 'mixtral'}", {"seq": 32})
    assert isinstance(spec, TransformerSpec) and spec.experts == 4
    names = layer_names(spec)  # embedding, block_0, block_1, head
    ranges = [(names[0], names[1]), (names[2], names[-1])]
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=0)  # fmt: skip
    with Deployment(StageLayout(spec, ranges, replicas=2, ep=2), home=tmp_path) as dep:
        got = dep.generate(prompt[0].tolist(), 8, sampling=GREEDY, replica=1)
    assert got == want[0, 6:].tolist()
