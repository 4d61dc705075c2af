"""A replica's own training text (``LoadShard``): read from its machine's disk, never sent.

The first and last stages of a replica that trains on local data hold its datacenter's part of a
task's files (:mod:`dmsc.runtime.control.training.local_data` decides which) and draw each step's
batch from it by step and replica, so the text never leaves the worker: tokens at the first
stage, targets at the last, into the worker's own inbox.
"""

from __future__ import annotations

import threading
from pathlib import Path

from dmsc.data.corpus import Corpus
from dmsc.data.shards import read_shard
from dmsc.runtime.compute.inbox import Inbox
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind


class LocalShard:
    """The text a first or last stage keeps, and the batches it draws from it."""

    def __init__(self, seq: int, replica: int, first: bool, last: bool) -> None:
        self.seq, self.replica, self.first, self.last = seq, replica, first, last
        self.corpus: Corpus | None = None
        self._lock = threading.Lock()

    def load(self, files: list[str], seed: int) -> int:
        """Read ``files`` (a middle stage keeps nothing); the bytes read."""
        if not (self.first or self.last):
            return 0
        try:
            data = read_shard([Path(f) for f in files])
            corpus = Corpus(data, self.seq, seed=seed * 1_000_003 + self.replica + 1)
        except ValueError as exc:
            raise BadRequest(f"shard: {exc}") from None
        with self._lock:
            self.corpus = corpus
        return len(data)

    def feed(self, inbox: Inbox, step: int, batch: int, microbatches: int, epoch: int) -> None:
        """This replica's ``batch`` samples of ``step``, cut into ``microbatches``, into
        ``inbox`` (tokens at the first stage, targets at the last)."""
        if not (self.first or self.last):
            return
        if self.corpus is None:
            raise BadRequest("local data: this worker holds no shard (LoadShard first)")
        x, y = self.corpus.batch(step, batch)
        for kind, t, here in ((Kind.TOKENS, x, self.first), (Kind.TARGETS, y, self.last)):
            if here:
                inbox.put(kind, step, 0, t, epoch, microbatches)
