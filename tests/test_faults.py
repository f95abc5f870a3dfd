"""Faults during a save: each surfaces as a clear exception (on the future and at the next
barrier), nothing half-written is taken for a checkpoint, resources come back, training goes on."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import mounted_tmpfs
from fsspec.implementations.memory import MemoryFileSystem

from dcp_datastates import DataStatesWriter, _core

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def big_state(mb: float = 2.0) -> dict[str, Any]:
    n = int(mb * 1024 * 1024 / 4)
    return {"a": torch.arange(n, dtype=torch.float32), "b": torch.ones(1000), "step": 3}


def assert_recovers(w: DataStatesWriter, tmp_path: Any, failed_path: str) -> None:
    """The failed save left no commit; the error, already read from the save's future (or
    dcp.save), is not raised again at the barrier; the writer saves again."""
    assert not os.path.exists(os.path.join(failed_path, ".metadata"))
    w.wait_captured()
    c = w.engine_counters()
    assert c["cache_used_bytes"] == 0 and c["jobs"] == 0 and c["open_files"] == 0, c
    good = str(tmp_path / "after-fault")
    sd = big_state(0.5)
    dcp.async_save(sd, storage_writer=w, checkpoint_id=good).result(timeout=60)
    out = {"a": torch.zeros_like(sd["a"]), "b": torch.zeros(1000), "step": 0}
    dcp.load(out, checkpoint_id=good)
    assert torch.equal(out["a"], sd["a"]) and out["step"] == 3


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[str]:
    with mounted_tmpfs(tmp_path / "tiny-fs", "512k") as mnt:
        yield mnt


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_disk_full(tmp_path: Any, writer_factory: Any, small_tmpfs: str, mode: str) -> None:
    w: DataStatesWriter = writer_factory(host_cache_size="1MiB", chunk_size="256KiB")
    path = os.path.join(small_tmpfs, "ckpt")
    with pytest.raises(BaseException, match="No space left on device") as ei:
        if mode == "save":
            dcp.save(big_state(), storage_writer=w, checkpoint_id=path)
        else:
            dcp.async_save(big_state(), storage_writer=w, checkpoint_id=path).result(timeout=60)
    assert path in str(ei.value)
    assert_recovers(w, tmp_path, path)


def test_permission_denied(tmp_path: Any) -> None:
    ro = tmp_path / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o555)
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "fault_child.py"), str(ro),
           str(tmp_path / "good")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout, r.stderr[-3000:])


def test_checkpoint_path_is_a_file(tmp_path: Any, writer_factory: Any) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    w: DataStatesWriter = writer_factory()
    with pytest.raises(BaseException, match="not-a-dir"):
        dcp.save(big_state(0.1), storage_writer=w, checkpoint_id=str(f))
    assert f.read_text() == "x"
    w.wait_captured()  # a failure before any job was staged: nothing to report twice
    dcp.save(big_state(0.1), storage_writer=w, checkpoint_id=str(tmp_path / "ok"))


def test_directory_removed_during_save(tmp_path: Any, writer_factory: Any) -> None:
    w: DataStatesWriter = writer_factory(capture="lazy")
    path = str(tmp_path / "vanishing")
    w.engine.pause_copies(True)
    fut = dcp.async_save(big_state(), storage_writer=w, checkpoint_id=path)
    deadline = 100
    while not os.path.exists(os.path.join(path, "__0_0.distcp")) and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    shutil.rmtree(path)
    w.engine.pause_copies(False)
    with pytest.raises(BaseException, match="vanishing"):
        fut.result(timeout=60)
    assert not os.path.exists(path) or not os.path.exists(os.path.join(path, ".metadata"))
    assert_recovers(w, tmp_path, path)


def test_injected_io_error_names_file_and_tensor(tmp_path: Any, writer_factory: Any) -> None:
    w: DataStatesWriter = writer_factory(host_cache_size="1MiB", chunk_size="128KiB")
    path = str(tmp_path / "eio")
    _core.set_write_fault("eio/__0_", errno.EIO)
    try:
        with pytest.raises(BaseException) as ei:
            dcp.async_save(big_state(), storage_writer=w, checkpoint_id=path).result(timeout=60)
    finally:
        _core.set_write_fault("", 0)
    msg = str(ei.value)
    assert "Input/output error" in msg and "eio/__0_" in msg, msg
    # the item is named: a tensor, or the non-tensor 'step' if its write failed first
    assert any(f"flush of '{k}'" in msg for k in ("a", "b", "step")), msg
    assert_recovers(w, tmp_path, path)


class ExplodingFS(MemoryFileSystem):
    """An in-memory object store whose data-file uploads fail after 300 kB."""

    protocol = "explodingmem"

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        f = super()._open(path, mode, **kw)
        if "w" in mode and path.endswith(".distcp"):
            orig = f.write

            def write(data: Any) -> int:
                if f.tell() + len(data) > 300_000:
                    raise OSError(errno.EIO, f"object store went away while writing {path}")
                return int(orig(data))

            f.write = write
        return f


def test_fsspec_filesystem_raising_mid_write(tmp_path: Any, writer_factory: Any) -> None:
    fsspec.register_implementation("explodingmem", ExplodingFS, clobber=True)
    w: DataStatesWriter = writer_factory(host_cache_size="256KiB", chunk_size="64KiB")
    url = "explodingmem://bucket/ckpt"
    with pytest.raises(BaseException, match="object store went away"):
        dcp.async_save(big_state(), storage_writer=w, checkpoint_id=url).result(timeout=60)
    assert not fsspec.filesystem("explodingmem").exists("/bucket/ckpt/.metadata")
    assert_recovers(w, tmp_path, str(tmp_path / "nothing-here"))
