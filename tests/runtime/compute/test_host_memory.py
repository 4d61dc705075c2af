"""Freed host memory kept in the process: a step's temporaries reuse their pages.

Reference: the kernel's own count of minor page faults (``getrusage``) of a fresh Python process
allocating and freeing the same 64 MB tensor on a thread, as a worker's gRPC handler does, with
glibc's defaults and after :func:`keep_freed_memory`, round after round of a loop."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from dmsc.runtime.compute import host_memory

pytestmark = pytest.mark.integration  # fresh processes: the setting is for a whole process

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, threading
    import torch
    from dmsc.runtime.compute.host_memory import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    torch.set_num_threads(1)
    faults = []
    def run():
        x = torch.ones(16 << 20)  # 64 MB: past the 32 MB glibc ever serves from a heap
        for _ in range(6):  # the first rounds grow the heap to what the loop needs
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(5):
                y = x * 2.0
                del y
            faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    print(json.dumps({"kept": kept, "faults": faults}))
    """
)


def _faults(mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_a_threads_temporaries_reuse_their_pages_once_memory_is_kept() -> None:
    default, kept = _faults("default"), _faults("keep")
    assert default["kept"] is None
    if platform.libc_ver()[0] != "glibc":  # nothing to set: it says so, and that is all
        assert kept["kept"] is False
        return
    assert kept["kept"] is True
    pages = (64 << 20) // 4096
    # glibc's defaults: every 64 MB tensor is mapped afresh and each of its pages faults in
    assert all(f >= pages for f in default["faults"]), default  # type: ignore[attr-defined]
    # kept: once the heap has grown (the first rounds), the same pages again
    assert all(f < 4 for f in kept["faults"][3:]), kept  # type: ignore[index]


def test_elsewhere_than_glibc_or_when_asked_nothing_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DMSC_ALLOCATOR", "default")
    assert host_memory.keep_freed_memory() is False  # (this process's allocator left alone)
    monkeypatch.delenv("DMSC_ALLOCATOR")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_memory.keep_freed_memory() is False
