"""Checkpoint files of one stage, in the Hugging Face format: safetensors under the tensor names
of ``transformers``, checked by SHA-256.

``Save`` to ``PATH`` (``stageN.safetensors``) writes two files:

- ``PATH``: the stage's weights in float32 (the master copy), named and laid out as in the
  model's Hugging Face checkpoint (:func:`dmsc.runtime.compute.models.hf.hf_key`), so the stage
  files of one step, with the ``config.json`` and ``model.safetensors.index.json`` the control
  plane writes beside them, form a sharded checkpoint that ``transformers`` loads as it is;
- ``PATH`` with ``.optim.safetensors``: AdamW's moments and step counts under
  ``<weight name>.<state>`` (laid out as their weight), with the steps done and the optimizer's
  settings in the file's metadata.

The digest (:func:`checkpoint_sha256`) covers both; the control plane keeps it (in a
``Checkpoint`` or a model version) and hands it back on ``Load``, which refuses a checkpoint that
fails it before anything is loaded. safetensors files hold tensors only: a checkpoint never runs
code. A checkpoint that cannot be read, or does not fit the stage, is refused the same way
(:class:`CheckpointError`): the control plane then falls back to an older one
(:mod:`dmsc.runtime.control.launch.fallback`). Files written by ``torch.save`` (dmsc before the
safetensors format) are still read, with ``weights_only=True``.

With a checkpoint key installed (:mod:`.sealing`, ``dmsc up --encrypt-checkpoints``) each file
is written sealed (AES-GCM) and read back through the key; the digest covers the sealed bytes.

A save is atomic per file (written beside, then renamed over the name) and leaves nothing behind
when it fails. A full disk (ENOSPC, a quota: EDQUOT, a file size limit: EFBIG) raises
:class:`DiskFull`, answered RESOURCE_EXHAUSTED by the worker: the control plane fails the task
with its message (no space left on device: the path and the space free) instead of taking the
worker for failed and rolling back to run into the same wall again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from safetensors.torch import save_file

from dmsc.runtime.compute import sealing
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.models.hf import hf_key
from dmsc.runtime.transport.rpc import NoRoom
from dmsc.spec import TransformerSpec

OPTIM_SUFFIX = ".optim.safetensors"


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded: missing, or not the file its hash names."""


# what a write that found no room raises: no space, a disk quota, the process's file size limit
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFull(NoRoom):
    """A checkpoint could not be written for want of room: the message names the path and the
    space left on its file system."""


def free_bytes(path: Path) -> int | None:
    """The bytes free (to this user) on the file system of ``path`` or its nearest existing
    parent; None when none can be asked."""
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError):
            if folder.exists():
                return shutil.disk_usage(folder).free
    return None


def size_text(n: float) -> str:
    """Bytes as a person reads them (decimal units: 10.5 MB)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def disk_full(path: Path, exc: OSError) -> DiskFull:
    """The :class:`DiskFull` of a write to ``path`` that failed with ``exc`` (one of
    :data:`NO_ROOM`)."""
    free = free_bytes(path)
    left = "unknown space" if free is None else size_text(free)
    what = "file size limit reached" if exc.errno == errno.EFBIG else "no space left on device"
    return DiskFull(f"{what}: {path}, {left} free")


def no_room(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no room (:data:`NO_ROOM`)."""
    return isinstance(exc, OSError) and exc.errno in NO_ROOM


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """``save_file`` to a temporary name beside ``path``, renamed over it once complete (a
    reader sees the old file or the new one, never half of one); nothing is left on failure."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            if sealing.current() is None:
                save_file(tensors, str(tmp), metadata=meta)
            else:  # sealed: the whole file encrypted (.sealing)
                tmp.write_bytes(sealing.seal(save_bytes(tensors, metadata=meta), _part(path)))
        except SafetensorError as exc:  # its I/O errors come as text: "... (os error 28)"
            found = re.search(r"os error (\d+)", str(exc))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), str(tmp)) from None
        with tmp.open("rb+") as fh:  # a file system that allocates late says ENOSPC here
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stage_file(folder: Path, stage: int) -> Path:
    """The checkpoint of ``stage`` in the checkpoint folder ``folder`` (``stageN.safetensors``;
    ``stageN.pt`` when only a ``torch.save`` file of earlier dmsc is there)."""
    path, legacy = folder / f"stage{stage}.safetensors", folder / f"stage{stage}.pt"
    return legacy if legacy.is_file() and not path.is_file() else path


def replica_file(folder: Path, stage: int, replica: int) -> Path:
    """Where a replica other than 0 saves its stage (a checkpoint of every replica, taken in a
    sync mode's round), beside the Hugging Face files rather than among them."""
    return folder / "replicas" / f"stage{stage}-r{replica}.safetensors"


def optimizer_path(path: Path) -> Path:
    """The optimizer's file of the stage checkpoint ``path``."""
    return path.with_name(path.name.removesuffix(".safetensors") + OPTIM_SUFFIX)


def _prefix(spec: TransformerSpec) -> str:
    return "transformer." if spec.family == "gpt" else ""


def _params(
    spec: TransformerSpec, module: StageModule
) -> list[tuple[torch.nn.Parameter, str, bool]]:
    """Each parameter of ``module`` once, with its checkpoint name and whether it is stored
    transposed (GPT-2's ``Conv1D``)."""
    seen: set[int] = set()
    out = []
    for name, layer in zip(module.names, module.layers, strict=True):
        for param, tensor in layer.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied embedding held twice by one stage
                continue
            seen.add(id(tensor))
            key, transpose = hf_key(spec, name, param, _prefix(spec))
            out.append((tensor, key, transpose))
    return out


def _store(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    t = t.detach()
    return (t.t() if transpose and t.dim() == 2 else t).to("cpu", torch.float32).contiguous()


def write_checkpoint(
    path: Path,
    spec: TransformerSpec,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
    steps: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Write the stage's weights to ``path`` and its optimizer's state beside it (with
    ``extra`` tensors: a sync mode's round state, under names no weight has); the names of
    the weights written. :class:`DiskFull` when there is no room (nothing is left behind)."""
    try:
        return _write(path, spec, module, optimizer, steps, extra)
    except OSError as exc:
        if no_room(exc):
            raise disk_full(path, exc) from None
        raise


def _write(
    path: Path,
    spec: TransformerSpec,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
    steps: int,
    extra: dict[str, torch.Tensor] | None,
) -> list[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    params = _params(spec, module)
    weights = {key: _store(p, tr) for p, key, tr in params}
    names = {id(p): (key, tr) for p, key, tr in params}
    moments: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            key, tr = names[id(p)]
            for slot, value in optimizer.state.get(p, {}).items():
                value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                moments[f"{key}.{slot}"] = _store(value, tr)
    moments.update({k: v.contiguous() for k, v in (extra or {}).items()})
    meta = {"format": "pt", "steps": str(steps), "param_groups": json.dumps(groups)}
    _save_atomic(moments, optimizer_path(path), meta)
    try:
        _save_atomic(weights, path, {"format": "pt"})
    except BaseException:  # the pair or nothing
        optimizer_path(path).unlink(missing_ok=True)
        raise
    return sorted(weights)


def checkpoint_sha256(path: Path) -> str:
    """The digest of the stage checkpoint ``path``: its weights and optimizer files together
    (the weights file alone for a checkpoint written by ``torch.save``)."""
    digest = hashlib.sha256()
    for file in (path, optimizer_path(path)):
        if file.is_file():
            with file.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(path: Path, sha256: str = "") -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a checkpoint whose digest is ``sha256``
    (any when ``sha256`` is empty)."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if sha256 and checkpoint_sha256(path) != sha256:
        raise CheckpointError("checkpoint fails its hash")


@dataclass
class StageState:
    """A stage checkpoint as read, nothing loaded yet."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor]
    steps: int
    param_groups: list[dict[str, Any]]
    legacy: dict[str, Any] = field(default_factory=dict)  # a torch.save file's contents


def _read_legacy(path: Path) -> StageState:
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises what its unpickler met: EOF, pickle, zip, runtime
        raise CheckpointError(f"checkpoint cannot be read ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "steps"} <= state.keys():
        raise CheckpointError("checkpoint lacks model, optimizer or steps")
    return StageState({}, {}, int(state["steps"]), [], legacy=state)


def _part(path: Path) -> str:
    """Which of a stage checkpoint's two files ``path`` is (a sealed file's additional data)."""
    return "optimizer" if path.name.endswith(OPTIM_SUFFIX) else "weights"


def _read_sealed(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and metadata of ``path`` when it is sealed (None: a plain file)."""
    with path.open("rb") as fh:
        if not sealing.sealed(fh.read(len(sealing.MAGIC))):
            return None
        blob = sealing.MAGIC + fh.read()
    try:
        data = sealing.unseal(blob, _part(path), path.name)
        # the safetensors header: its length (8 bytes, little-endian), then JSON
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        return load_bytes(data), header.get("__metadata__") or {}
    except (sealing.SealError, SafetensorError, ValueError) as exc:
        raise CheckpointError(str(exc)[:300]) from None


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        if (opened := _read_sealed(path)) is not None:
            return opened
        with safe_open(str(path), "pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata() or {}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name} cannot be read ({exc})"[:300]) from None


def read_state(path: Path) -> StageState:
    """The checkpoint at ``path`` (nothing is loaded yet); :class:`CheckpointError` when its
    files cannot be read as one."""
    try:
        with path.open("rb") as fh:
            legacy = fh.read(2) == b"PK"  # a zip: torch.save's format
    except OSError as exc:
        raise CheckpointError(f"checkpoint cannot be read ({exc})") from None
    if legacy:
        return _read_legacy(path)
    weights, _ = _read_file(path)
    moments, meta = _read_file(optimizer_path(path))
    try:
        steps = int(meta["steps"])
        groups = json.loads(meta["param_groups"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{optimizer_path(path).name} lacks steps or settings ({exc})"
        ) from None
    return StageState(weights, moments, steps, groups)


def checkpoint_keys(spec: TransformerSpec, module: StageModule) -> set[str]:
    """The names of the tensors a checkpoint of ``module`` holds (its weights)."""
    return {key for _, key, _ in _params(spec, module)}


def read_states(path: Path, others: dict[str, str], needed: set[str]) -> StageState:
    """The checkpoint at ``path``; when it lacks some of the ``needed`` weights, with the
    tensors it lacks from the same checkpoint's other stage files (path -> SHA-256, each
    verified first): the weights and moments a stage cut otherwise finds there (an interleaved
    stage's chunks lie in several files of a plain checkpoint, and the other way round). The
    steps and settings are ``path``'s."""
    state = read_state(path)
    if state.legacy or needed <= state.weights.keys():
        return state
    for other, sha in sorted(others.items()):
        if Path(other) == path:
            continue
        verify_checkpoint(Path(other), sha)
        more = read_state(Path(other))
        for key, t in more.weights.items():
            state.weights.setdefault(key, t)
        for key, t in more.moments.items():
            state.moments.setdefault(key, t)
    return state


def load_state(
    state: StageState,
    spec: TransformerSpec,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load a state read by :func:`read_state` into ``module`` and ``optimizer`` (gradients
    cleared); the steps done. Every tensor is checked before any is loaded."""
    if state.legacy:
        try:
            module.load_state_dict(state.legacy["model"])
            optimizer.load_state_dict(state.legacy["optimizer"])
        except (RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint does not fit this stage: {exc}"[:500]) from None
        optimizer.zero_grad(set_to_none=True)
        return state.steps
    params = _params(spec, module)
    for p, key, tr in params:
        have = state.weights.get(key)
        want = list(p.t().shape if tr else p.shape)
        if have is None or list(have.shape) != want:
            found = "missing" if have is None else f"of shape {list(have.shape)}"
            raise CheckpointError(
                f"checkpoint does not fit this stage: tensor {key!r} {found}, the stage has {want}"
            )
    order = {id(p): n for n, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
    if len(state.param_groups) != len(optimizer.param_groups):
        raise CheckpointError("checkpoint does not fit this stage: another optimizer")
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for p, key, tr in params:
        held = {
            name.removeprefix(f"{key}."): t
            for name, t in state.moments.items()
            if name.startswith(f"{key}.") and "." not in name.removeprefix(f"{key}.")
        }
        # contiguous: PyTorch's fused AdamW (make_optimizer) steps a transposed moment wrongly,
        # without a word (0.25 off in one step of an 8 x 4 weight, torch 2.13 on the CPU)
        slots[order[id(p)]] = {
            s: (t.t().contiguous() if tr and t.dim() == 2 else t) for s, t in held.items()
        }
    groups = [  # JSON made the tuples (AdamW's betas) lists
        {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        | {"params": [order[id(p)] for p in group["params"]]}
        for saved, group in zip(state.param_groups, optimizer.param_groups, strict=True)
    ]
    with torch.no_grad():
        for p, key, tr in params:
            value = state.weights[key]
            p.copy_((value.t() if tr else value).to(p.dtype))
    try:
        kept = {n: v for n, v in slots.items() if v}
        optimizer.load_state_dict({"state": kept, "param_groups": groups})
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint does not fit this stage: {exc}"[:500]) from None
    optimizer.zero_grad(set_to_none=True)
    return state.steps


def read_checkpoint(
    path: Path, spec: TransformerSpec, module: StageModule, optimizer: torch.optim.Optimizer
) -> int:
    """Load ``path`` into ``module`` and ``optimizer`` (gradients cleared); the steps done."""
    return load_state(read_state(path), spec, module, optimizer)
