"""Logs across Ray nodes: what ``dmsc logs --grep`` finds on the machines the workers run on.

A worker started by :class:`~.ray_launcher.RayLauncher` writes its log where it runs
(``<home>/logs/<SID>.log`` and ``.stderr`` on its node), out of reach of a ``dmsc logs`` reading
the control plane's machine. So:

- each node's host actor searches its node's log folder as ``dmsc logs`` would
  (:func:`node_entries`, the same :func:`~dmsc.runtime.transport.log_search.search`, with the
  pattern, the time and the services asked for) and says which machine it read them on;
- the control plane asks one live host actor per node (:func:`gather`; all nodes at once, each
  with a deadline: a node that does not answer is named, not waited for) and keeps the lines of
  other machines only, unless asked for every node: the files of its own machine are the ones
  ``dmsc logs`` reads itself, and several Ray nodes on one machine share them;
- the CLI merges what the control plane sent with its own files, in time order
  (:func:`merged`);
- the control loop's symptom alerts see other machines' lines too (:func:`symptom_lines`): each
  node's host actor keeps its place in its node's files (:class:`NodeTail`) and sends only the
  new lines that show a failure.

A machine is its host name and the kernel's boot id (:func:`machine`): two Ray nodes with the
same pair read the same files.
"""

from __future__ import annotations

import heapq
import importlib
import re
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dmsc.runtime.transport.log_search import Entry, LogTail, search, symptom_of
from dmsc.runtime.transport.logs import log_dir

ASK_TIMEOUT_S = 10.0  # a node that has not answered by then is named as unreachable


def machine() -> str:
    """This machine: its host name and the boot it runs in (Linux's boot id, where there is
    one), so that nodes sharing a file system are seen as one."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        boot_id = boot.read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def node_entries(
    home: Path, pattern: str | None, since_s: float | None, services: list[str] | None
) -> dict[str, Any]:
    """The matching lines of this node's logs under ``home`` (run in a host actor)."""
    found = search(
        log_dir(home), re.compile(pattern) if pattern is not None else None, since_s, services
    )
    return {"machine": machine(), "entries": [[e.service, e.ts, e.line] for e in found]}


def _ask_nodes(
    processes: Iterable[Any], call: Callable[[Any], Any], everywhere: bool, timeout_s: float
) -> tuple[list[list[Entry]], list[str]]:
    """``call`` (an actor -> an object ref of a :func:`node_entries`-shaped answer) on one live
    host actor of each node of ``processes``, all at once: the entries of each machine, once,
    without this one's unless ``everywhere``; and the nodes that did not answer in time."""
    actors: dict[str, Any] = {}
    for proc in processes:
        node, actor = getattr(proc, "node", None), getattr(proc, "actor", None)
        if node is not None and actor is not None and proc.poll() is None:
            actors.setdefault(node, actor)  # one live host per node reads the node's folder
    if not actors:
        return [], []
    ray = importlib.import_module("ray")  # only with workers on Ray
    asked = {node: call(actor) for node, actor in actors.items()}
    ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    here = machine()
    streams: list[list[Entry]] = []
    unreachable: list[str] = []
    seen: set[str] = set()  # machines read: nodes of one machine share its files
    for node, ref in asked.items():
        try:
            got = ray.get(ref, timeout=0)
        except Exception:  # not answered in time, or the node went meanwhile
            unreachable.append(node)
            continue
        if got["machine"] in seen or (got["machine"] == here and not everywhere):
            continue  # read already, or this machine's own files
        seen.add(got["machine"])
        streams.append([Entry(str(s), t, str(line)) for s, t, line in got["entries"]])
    return streams, unreachable


def gather(
    processes: Iterable[Any],
    home: Path,
    pattern: str | None,
    since_s: float | None,
    services: list[str] | None,
    everywhere: bool = False,
    timeout_s: float = ASK_TIMEOUT_S,
) -> tuple[list[Entry], list[str]]:
    """The lines the nodes of ``processes`` (Ray workers' processes; others are left out) hold,
    merged in time order, and the nodes that did not answer. Only other machines' lines unless
    ``everywhere``; each machine's once."""
    streams, unreachable = _ask_nodes(
        processes,
        lambda actor: actor.log_entries.remote(str(home), pattern, since_s, services),
        everywhere,
        timeout_s,
    )
    return merged(*streams), unreachable


def symptom_lines(
    processes: Iterable[Any], home: Path, since_s: float, timeout_s: float = ASK_TIMEOUT_S
) -> list[Entry]:
    """The lines showing a failure symptom that other machines' logs gained since the last
    call (each host actor keeps its place in its node's files: :class:`NodeTail`), for the
    control loop's alerts (:mod:`dmsc.runtime.control.loop.symptoms`). A node that does not
    answer is asked again at the next tick."""
    streams, _ = _ask_nodes(
        processes,
        lambda actor: actor.symptom_lines.remote(str(home), since_s),
        False,
        timeout_s,
    )
    return merged(*streams)


class NodeTail:
    """In a host actor: what its node's logs under one home gained since the last read, kept
    to the lines that show a symptom (a few, where reading every new line would ship them all)."""

    def __init__(self, home: Path, since_s: float) -> None:
        self.tail = LogTail(log_dir(home), since_s)

    def read(self) -> dict[str, Any]:
        found = [e for e in self.tail.read() if symptom_of(e.line) is not None]
        return {"machine": machine(), "entries": [[e.service, e.ts, e.line] for e in found]}


def merged(*streams: Iterable[Entry]) -> list[Entry]:
    """Entries of several sources, each in time order, as one list in time order."""
    return list(heapq.merge(*streams, key=lambda e: e.ts if e.ts is not None else 0.0))
