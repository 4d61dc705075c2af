"""Shared fixtures: the example clusters."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "clusters"


@pytest.fixture(scope="session")
def selene() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "a100-selene.yaml")


@pytest.fixture(scope="session")
def nsfnet() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "nsfnet-4dc.yaml")


@pytest.fixture(scope="session")
def local_cpu() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml")
