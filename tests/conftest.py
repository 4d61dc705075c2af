"""Shared test fixtures and the rules that sort the tests.

- The example clusters (``selene``, ``nsfnet``, ``local_cpu``).
- :func:`run_dmsc`, the ``dmsc`` command as a user runs it (a real process, its output and exit
  code; forked from a server that imported the CLI once: :mod:`cli_fork`), and the ``dmsc``
  fixture: the same with a data directory (``DMSC_HOME``) of the test's own.
- Markers (registered in ``pyproject.toml``): ``integration`` for tests that start processes or
  services, ``chaos`` for fault injection. Test modules of this tree mark themselves; the folders
  listed in :data:`MARKED_BY_PATH` are marked here, by path. ``pytest -m "not integration"`` is
  the quick run.
- PostgreSQL: a test that needs the server (its name says ``postgresql``, or it is marked
  ``postgresql``, or it asks for the ``postgres_url`` fixture) is skipped when
  ``DMSC_TEST_POSTGRES_URL`` is not set. ``make test`` always sets it (``scripts/postgres.sh``).
- Under ``pytest -n N``, torch computes on one N-th of the cores in each test process
  (:func:`pytest_configure`).
- A browser: the ``chromedriver`` fixture (Debian's Chromium driven by Selenium) skips its test
  when ``DMSC_TEST_CHROMEDRIVER`` is not set; ``make test`` always sets it (``scripts/browser.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cli_fork
import pytest
from xdist.scheduler import LoadScopeScheduling

from dmsc.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "clusters"

POSTGRES_ENV = "DMSC_TEST_POSTGRES_URL"
NO_POSTGRES = f"{POSTGRES_ENV} is not set: `make test` starts a server (scripts/postgres.sh)"

# Markers of tests in folders whose files are marked from here: a path relative to tests/ (a
# folder or a module) and the markers of every test under it.
MARKED_BY_PATH: dict[str, tuple[str, ...]] = {
    "chaos": ("chaos", "integration"),
    "integration": ("integration",),
    # Modules that start worker processes.
    "runtime/compute/test_worker.py": ("integration",),
    "runtime/control/launch/test_launchers.py": ("integration",),
}

# The tests that take longest (a minute or more of a CI run on 2 cores: the durations pytest prints)
LONG_FIRST = (
    "tests/integration/test_readme_examples.py::test_live_examples",
    "tests/integration/test_ray_private.py",
    "tests/integration/test_ray.py",
    "tests/cli/test_cli.py::test_demo_runs",
    "tests/chaos/test_control_plane_faults.py",
)

# Modules whose tests share an expensive module fixture (a Ray cluster, a pair of rank processes):
# under ``pytest -n 2 --dist loadgroup`` each runs whole on one pytest process, as the scheduler
# below groups them, or both processes would start the fixture. pytest-xdist's own
# ``xdist_group`` marker groups nothing with pytest 9.2: its worker renames ``item._nodeid``,
# which pytest 9.2's ``nodeid`` no longer reads (checked: every test of a marked module ran on
# either process, and its module fixture started on both).
ONE_PROCESS = (
    "tests/integration/test_ray.py",
    "tests/runtime/compute/test_tensor_parallel.py",
    "tests/runtime/compute/test_vocab_parallel.py",
    "tests/runtime/compute/test_sequence_parallel.py",
    "tests/runtime/compute/test_expert_parallel.py",
)

DmscRunner = Callable[..., "subprocess.CompletedProcess[str]"]

if cli_fork.wanted():  # the server this process forks from imports the CLI when it starts
    cli_fork.add_preload()


def run_dmsc(
    *args: str, home: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dmsc ARGS`` in the repository root, with ``DMSC_HOME=home`` when given
    (else the caller's environment), and return its exit code and captured output."""
    env = {**os.environ, "DMSC_HOME": str(home)} if home is not None else None
    if cli_fork.wanted():  # forked from a server that imported the CLI once (tests/cli_fork.py)
        return cli_fork.run(list(args), env or dict(os.environ), str(ROOT), timeout)
    return subprocess.run(
        [sys.executable, "-m", "dmsc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture
def dmsc_home(tmp_path: Path) -> Path:
    """The data directory of one test's ``dmsc`` commands."""
    home = tmp_path / "dmsc-home"
    home.mkdir()
    return home


@pytest.fixture
def dmsc(dmsc_home: Path) -> DmscRunner:
    """``dmsc(*args, timeout=300)``: :func:`run_dmsc` with the test's own ``DMSC_HOME``."""

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run_dmsc(*args, home=dmsc_home, timeout=timeout)

    return run


@pytest.fixture
def postgres_url() -> str:
    """The URL of the PostgreSQL server of the tests (the test is skipped without one)."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(NO_POSTGRES)
    return url


CHROMEDRIVER_ENV = "DMSC_TEST_CHROMEDRIVER"


@pytest.fixture(scope="session")
def chromedriver() -> str:
    """The path of Chromium's WebDriver (``scripts/browser.sh`` installs it)."""
    path = os.environ.get(CHROMEDRIVER_ENV)
    if not path:
        pytest.skip(f"{CHROMEDRIVER_ENV} is not set: `make test` installs it (scripts/browser.sh)")
    return path


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N``, torch in each test process computes on its share of the cores
    (one thread with ``-n 2`` on 2 cores): the processes' threads would otherwise outnumber the
    cores, and torch's threads waiting on each other then burn the time (a single-process
    reference of 10 training steps took 88 s with 2 threads beside the other test process and
    its workers, 7.5 s with 1). Stage workers set their own (one by default)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.path)).resolve()
        rel = path.relative_to(tests).as_posix() if path.is_relative_to(tests) else ""
        for prefix, markers in MARKED_BY_PATH.items():
            if rel == prefix or rel.startswith(prefix + "/"):
                for name in markers:
                    item.add_marker(name)
        needs_postgres = "postgresql" in item.name or item.get_closest_marker("postgresql")
        if needs_postgres and not os.environ.get(POSTGRES_ENV):
            item.add_marker(pytest.mark.skip(reason=NO_POSTGRES))

    # The longest first, so that under -n 2 the other process runs the rest beside them instead
    # of one of them running alone at the end (the same order in every process, as xdist needs).
    def rank(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), 99)

    items.sort(key=rank)


def unit_of(nodeid: str) -> str:
    """The unit of work a test goes in: its module's, for a module of :data:`ONE_PROCESS`."""
    module = nodeid.partition("::")[0]
    return module if module in ONE_PROCESS else nodeid


class ByModule(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's scheduling by scope, each test its own scope but as :func:`unit_of` says."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` as xdist schedules it (the tests handed out in the collection's
    order), with the tests of each module of :data:`ONE_PROCESS` one unit of work."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return ByModule(config, log)


def three_cpu_hosts() -> ClusterSpec:
    """One datacenter of three nodes with two CPU devices each (the elastic placement tests)."""
    return ClusterSpec.model_validate(
        {
            "name": "three-hosts",
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
            },
            "node_types": {
                "host": {"device": "cpu", "devices": 2, "link": {"bandwidth_gbit_s": 40}}
            },
            "datacenters": [
                {
                    "name": "dc",
                    "nodes": [{"type": "host", "count": 3}],
                    "network": {"gbit_s_per_node": 10},
                }
            ],
        }
    )


@pytest.fixture(scope="session")
def selene() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "a100-selene.yaml")


@pytest.fixture(scope="session")
def nsfnet() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "nsfnet-4dc.yaml")


@pytest.fixture(scope="session")
def local_cpu() -> ClusterSpec:
    return load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml")
