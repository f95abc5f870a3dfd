"""A load by DataStatesReader counts as a modification of every tensor it writes into.

The native reader ``pread``s payloads straight into contiguous CPU targets, which torch cannot see;
the reader bumps each target's version counter itself. Two consequences are checked here: an
incremental save after a rollback writes the loaded bytes (it does not reference the bytes the
tensor held before the load), and a lazy save in flight whose source is loaded into fails with
CaptureError naming the tensor instead of committing the loaded values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import in_thread

from dcp_datastates import CaptureError, DataStatesReader, DataStatesWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TIMEOUT_S = 60


def _writer(root: Path, **kw: Any) -> DataStatesWriter:
    kw.setdefault("host_cache_size", "16MiB")
    kw.setdefault("chunk_size", "1MiB")
    kw.setdefault("prefault", False)
    return DataStatesWriter(str(root), copy_threads=1, flush_threads=1, **kw)


def _save(w: DataStatesWriter, sd: dict[str, Any], path: Path) -> None:
    dcp.async_save(sd, storage_writer=w, checkpoint_id=str(path)).result(timeout=TIMEOUT_S)


def _load_native(sd: dict[str, Any], path: Path) -> DataStatesReader:
    reader = DataStatesReader(str(path))
    in_thread(
        lambda: dcp.load(sd, storage_reader=reader, checkpoint_id=str(path), no_dist=True),
        what="dcp.load",
    )
    return reader


def _load_stock(like: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _root_cause(e: BaseException) -> BaseException:
    """The exception a DCP CheckpointException carries for this (only) rank."""
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))  # (exception, traceback summary)
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def test_native_load_bumps_the_version_of_every_target(tmp_path: Path) -> None:
    sd = {"direct": torch.arange(4096, dtype=torch.float32), "converted": torch.ones(64)}
    w = _writer(tmp_path)
    try:
        _save(w, sd, tmp_path / "a")
    finally:
        w.close()
    dest = {"direct": torch.zeros(4096), "converted": torch.zeros(64, dtype=torch.float64)}
    before = {k: v._version for k, v in dest.items()}
    reader = _load_native(dest, tmp_path / "a")
    assert reader.last_read["native_items"] == 2
    for k, v in dest.items():
        assert v._version > before[k], k
    assert torch.equal(dest["direct"], sd["direct"])


def test_incremental_save_after_a_rollback_writes_the_loaded_bytes(tmp_path: Path) -> None:
    """Save A (ones), change in place and save B (twos), roll back to A through the native
    reader, save C: C must hold ones. Without the version bump C referenced B's twos."""
    sd = {"frozen": torch.ones(1 << 16)}
    w = _writer(tmp_path, incremental=True)
    try:
        _save(w, sd, tmp_path / "a")
        sd["frozen"].fill_(2.0)
        _save(w, sd, tmp_path / "b")
        _load_native(sd, tmp_path / "a")  # the rollback: reads straight into sd["frozen"]
        assert bool((sd["frozen"] == 1.0).all())
        _save(w, sd, tmp_path / "c")
    finally:
        w.close()
    got = _load_stock(sd, tmp_path / "c")
    assert torch.equal(got["frozen"], torch.ones(1 << 16)), "C kept the bytes from before the load"


def test_lazy_save_in_flight_is_not_committed_with_loaded_values(tmp_path: Path) -> None:
    """A lazy save whose copy has not run yet when the reader loads into its source: it fails
    with CaptureError naming the tensor (or, never silently, holds the bytes of the call)."""
    n = 1 << 20
    src = _writer(tmp_path)
    try:
        _save(src, {"w": torch.full((n,), 7.0)}, tmp_path / "loaded")
    finally:
        src.close()
    sd = {"w": torch.zeros(n)}
    w = _writer(tmp_path, capture="lazy")
    path = tmp_path / "in-flight"
    try:
        w.engine.pause_copies(True)
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(path))
        try:
            _load_native(sd, tmp_path / "loaded")  # overwrites the source of the held copy
            assert bool((sd["w"] == 7.0).all())
        finally:
            w.engine.pause_copies(False)
        with pytest.raises(BaseException) as info:  # CheckpointException wraps CaptureError
            fut.result(timeout=TIMEOUT_S)
        assert "'w'" in str(info.value) and "modified in place" in str(info.value)
        assert not os.path.exists(path / ".metadata")
        assert isinstance(_root_cause(info.value), CaptureError), repr(info.value)
    finally:
        w.close()
