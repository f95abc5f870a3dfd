"""Files streamed from rank to rank over a torch.distributed process group.

The transport of the peer replicas (:mod:`dcp_datastates.lifecycle.replicas`) and of their
restore (:mod:`dcp_datastates.lifecycle.replica_restore`). Every rank calls :func:`exchange` with
the same list of :class:`Edge` s (each: one sender, one receiver, the files the sender sends);
a rank takes part only in the edges that name it. An edge's files travel as one stream, cut in
``chunk_bytes`` pieces; at each step every rank posts the sends and receives of that piece for
all its edges (``isend``/``irecv``, tagged by the edge's index), then waits for the previous
step's and writes what it received (two buffers per edge: reading, sending, receiving and
writing overlap). Nothing waits on a peer before its own operations of the step are posted, so
any set of edges (a ring, a star, a rank both sending and receiving) completes without deadlock.

Receivers write each file under a temporary name (``<name>.recv-<pid>``) in the edge's target
directory, fsync it and rename it when its last byte landed; what a failed exchange left is
removed. Memory: two pieces per edge of this rank.

Failure semantics: an error reading a sender's file or writing a receiver's does not stop the
stream (the peer would wait for bytes forever): the sender sends zeros from there, the receiver
drops the rest, and the edge is reported as failed in the :class:`ExchangeResult` of the rank
that saw the error. A peer that does not answer fails the wait after ``timeout_s``
(``Work.wait``); the process group's state after that is undefined, so callers stop using it.
Threads: one exchange at a time per process group (tags are per edge, not per exchange).
"""

from __future__ import annotations

import ctypes
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..format.commit import fsync_dir

CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FileSpan:
    """One file of an edge: its name in the target directory, its size and, on the sender's
    machine, where it is read from."""

    name: str
    size: int
    source: str


@dataclass(frozen=True)
class Edge:
    """``src`` sends ``files`` to ``dst``, which writes them into ``target`` (a directory on
    ``dst``'s machine)."""

    src: int
    dst: int
    files: tuple[FileSpan, ...]
    target: str

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class ExchangeResult:
    """What one rank saw: the edges (indices) it sent or received in full, and the errors of the
    others, by edge index."""

    done: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)


class _Stream:
    """An edge's files as one byte stream: reads (sender) or writes (receiver) at an offset."""

    def __init__(self, edge: Edge, writing: bool) -> None:
        self.edge = edge
        self.writing = writing
        self.error: str | None = None
        self._fds: dict[int, int] = {}
        self._starts: list[int] = []
        pos = 0
        for f in edge.files:
            self._starts.append(pos)
            pos += f.size

    def _tmp(self, i: int) -> str:
        return os.path.join(self.edge.target, f"{self.edge.files[i].name}.recv-{os.getpid()}")

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            if self.writing:
                fd = os.open(self._tmp(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            else:
                fd = os.open(self.edge.files[i].source, os.O_RDONLY)
            self._fds[i] = fd
        return fd

    def _pieces(self, offset: int, n: int) -> list[tuple[int, int, int, int]]:
        """(file index, offset in the file, offset in the piece, length) covering the range."""
        out = []
        for i, f in enumerate(self.edge.files):
            start = self._starts[i]
            lo, hi = max(offset, start), min(offset + n, start + f.size)
            if lo < hi:
                out.append((i, lo - start, lo - offset, hi - lo))
        return out

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Sender: the stream's bytes at ``offset`` into ``buf`` (zeros after an error)."""
        n = len(buf)
        if self.error is None:
            try:
                for i, foff, poff, length in self._pieces(offset, n):
                    got = os.preadv(self._fd(i), [buf[poff : poff + length]], foff)
                    if got != length:
                        raise OSError(f"{self.edge.files[i].source} is shorter than planned")
                return
            except OSError as e:
                self.error = f"reading {self.edge.files[0].source}...: {e}"
        buf[:] = bytes(n)  # the receiver drops this stream

    def write(self, offset: int, data: memoryview) -> None:
        """Receiver: ``data`` at ``offset`` of the stream (dropped after an error)."""
        if self.error is not None:
            return
        try:
            for i, foff, poff, length in self._pieces(offset, len(data)):
                os.pwrite(self._fd(i), data[poff : poff + length], foff)
        except OSError as e:
            self.error = f"writing into {self.edge.target} on rank {self.edge.dst}: {e}"

    def finish(self) -> None:
        """Receiver: every file fsynced and renamed to its name (also the empty ones)."""
        if self.error is None:
            try:
                for i, f in enumerate(self.edge.files):
                    fd = self._fd(i)
                    os.fsync(fd)
                    os.close(self._fds.pop(i))
                    os.replace(self._tmp(i), os.path.join(self.edge.target, f.name))
                fsync_dir(self.edge.target)
            except OSError as e:
                self.error = f"writing into {self.edge.target} on rank {self.edge.dst}: {e}"
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.writing and self.error is not None:
            for i in range(len(self.edge.files)):
                try:
                    os.unlink(self._tmp(i))
                except OSError:
                    pass


def exchange(
    edges: Sequence[Edge],
    group: dist.ProcessGroup | None,
    *,
    timeout_s: float,
    chunk_bytes: int = CHUNK_BYTES,
) -> ExchangeResult:
    """Runs this rank's part of ``edges`` (the same list on every rank); see the module
    docstring. Raises RuntimeError when a peer does not answer within ``timeout_s``."""
    rank = dist.get_rank()
    mine = [(k, e) for k, e in enumerate(edges) if rank in (e.src, e.dst)]
    streams = {k: _Stream(e, writing=e.dst == rank) for k, e in mine}
    steps = max((-(-e.total // chunk_bytes) for _, e in mine), default=0)
    timeout = datetime.timedelta(seconds=timeout_s)
    # two buffers per edge: step s fills one while step s-1's transfer may still use the other
    bufs = {k: [_Buffer(min(chunk_bytes, e.total)) for _ in range(2)] for k, e in mine}
    try:
        pending: list[tuple[Any, int, int, int]] = []  # (work, edge, step, bytes)
        for step in range(steps + 1):
            posted = _post(mine, streams, bufs, step, chunk_bytes, group) if step < steps else []
            _land(pending, streams, bufs, chunk_bytes, timeout)
            pending = posted
    except BaseException:
        for s in streams.values():
            s.error = s.error or "the exchange stopped"
            s.close()
        raise
    result = ExchangeResult()
    for k, _ in mine:
        s = streams[k]
        if s.writing:
            s.finish()
        else:
            s.close()
        if s.error is None:
            result.done.add(k)
        else:
            result.errors[k] = s.error
    return result


class _Buffer:
    """A reusable piece buffer: a uint8 tensor (what the process group sends or fills) and a
    memoryview of the same memory (what the files are read into and written from)."""

    def __init__(self, n: int) -> None:
        self.tensor = torch.empty(max(n, 1), dtype=torch.uint8)
        raw = (ctypes.c_char * self.tensor.numel()).from_address(self.tensor.data_ptr())
        self.view = memoryview(raw).cast("B")


def _post(
    mine: list[tuple[int, Edge]], streams: dict[int, _Stream], bufs: dict[int, list[_Buffer]],
    step: int, chunk: int, group: dist.ProcessGroup | None,
) -> list[tuple[Any, int, int, int]]:
    """Posts this step's piece of every edge of this rank (sends read first); returns them."""
    rank = dist.get_rank()
    out = []
    offset = step * chunk
    for k, e in mine:
        n = min(chunk, e.total - offset)
        if n <= 0:
            continue
        b = bufs[k][step % 2]
        if e.src == rank:
            streams[k].read_into(offset, b.view[:n])
            w = dist.isend(b.tensor[:n], dst=e.dst, group=group, tag=k)
        else:
            w = dist.irecv(b.tensor[:n], src=e.src, group=group, tag=k)
        out.append((w, k, step, n))
    return out


def _land(
    pending: list[tuple[Any, int, int, int]], streams: dict[int, _Stream],
    bufs: dict[int, list[_Buffer]], chunk: int, timeout: datetime.timedelta,
) -> None:
    """Waits for the pieces posted at the previous step; writes the ones received."""
    for w, k, step, n in pending:
        if w is not None and not w.wait(timeout):
            raise RuntimeError("a peer did not answer in time")
        if streams[k].writing:
            streams[k].write(step * chunk, bufs[k][step % 2].view[:n])


__all__ = ["CHUNK_BYTES", "Edge", "ExchangeResult", "FileSpan", "exchange"]
