"""Decoding with inference sessions (a KV cache per stage) against recomputing the context, and
against single-process ``transformers`` ``generate`` on the same model.

A Llama-style model (8 layers, hidden 512, 8 heads, 4 key/value heads, vocabulary 8192, random
weights) is saved as a Hugging Face checkpoint and served by dmsc as 2 stage processes on this
machine (a token's ``Relay`` from one to the next a call on a kept TCP connection:
:mod:`dmsc.runtime.transport.stream_calls`), each loading its own tensors. Greedy decoding of
``--tokens`` tokens after a 32-token prompt: one session with the cache, one recomputing (the
path before sessions), ``--sessions`` concurrent sessions with the cache (taking turns per
token, as the control plane's fair lock makes them: as many tokens through the replica at once
as its pipeline holds, one per stage and one drawn, ``tokens_in_flight``; and, alternated with
it in the same run, one token at a time, the lock before), and ``transformers`` in this process
with its own cache.

One session with the cache is measured two ways, alternated with ``transformers`` over
``--pairs`` rounds (the median of each): as the control plane decodes, its tokens drawn in runs
at the first stage (``Draw``, :mod:`dmsc.runtime.compute.drawing`), and with a call from the
control plane a token (``runs=False``, the path before), which draw the same tokens.

Prints a table, or with --json one object: cache_speedup (recompute time / cache time, one
session), tokens_per_s (per path), ms_per_token (per path), vs_transformers_ratio (dmsc's
tokens/s with the cache over transformers', one session; _by_pair: each round's), runs_speedup
(a call a token's time over the runs'), pairs (each round's seconds), cpu_ms_per_token (CPU of every
process, one cached session and transformers), cpu_ms_per_token_by_process (the same session's
CPU in the control plane and in each stage worker), transformers_threads (``--hf-threads``:
one keeps ``generate`` off the cores the stages share on a loaded machine, where two threads
spinning in OpenMP took 3-10 times as long), load_average, and same_tokens (both dmsc paths
and transformers chose the same tokens).

With ``--tp N`` each stage is N tensor-parallel worker processes (the runs drawn at the first
stage by every rank of it, agreeing before each token; ``cpu_ms_per_token_by_process`` then
names each rank).

With ``--tls`` the two stages are also served with mutual TLS (as under ``dmsc up``: a
certificate authority of the run, a leaf per worker), ``--rounds`` plain/TLS pairs of decoding
deployments alternated so that drift on a shared machine hits both alike; the JSON gains
``tls``: tokens/s per round and path, and ``tls_ratio`` (TLS tokens/s over plain, the better
round of each).

With ``--grpc-relay`` a second deployment of the same stages relays each token over gRPC
(``StageLayout(pp_stream=False)``, the path before streams: the control plane's calls over gRPC
too), its one session timed in every round beside the others (the same tokens); the JSON gains
``stream_over_grpc_relay_by_pair`` (each round's stream time over gRPC's), and
``cache_1_session_grpc_relay`` in ``ms_per_token`` and ``cpu_ms_per_token``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from _deployment import cpu_s

from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.serving.turns import FairLock
from dmsc.runtime.transport.messages import Sampling
from dmsc.spec import TransformerSpec, resolve_model

PROMPT = 32


def _checkpoint(directory: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def _transformers(
    directory: Path, prompt: list[int], tokens: int
) -> tuple[float, list[int], float]:
    """Seconds and tokens of ``generate``, and the CPU seconds it took."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    return took, out[0, len(prompt) :].tolist(), cpu


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _turns(width: int) -> Callable[[float | None], contextlib.AbstractContextManager[None]]:
    """A turn function as the control plane's replica lock gives turns: ``width`` tokens of
    different sessions through the replica at once (its ``tokens_in_flight``; 1: one at a
    time, as before issue 31's overlap)."""
    lock = FairLock(width)
    return lambda until: lock.turn("bench", until)


def _tls_rounds(
    ckpt: Path, home: Path, prompt: list[int], tokens: int, rounds: int, sessions: int
) -> dict[str, Any]:
    """Plain and mutual-TLS deployments alternated: tokens/s of one cached session and of
    ``sessions`` concurrent ones, per round."""
    from dmsc.runtime.transport import tls

    spec = resolve_model(f"hf:{ckpt}", {"seq": 512})
    assert isinstance(spec, TransformerSpec)
    greedy = Sampling(temperature=0)
    layout = StageLayout(spec, [("embedding", "block_3"), ("block_4", "head")])
    rates: dict[str, dict[str, list[float]]] = {
        k: {"cache_1_session": [], f"cache_{sessions}_sessions": []} for k in ("plain", "tls")
    }
    for r in range(rounds):
        for kind in ("plain", "tls"):
            if kind == "tls":  # what the control plane does at dmsc up
                tls.install_authority(home / f"ca-{r}")
            try:
                with Deployment(layout, home=home / f"{kind}-{r}") as dep:
                    dep.generate(prompt, 4, sampling=greedy)  # warm-up
                    t0 = time.perf_counter()
                    dep.generate(prompt, tokens, sampling=greedy)
                    rates[kind]["cache_1_session"].append(tokens / (time.perf_counter() - t0))
                    turn = _turns(layout.tokens_in_flight)
                    threads = [
                        threading.Thread(
                            target=dep.generate,
                            args=(prompt, tokens),
                            kwargs={
                                "step_base": 10_000_000 * (i + 1),
                                "sampling": greedy,
                                "turn": turn,
                            },
                        )
                        for i in range(sessions)
                    ]
                    t0 = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    rate = tokens * sessions / (time.perf_counter() - t0)
                    rates[kind][f"cache_{sessions}_sessions"].append(rate)
            finally:
                tls.install(None)
    ratio = {path: max(rates["tls"][path]) / max(rates["plain"][path]) for path in rates["plain"]}
    return {"rounds": rates, "tls_ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tls", action="store_true", help="Also decode with mutual TLS.")
    parser.add_argument("--rounds", type=int, default=2, help="With --tls: plain/TLS pairs.")
    parser.add_argument("--hf-threads", type=int, help="transformers' threads (torch's default)")
    parser.add_argument(
        "--tp", type=int, default=1, help="Tensor-parallel ranks of each stage (default 1)."
    )
    parser.add_argument(
        "--pairs", type=int, default=3, help="Alternated rounds of the one-session paths."
    )
    parser.add_argument(
        "--grpc-relay",
        action="store_true",
        help="Also a deployment whose stages relay over gRPC (pp_stream=False: its calls too), "
        "its one session alternated with the others in each round.",
    )
    args = parser.parse_args()
    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    greedy = Sampling(temperature=0)
    with tempfile.TemporaryDirectory(prefix="dmsc-bench-") as tmp:
        ckpt = Path(tmp) / "llama"
        _checkpoint(ckpt)
        spec = resolve_model(f"hf:{ckpt}", {"seq": 512})
        assert isinstance(spec, TransformerSpec)
        prompt = torch.randint(0, spec.vocab, (PROMPT,), generator=torch.Generator().manual_seed(1))
        prompt_ids = prompt.tolist()
        layout = StageLayout(spec, [("embedding", "block_3"), ("block_4", "head")], tp=args.tp)
        with contextlib.ExitStack() as held:
            dep = held.enter_context(Deployment(layout, home=Path(tmp) / "home"))
            dep.generate(prompt_ids, 4, sampling=greedy)  # warm-up
            over_grpc = None
            if args.grpc_relay:  # the same stages, each token's Relay a gRPC call
                grpc_layout = dataclasses.replace(layout, pp_stream=False)
                over_grpc = held.enter_context(Deployment(grpc_layout, home=Path(tmp) / "grpc"))
                over_grpc.generate(prompt_ids, 4, sampling=greedy)
            procs = {"control": psutil.Process()}
            for h in [*dep.handles, *dep.tp.handles]:  # each stage's ranks (one at tp = 1)
                rank = f"-t{h.config.tp_rank}" if args.tp > 1 else ""
                procs[f"stage{h.config.stage}{rank}"] = psutil.Process(h.process.pid)
            # one session, side by side and alternated over --pairs rounds: transformers,
            # dmsc drawing in runs at the first stage, dmsc a call a token (the median of each)
            pairs: list[dict[str, float]] = []
            for _ in range(args.pairs):
                hf_s, hf_tokens, hf_cpu = _transformers(ckpt, prompt_ids, args.tokens)
                by0 = {k: _cpu(p) for k, p in procs.items()}
                t0, c0 = time.perf_counter(), cpu_s()
                cached = dep.generate(prompt_ids, args.tokens, sampling=greedy)
                cache_s, cache_cpu = time.perf_counter() - t0, cpu_s() - c0
                by_process = {k: (_cpu(p) - by0[k]) / args.tokens * 1e3 for k, p in procs.items()}
                t0 = time.perf_counter()
                single = dep.generate(prompt_ids, args.tokens, sampling=greedy, runs=False)
                pairs.append(
                    {"transformers_s": hf_s, "runs_s": cache_s,
                     "token_a_call_s": time.perf_counter() - t0,
                     "transformers_cpu_s": hf_cpu, "runs_cpu_s": cache_cpu}
                )  # fmt: skip
                assert single == cached
                if over_grpc is not None:
                    t0, c0 = time.perf_counter(), cpu_s()
                    assert over_grpc.generate(prompt_ids, args.tokens, sampling=greedy) == cached
                    pairs[-1]["grpc_relay_runs_s"] = time.perf_counter() - t0
                    pairs[-1]["grpc_relay_runs_cpu_s"] = cpu_s() - c0
            hf_s = statistics.median(p["transformers_s"] for p in pairs)
            cache_s = statistics.median(p["runs_s"] for p in pairs)
            call_s = statistics.median(p["token_a_call_s"] for p in pairs)
            hf_cpu = statistics.median(p["transformers_cpu_s"] for p in pairs)
            cache_cpu = statistics.median(p["runs_cpu_s"] for p in pairs)
            t0 = time.perf_counter()
            recomputed = dep.generate(prompt_ids, args.tokens, sampling=greedy, use_cache=False)
            recompute_s = time.perf_counter() - t0
            results: list[list[int]] = [[] for _ in range(args.sessions)]

            def sessions(width: int) -> float:
                """Seconds for ``--sessions`` concurrent sessions taking turns ``width`` at
                once."""
                turn = _turns(width)

                def one(i: int) -> None:
                    results[i] = dep.generate(
                        prompt_ids, args.tokens, step_base=10_000_000 * (i + 1), sampling=greedy,
                        turn=turn,
                    )  # fmt: skip

                threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return time.perf_counter() - t0

            width = layout.tokens_in_flight
            # side by side, alternated: one token at a time through the replica, and the
            # control plane's width
            rounds = [(w, sessions(w)) for w in (1, width, 1, width)]
            many_s = min(s for w, s in rounds if w == width)
            one_s = min(s for w, s in rounds if w == 1)
        tls_cost = (
            _tls_rounds(ckpt, Path(tmp), prompt_ids, args.tokens, args.rounds, args.sessions)
            if args.tls
            else None
        )
    n = args.tokens
    out = {
        "model": "llama 8 x 512 (vocab 8192), 2 stages"
        + (f" of {args.tp} tensor-parallel ranks" if args.tp > 1 else ""),
        "prompt_tokens": PROMPT,
        "tokens": n,
        "sessions": args.sessions,
        "tokens_per_s": {
            "cache_1_session": n / cache_s,
            "cache_1_session_a_call_a_token": n / call_s,
            "recompute_1_session": n / recompute_s,
            f"cache_{args.sessions}_sessions": n * args.sessions / many_s,
            f"cache_{args.sessions}_sessions_one_token_at_a_time": n * args.sessions / one_s,
            "transformers_1_session": n / hf_s,
        },
        "tokens_in_flight": width,
        "ms_per_token": {
            "cache_1_session": cache_s / n * 1e3,
            "cache_1_session_a_call_a_token": call_s / n * 1e3,
            "recompute_1_session": recompute_s / n * 1e3,
            f"cache_{args.sessions}_sessions": many_s / n * 1e3,
            f"cache_{args.sessions}_sessions_one_token_at_a_time": one_s / n * 1e3,
            "transformers_1_session": hf_s / n * 1e3,
        },
        "cache_speedup": recompute_s / cache_s,
        "vs_transformers_ratio": (n / cache_s) / (n / hf_s),
        "vs_transformers_ratio_by_pair": [p["transformers_s"] / p["runs_s"] for p in pairs],
        "runs_speedup": call_s / cache_s,
        "pairs": pairs,
        # CPU of every process per token (dmsc: control plane and stages), which a shared
        # machine's load disturbs far less than the wall clock
        "cpu_ms_per_token": {
            "cache_1_session": cache_cpu / n * 1e3,
            "transformers_1_session": hf_cpu / n * 1e3,
        },
        "cpu_ms_per_token_by_process": by_process,
        "transformers_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "same_tokens": cached == recomputed == hf_tokens and all(r == cached for r in results),
    }
    if tls_cost is not None:
        out["tls"] = tls_cost
    if args.grpc_relay:  # each round's stream over gRPC (below 1: the stream is faster)
        by_pair = [p["runs_s"] / p["grpc_relay_runs_s"] for p in pairs]
        out["stream_over_grpc_relay_by_pair"] = by_pair
        grpc_s = statistics.median(p["grpc_relay_runs_s"] for p in pairs)
        out["ms_per_token"]["cache_1_session_grpc_relay"] = grpc_s / n * 1e3
        out["cpu_ms_per_token"]["cache_1_session_grpc_relay"] = (
            statistics.median(p["grpc_relay_runs_cpu_s"] for p in pairs) / n * 1e3
        )
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['model']}, {PROMPT}-token prompt, {n} tokens greedy")
    print(f"{'path':38s} {'tokens/s':>10s} {'ms/token':>10s}")
    for key, rate in out["tokens_per_s"].items():
        print(f"{key:38s} {rate:10.1f} {out['ms_per_token'][key]:10.2f}")
    print(f"cache speedup over recompute: {out['cache_speedup']:.1f}x (target >= 5)")
    print(f"dmsc (cache) / transformers tokens/s: {out['vs_transformers_ratio']:.2f}")
    cpu = out["cpu_ms_per_token"]
    print(
        f"CPU per token: dmsc {cpu['cache_1_session']:.1f} ms (every process), transformers "
        f"{cpu['transformers_1_session']:.1f} ms ({out['transformers_threads']} threads)"
    )
    print(
        "dmsc CPU per token by process: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in by_process.items())
    )
    print("load average: " + " ".join(f"{x:.2f}" for x in out["load_average"]))
    print(f"same tokens on every path: {out['same_tokens']}")
    if args.grpc_relay:
        by = " ".join(f"{r:.3f}" for r in out["stream_over_grpc_relay_by_pair"])
        print(f"one session, relays on a stream / over gRPC, by round: {by}")
    if tls_cost is not None:
        for path, ratio in tls_cost["tls_ratio"].items():
            print(f"tokens/s with mutual TLS / plain, {path}: {ratio:.3f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
