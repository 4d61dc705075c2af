"""Checkpoint files of one stage: its module's and optimizer's state, checked by SHA-256.

``Save`` writes ``{"model", "optimizer", "steps"}`` with ``torch.save`` and answers the file's
SHA-256; the control plane keeps the digest (in a ``Checkpoint`` or a model version) and hands it
back on ``Load``, which refuses a file that fails it before anything is loaded. Files are read
with ``weights_only=True``: a checkpoint never runs code. A file that cannot be read, or does not
fit the stage, is refused the same way (:class:`CheckpointError`): the control plane then falls
back to an older checkpoint (:mod:`dmsc.runtime.control.fallback`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded: missing, or not the file its hash names."""


def write_checkpoint(
    path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int
) -> None:
    """Write ``module``'s and ``optimizer``'s state and the steps done to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "steps": steps}
    torch.save(state, path)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_checkpoint(path: Path, sha256: str = "") -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a file whose hash is ``sha256`` (any
    file when ``sha256`` is empty)."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if sha256 and file_sha256(path) != sha256:
        raise CheckpointError("checkpoint fails its hash")


def read_state(path: Path) -> dict[str, object]:
    """The state saved in ``path`` (nothing is loaded yet); :class:`CheckpointError` when the file
    cannot be read as a checkpoint."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises what its unpickler met: EOF, pickle, zip, runtime
        raise CheckpointError(f"checkpoint cannot be read ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "steps"} <= state.keys():
        raise CheckpointError("checkpoint lacks model, optimizer or steps")
    return state


def load_state(
    state: dict[str, object], module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load a state read by :func:`read_state` into ``module`` and ``optimizer``
    (gradients cleared); the steps done."""
    try:
        module.load_state_dict(state["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        steps = int(state["steps"])  # type: ignore[call-overload]
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint does not fit this stage: {exc}"[:500]) from None
    optimizer.zero_grad(set_to_none=True)
    return steps


def read_checkpoint(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``path`` into ``module`` and ``optimizer`` (gradients cleared); the steps done."""
    return load_state(read_state(path), module, optimizer)
