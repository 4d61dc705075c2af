"""Each site's own part of a training corpus: a partition of its files, with a chosen skew.

Federated and cross-datacenter training keep data where it is: each datacenter's replicas read
their shard from their own disk (``LoadShard``) and no text crosses the network. A shard is a
set of whole files. ``skew`` 0 deals the files out at random (each site sees the same mix);
``skew`` 1 gives each site a contiguous run of the files in path order (a directory of topics
becomes one topic per site: the non-IID case that FedProx and robust aggregation are for); in
between, each file goes to its run's site with probability ``skew``, else to a random one.
"""

from __future__ import annotations

import random
from pathlib import Path

from dmsc.data.corpus import MAX_DATA_BYTES, text_files
from dmsc.spec.files import TooLarge, read_bounded


def shard_files(files: list[Path], sites: int, skew: float, seed: int = 0) -> list[list[Path]]:
    """``files`` split among ``sites`` (none empty); ValueError when there are fewer files than
    sites or the skew is outside [0, 1]."""
    if sites < 1:
        raise ValueError(f"sites: {sites}, at least 1")
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew: {skew}, must lie in [0, 1]")
    if len(files) < sites:
        raise ValueError(f"{len(files)} files for {sites} sites: each site needs one at least")
    ordered = sorted(files)
    rng = random.Random(seed)
    shards: list[list[Path]] = [[] for _ in range(sites)]
    for i, f in enumerate(ordered):
        home = i * sites // len(ordered)  # the contiguous run this file belongs to
        shards[home if rng.random() < skew else rng.randrange(sites)].append(f)
    for shard in shards:  # a site left empty takes a file from the largest
        if not shard:
            donor = max(shards, key=len)
            shard.append(donor.pop())
    return [sorted(s) for s in shards]


def read_shard(files: list[Path], max_bytes: int = MAX_DATA_BYTES) -> bytes:
    """The bytes of a shard's files, in order; ValueError names a file that cannot be read,
    is not a regular file, or would take the shard past ``max_bytes`` (checked before it is
    read)."""
    out, total = [], 0
    for f in files:
        try:
            data = read_bounded(f, max_bytes - total)
        except TooLarge:
            raise ValueError(f"{f}: more than the {max_bytes:,} bytes a shard may hold") from None
        total += len(data)
        out.append(data)
    return b"".join(out)


def training_files(path: Path) -> list[Path]:
    """The files of a task's data directory that shards are made of: its training part (the
    last tenth of the files is held out for validation, as :func:`text_from` does)."""
    files = text_files(path)
    if len(files) < 2:
        raise ValueError(f"{path}: local data needs a directory of several files")
    cut = min(len(files) - 1, max(1, round(len(files) * 0.9)))
    return files[:cut]
