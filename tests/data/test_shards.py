"""Each site's part of a task's files: a partition, none empty, as skewed as asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.data.shards import read_shard, shard_files, training_files

FILES = [Path(f"/data/{i:03d}.txt") for i in range(60)]


@pytest.mark.parametrize("skew", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("sites", [1, 2, 3, 7])
def test_every_file_goes_to_exactly_one_site_and_none_is_empty(skew: float, sites: int) -> None:
    shards = shard_files(FILES, sites, skew, seed=3)
    assert len(shards) == sites and all(shards)
    assert sorted(f for s in shards for f in s) == sorted(FILES)


def test_full_skew_gives_each_site_a_contiguous_run() -> None:
    shards = shard_files(FILES, 3, 1.0)
    assert shards == [FILES[:20], FILES[20:40], FILES[40:]]


def test_no_skew_mixes_the_runs() -> None:
    """At skew 0 a site's files come from every run (each run is a third of the files)."""
    for shard in shard_files(FILES, 3, 0.0, seed=1):
        runs = {FILES.index(f) * 3 // len(FILES) for f in shard}
        assert runs == {0, 1, 2}


def test_the_same_seed_gives_the_same_shards() -> None:
    assert shard_files(FILES, 4, 0.3, seed=9) == shard_files(FILES, 4, 0.3, seed=9)


@pytest.mark.parametrize(
    ("files", "sites", "skew", "reason"),
    [(FILES[:2], 3, 0.0, "2 files for 3 sites"), (FILES, 2, 1.5, "skew"), (FILES, 0, 0, "sites")],
)
def test_impossible_shards_are_refused_with_a_reason(files, sites, skew, reason) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=reason):
        shard_files(files, sites, skew)


def test_a_shard_is_read_in_order_and_a_missing_file_is_named(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"one ")
    b.write_bytes(b"two")
    assert read_shard([a, b]) == b"one two"
    with pytest.raises(ValueError, match="gone"):
        read_shard([a, tmp_path / "gone"])
    with pytest.raises(ValueError, match="bytes a shard"):
        read_shard([a, b], max_bytes=5)


def test_the_held_out_tenth_is_not_shared_out(tmp_path: Path) -> None:
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(str(i))
    assert [p.name for p in training_files(tmp_path)] == [f"{i}.txt" for i in range(9)]
    with pytest.raises(ValueError, match="several files"):
        training_files(tmp_path / "0.txt")
