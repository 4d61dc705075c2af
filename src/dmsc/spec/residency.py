"""Data residency: which datacenters a dataset may be read in, and a model's weights stored in.

A cluster spec's ``residency`` section holds named rules. A rule names datasets (globs over the
resolved path a training task reads, ``fnmatch``: ``*`` crosses ``/``) and models (globs over
the model's name, ``NAME`` for every version, ``NAME@VERSION`` for one), and the datacenters
they may be in. A rule with ``derived: true`` also holds what a training task computes from its
datasets (activations sent forward to every stage, gradients sent back and between replicas)
to those datacenters. Where several rules name the same thing, each must allow the datacenter. The
optional ``home`` is the datacenter that holds the control plane's home folder (``DMSC_HOME``:
its database, the checkpoints the workers save under it, model versions, ``dmsc export``'s
source), so that storing a resident model there is judged too.

Who enforces it: the planner keeps a resident model's stages out of other datacenters (a
constraint of the placement problem, :mod:`dmsc.planner.placement.problem`); the control plane
refuses a training task whose data its reading stages may not read, a checkpoint or export
stored at a forbidden home, and a move of a stage to a forbidden datacenter. The checks here
are pure: they take names and return, or raise :class:`ResidencyError` naming the rule.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(min_length=1, max_length=128)]
Pattern = Annotated[str, Field(min_length=1, max_length=1024)]
_GLOB = "*?["


class ResidencyError(ValueError):
    """A placement, read or store that a residency rule forbids; ``rule`` is its name."""

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        super().__init__(f"residency rule {rule!r}: {message}")


class ResidencyRuleSpec(BaseModel):
    """One rule: these datasets and models stay in these datacenters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = Field(description="What refusals call the rule.")
    datasets: list[Pattern] = Field(
        default_factory=list,
        description="Globs over the absolute paths a training task reads (a folder: its files).",
    )
    models: list[Pattern] = Field(
        default_factory=list,
        description="Globs over model names: NAME (every version) or NAME@VERSION (one version).",
    )
    datacenters: list[Name] = Field(
        min_length=1, description="The datacenters (names) they may be read or stored in."
    )
    derived: bool = Field(
        default=False,
        description=(
            "Hold what is computed from the datasets to the rule too: the activations every "
            "stage of a training task receives and the gradients sent back and between its "
            "replicas, so no stage of a task reading them may run elsewhere."
        ),
    )

    @model_validator(mode="after")
    def _names_something(self) -> Self:
        if not self.datasets and not self.models:
            raise ValueError("a rule names at least one dataset or model")
        if self.derived and not self.datasets:
            raise ValueError("derived: holds data computed from datasets; the rule names none")
        for i, pattern in enumerate(self.datasets):
            if not pattern.startswith("/"):
                raise ValueError(f"datasets[{i}]: {pattern!r} is not an absolute path")
        for i, pattern in enumerate(self.models):
            name, at, version = pattern.partition("@")
            if not name or (at and not version.isdigit()):
                raise ValueError(f"models[{i}]: {pattern!r} is not NAME or NAME@VERSION")
        return self

    def names_model(self, model: str, version: int | None = None) -> bool:
        """Whether the rule covers ``model`` (at ``version``; None: at any version, as for the
        planner, which places a model before its versions exist)."""
        for pattern in self.models:
            name, _, at = pattern.partition("@")
            if fnmatch.fnmatchcase(model, name) and (
                not at or version is None or int(at) == version
            ):
                return True
        return False

    def names_dataset(self, path: str) -> bool:
        """Whether reading ``path`` (absolute, resolved) reads a dataset of the rule: the path or
        a folder above it matches, or the rule's dataset lies inside the folder ``path``."""
        target = PurePosixPath(path)
        for pattern in self.datasets:
            if any(fnmatch.fnmatchcase(str(p), pattern) for p in (target, *target.parents)):
                return True
            literal = pattern[: min((pattern.find(c) for c in _GLOB if c in pattern),
                                    default=len(pattern))]  # fmt: skip
            if PurePosixPath(literal.rstrip("/") or "/").is_relative_to(target):
                return True
        return False


class ResidencySpec(BaseModel):
    """The residency rules of a cluster, and where its control plane keeps its files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Name | None = Field(
        default=None,
        description=(
            "The datacenter holding the control plane's home folder (its database, "
            "checkpoints, model versions, exports)."
        ),
    )
    rules: list[ResidencyRuleSpec] = Field(default_factory=list)

    def model_rules(self, model: str, version: int | None = None) -> list[ResidencyRuleSpec]:
        return [r for r in self.rules if r.names_model(model, version)]

    def dataset_rules(self, path: str) -> list[ResidencyRuleSpec]:
        return [r for r in self.rules if r.names_dataset(path)]


def first_breach(
    rules: Iterable[ResidencyRuleSpec], datacenters: Iterable[str]
) -> tuple[ResidencyRuleSpec, str] | None:
    """The first (rule, datacenter) of ``datacenters`` that a rule does not allow, or None."""
    dcs = list(datacenters)
    for rule in rules:
        for dc in dcs:
            if dc not in rule.datacenters:
                return rule, dc
    return None


def check_model_placement(
    residency: ResidencySpec | None,
    model: str,
    datacenters: Iterable[str],
    what: str,
    version: int | None = None,
) -> None:
    """ResidencyError unless every datacenter in ``datacenters`` may hold ``model``'s weights;
    ``what`` says what would put them there (a move, a plan)."""
    if residency is None:
        return
    breach = first_breach(residency.model_rules(model, version), datacenters)
    if breach is not None:
        rule, dc = breach
        raise ResidencyError(
            rule.name,
            f"{what} would put weights of model {model} in datacenter {dc}; it allows "
            f"{', '.join(rule.datacenters)}",
        )


def check_model_store(
    residency: ResidencySpec | None, model: str, what: str, version: int | None = None
) -> None:
    """ResidencyError when storing ``model`` (a checkpoint, a version, an export) in the home
    folder puts it in a datacenter a rule does not allow (nothing to judge without ``home``)."""
    if residency is not None and residency.home is not None:
        check_model_placement(residency, model, [residency.home], what, version)


def check_dataset_read(
    residency: ResidencySpec | None,
    path: str,
    datacenters: Iterable[str],
    what: str,
    carrying: Iterable[str] = (),
) -> None:
    """ResidencyError unless every datacenter in ``datacenters`` may read the data at ``path``
    and, for a rule that holds derived data, every one in ``carrying`` (where the task's
    activations and gradients go) may hold them."""
    if residency is None:
        return
    rules = residency.dataset_rules(path)
    breach = first_breach(rules, datacenters)
    if breach is not None:
        rule, dc = breach
        raise ResidencyError(
            rule.name,
            f"{what} would read {path} in datacenter {dc}; it allows {', '.join(rule.datacenters)}",
        )
    breach = first_breach([r for r in rules if r.derived], carrying)
    if breach is not None:
        rule, dc = breach
        raise ResidencyError(
            rule.name,
            f"{what} would carry activations and gradients of {path} into datacenter {dc}; "
            f"it allows {', '.join(rule.datacenters)} (derived: true)",
        )


def allowed_datacenters(
    residency: ResidencySpec | None, model: str, datacenters: Iterable[str]
) -> tuple[frozenset[str], tuple[str, ...]]:
    """The datacenters of ``datacenters`` that may hold ``model``'s weights (every version), and
    the names of the rules that remove one."""
    names = list(datacenters)
    if residency is None:
        return frozenset(names), ()
    allowed, binding = set(names), []
    for rule in residency.model_rules(model):
        kept = allowed & set(rule.datacenters)
        if kept != allowed:
            binding.append(rule.name)
        allowed = kept
    return frozenset(allowed), tuple(binding)


RECORD = "residency.json"  # in the control plane's home: the rules of the cluster it runs on


def record_residency(home: Path, residency: ResidencySpec | None) -> None:
    """Keep ``residency`` in ``home`` (``dmsc up --cluster``) for the commands that store the
    model's weights without the control plane (``dmsc export``); none: the record goes."""
    path = home / RECORD
    if residency is None:
        path.unlink(missing_ok=True)
        return
    path.write_text(residency.model_dump_json(indent=2))


def recorded_residency(home: Path) -> ResidencySpec | None:
    """The rules ``dmsc up`` recorded in ``home``, or None."""
    path = home / RECORD
    if not path.exists():
        return None
    return ResidencySpec.model_validate_json(path.read_text())
