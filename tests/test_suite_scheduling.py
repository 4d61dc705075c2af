"""The suite's own scheduling under ``pytest -n 2 --dist loadgroup`` (``conftest``): each module of
``ONE_PROCESS`` is one unit of work, so its expensive module fixture (a Ray cluster, a pair of
rank processes) starts once; every other test is a unit of its own. pytest-xdist's
``xdist_group`` marker grouped nothing with pytest 9.2, so before this both processes started
the Ray cluster and each pair of rank processes."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
from xdist.scheduler import LoadGroupScheduling


def test_the_modules_that_share_a_fixture_are_one_unit_each() -> None:
    ray = "tests/integration/test_ray.py"
    assert set(conftest.ONE_PROCESS) >= {ray, "tests/runtime/compute/test_tensor_parallel.py"}
    for module in conftest.ONE_PROCESS:
        a, b = f"{module}::test_a[x]", f"{module}::Case::test_b"
        assert conftest.unit_of(a) == conftest.unit_of(b) == module
        assert conftest.ByModule._split_scope(None, a) == module
    other = "tests/integration/test_pipeline.py::test_one"
    assert conftest.unit_of(other) == other


def test_loadgroup_is_scheduled_by_module_and_other_modes_as_xdist_does() -> None:
    assert issubclass(conftest.ByModule, LoadGroupScheduling.__mro__[1])  # xdist's by-scope one
    config = SimpleNamespace(getvalue={"dist": "load"}.get)
    assert conftest.pytest_xdist_make_scheduler(config, None) is None  # type: ignore[arg-type]
