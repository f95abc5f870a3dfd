"""Per-save telemetry of a DataStatesWriter."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class SaveStats:
    """What one save cost and when its stages ended.

    Durations are seconds; ``t_*`` are ``time.perf_counter()`` timestamps (NaN until reached).
    What they do not cover: the work ``dcp.async_save`` does in the caller's thread before it
    calls ``stage()`` (``Stateful.state_dict()`` calls, DCP logging: about 60 us per tensor here),
    and, for ``dcp.save``, DCP's planning before ``write_data``. Time the call itself for those.

    Attributes:
        checkpoint_id: where the save went.
        rank: the rank that recorded these figures.
        bytes: tensor bytes this rank captured.
        stage_s: time spent inside ``stage()`` (the part of ``async_save`` that is ours; 0 for
            ``dcp.save``, whose ``t_stage`` is the start of ``write_data``).
        blocked_s: time the training thread was blocked by this save: ``stage_s`` plus the time
            barriers (``wait_captured``, the optimizer step hook) waited for its copies.
        captured_before_barrier: whether the copies had all landed when the first barrier came
            (None when no barrier ran before the save finished).
        captured_s / done_s: from the save call until the copies landed / until the save was
            durable on this rank.
        flush_gbps: bytes / (t_done - t_stage) in GB/s.
        committed_s: from the save call until ``.metadata`` was written (coordinator only; NaN
            on other ranks), i.e. until the checkpoint became loadable.
        stall_s: part of ``stage_s`` spent waiting for host cache space (the cache was full
            of earlier saves' data and this save's state had to be taken at the call).
        lazy_bytes: bytes left to background copies (the rest was copied at the call).
        busy_bytes: bytes the capture policy would have copied in the background but the call
            copied, because other processes kept every core busy (``adapt_to_load``).
        early_tensors: tensors placed (and flushing) before DCP planned the save, in unnamed
            files named only under the path claim (``dcp_datastates.save.early``; 0: placed in
            ``write_data``).
        flush_writes: write operations the flush issued for this rank's data (small items
            that follow each other in a file are written together: one operation for many).
        error: the failure message, or None.
    """

    checkpoint_id: str
    rank: int
    bytes: int
    stage_s: float
    blocked_s: float
    captured_before_barrier: bool | None
    captured_s: float
    done_s: float
    t_stage: float
    t_captured: float
    t_done: float
    flush_gbps: float
    copy_busy_s: float
    flush_busy_s: float
    error: str | None = None
    stall_s: float = 0.0
    lazy_bytes: int = 0
    busy_bytes: int = 0
    early_tensors: int = 0
    flush_writes: int = 0
    committed_s: float = float("nan")
    t_committed: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
