"""How one `fs` load spreads over its threads (issue 50, item 6).

A load's chunks are cut into runs of consecutive chunks (`load_runs`), and its layers
into groups (`layer_groups`). Each of its threads takes the next run not yet taken of
the first group not yet all taken, and reads that run's layers of that group (opening
its files in the first group, closing them once every group of it is read; two
threads may read two groups of one run at once): a thread never waits for
another between groups, a slow one (the GIL, the disk) leaves more runs to the others,
and no file is opened, checked or closed on one thread for all. The event loop signals
a group's layers once every run of it is read (`Reading.done`).

Before, each group was a round of thread calls the loop waited for, after one thread
had opened every file: 0.70-0.75x of plain reads for Llama-3-8B's layers on 2 cores
(bench/bench_fs_io.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import trio

from kvflow.chunks import ChunkFailure, ChunkHeader

RUNS_PER_THREAD = 8
"""About how many runs each thread of a load gets: enough that one slow thread leaves
its share to the others."""

Spans = list[list[list[memoryview]]]
"""Of each layer of a group: each chunk's spans."""


def layer_groups(num_layers: int) -> list[range]:
    """Layers 0, 1, 2-3, 4-7, ...: what a layer-by-layer load reads per system call."""
    powers = (min(1 << i, num_layers) for i in range(num_layers.bit_length()))
    edges = sorted({0, num_layers, *powers})
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def runs(sizes: list[int], per: int) -> list[range]:
    """Chunk indices in runs of consecutive chunks of about `per` bytes (`sizes`: each
    chunk's)."""
    out: list[range] = []
    start, acc = 0, 0
    for c, n in enumerate(sizes):
        acc += n
        if acc >= per:
            out.append(range(start, c + 1))
            start, acc = c + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def load_runs(sizes: list[int], threads: int) -> list[range]:
    """A load's runs: about `RUNS_PER_THREAD` for each of its `threads`."""
    return runs(sizes, -(-sum(sizes) // (threads * RUNS_PER_THREAD)))


class Reading:
    """What the threads of one load share with the event loop that runs it.

    `spans[g]` are group `g`'s spans, made by the loop before the threads start. A
    thread takes the next (group, run) with `take`, reads it, and says so with `read`
    (which says when a run's files may be closed); the loop waits for `done[g]`. A
    chunk that fails (`failed`) sets `limit`: no thread reads a chunk from there on;
    the chunks before it go on landing. `stop` ends every thread at its next run (the
    load was cancelled, or a thread raised: `error`).
    """

    def __init__(
        self, groups: list[range], chunk_runs: list[range], spans: list[Spans], chunks: int
    ) -> None:
        self.groups = groups
        self.runs = chunk_runs
        self.spans = spans
        self.fds: list[int | None] = [None] * chunks
        """Each chunk's open file, from its run's first group until its last."""
        self.headers: list[ChunkHeader | None] = [None] * chunks
        self.limit = chunks
        self.failures: list[ChunkFailure] = []
        self.error: Exception | None = None
        self.stop = False
        self.done = [trio.Event() for _ in groups]
        self._left = [len(chunk_runs)] * len(groups)
        self._next = itertools.product(range(len(groups)), range(len(chunk_runs)))
        self._opened = [False] * len(chunk_runs)
        self._groups_left = [len(groups)] * len(chunk_runs)
        self._lock = threading.Condition()
        self._token = trio.lowlevel.current_trio_token()

    def take(self) -> Iterator[tuple[int, int]]:
        """From a thread: (group, run) pairs no other thread has taken, in order, until
        every pair is taken or the load stops. A run's later groups come once its first
        group (which opens its files) is read."""
        while not self.stop:
            with self._lock:
                g, r = next(self._next, (-1, -1))
                if g > 0:
                    self._lock.wait_for(lambda: self._opened[r])  # noqa: B023 (called here)
            if g < 0:
                return
            yield g, r

    def read(self, group: int, run: int) -> bool:
        """From a thread: it has read `run` of `group` (or given up on it: a chunk before
        it failed). Whether every group of `run` is now read (another thread may still
        have been reading an earlier group of it): then the caller closes its files."""
        with self._lock:
            if group == 0:
                self._opened[run] = True
                self._lock.notify_all()
            self._left[group] -= 1
            if not self._left[group]:
                self._token.run_sync_soon(self.done[group].set)
            self._groups_left[run] -= 1
            return not self._groups_left[run]

    def failed(self, failure: ChunkFailure) -> None:
        """From a thread: `failure.chunk` failed; chunks after it need not be read."""
        with self._lock:
            self.failures.append(failure)
            self.limit = min(self.limit, failure.chunk)

    def raised(self, exc: Exception) -> None:
        """From a thread: it raised `exc` (a defect, not a bad chunk): the load fails."""
        with self._lock:
            self.error = self.error or exc
            self.stop = True
            self._opened = [True] * len(self.runs)  # no thread waits for a run's files
            self._lock.notify_all()
        for done in self.done:
            self._token.run_sync_soon(done.set)

    def end(self) -> None:
        """From the loop: stop every thread at its next run."""
        with self._lock:
            self.stop = True
            self._opened = [True] * len(self.runs)
            self._lock.notify_all()

    def still_open(self) -> list[int]:
        """Files not closed yet (the load stopped before their run's last group)."""
        return [fd for fd in self.fds if fd is not None]
