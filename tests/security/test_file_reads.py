"""Files a user names are read within bounds (issue 29, item 12): a training task's data, a
worker's shard and a checkpoint's files are regular files of a bounded size, checked before the
read starts; ``/dev/zero``, a FIFO or a symlink to either is refused at once with the path and
the reason, never read without end. Each probe runs in a child process whose address space is
capped (4 GiB) and which has 60 s, so a read without a bound fails the test without harming the
machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CAP = 4 << 30


# The child caps itself as its first statement. A ``preexec_fn`` would do it between fork and
# exec, which makes subprocess fork rather than vfork and so runs gRPC's fork handlers in the
# child of a pytest worker that has used gRPC: once in a clean-clone CI they aborted it (SIGABRT,
# "epoll_wait error: Bad file descriptor") before the probe ran.
_CAP_FIRST = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))\n"


def _probe(code: str) -> str:
    """Run ``code`` in a capped child; its stdout (it must exit 0)."""
    res = subprocess.run(
        [sys.executable, "-c", _CAP_FIRST + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_training_data_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello " * 100)
    (tmp_path / "docs" / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.data.corpus import text_from
        for p in ("/dev/zero", "{tmp_path}/fifo", "{tmp_path}/docs"):
            try:
                text_from(Path(p))
                print("READ", p)
            except ValueError as exc:
                print("REFUSED", exc)
        """
    )
    lines = out.splitlines()
    assert len(lines) == 3 and all(line.startswith("REFUSED") for line in lines), out
    assert "/dev/zero: not a regular file" in lines[0]
    assert "fifo: not a regular file" in lines[1]
    assert "zero.txt: leads to /dev/zero, outside" in lines[2]


def test_training_data_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as fh:  # sparse: 3 GiB by its size, nothing on disk
        fh.truncate(3 << 30)
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.data.corpus import text_from
        from dmsc.data.shards import read_shard
        try:
            text_from(Path("{big}"), max_bytes=1 << 20)
        except ValueError as exc:
            print("REFUSED", exc)
        try:
            read_shard([Path("{big}")], max_bytes=1 << 20)
        except ValueError as exc:
            print("REFUSED", exc)
        """
    )
    lines = out.splitlines()
    assert len(lines) == 2 and all("more than the 1,048,576" in line for line in lines), out


def test_a_shard_of_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "z").symlink_to("/dev/zero")
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.data.shards import read_shard
        for files in (["/dev/zero"], ["{tmp_path}/z"]):
            try:
                read_shard([Path(f) for f in files])
                print("READ")
            except ValueError as exc:
                print("REFUSED", exc)
        """
    )
    assert out.count("REFUSED") == 2 and out.count("not a regular file") == 2, out


def test_a_checkpoint_file_linked_to_dev_zero_is_refused_when_hashed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (ckpt / "model.safetensors").symlink_to("/dev/zero")
    os.mkfifo(ckpt / "model-2.safetensors")
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.spec.errors import SpecError
        from dmsc.spec.hf import checkpoint_sha256
        try:
            checkpoint_sha256(Path("{ckpt}"))
            print("HASHED")
        except SpecError as exc:
            print("REFUSED", exc)
        """
    )
    assert out.startswith("REFUSED") and "model.safetensors" in out, out
    assert "leads to /dev/zero, outside" in out
    (ckpt / "model.safetensors").unlink()  # the FIFO alone
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.spec.errors import SpecError
        from dmsc.spec.hf import checkpoint_sha256
        try:
            checkpoint_sha256(Path("{ckpt}"))
        except SpecError as exc:
            print("REFUSED", exc)
        """
    )
    assert out.startswith("REFUSED") and "model-2.safetensors: not a regular file" in out, out


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_checkpoint_side_file_that_is_a_device_is_refused(tmp_path: Path, name: str) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if name != "config.json":
        (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (ckpt / name).symlink_to("/dev/zero")
    out = _probe(
        f"""
        from pathlib import Path
        from dmsc.spec.errors import SpecError
        from dmsc.spec.hf import checkpoint_sha256, read_config
        try:
            read_config(Path("{ckpt}"))
            checkpoint_sha256(Path("{ckpt}"))
            print("READ")
        except SpecError as exc:
            print("REFUSED", exc)
        """
    )
    assert out.startswith("REFUSED") and name in out and "leads to /dev/zero, outside" in out, out


def test_the_probes_child_is_capped() -> None:
    out = _probe("import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0])")
    assert int(out) == CAP
