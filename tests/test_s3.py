"""Object stores for real: DataStatesWriter saving to s3:// on moto's S3 server (127.0.0.1).

Proves: multipart uploads streamed from the host cache with several parts in flight (and never
more than ``upload_concurrency``); the stock ``dcp.load`` with ``FsspecReader`` loads the result
bit-exactly; ``.metadata`` is stored last; a save failing mid-way (injected errors, the server
stopped) leaves no ``.metadata`` and no unfinished multipart upload it could abort, and its error
names the object; verify (API and command line) and retention (``latest``, keep-last-N,
cleanup of partial checkpoints) work on the bucket; a server that stops answering (a tarpit
that accepts connections and never replies) fails a save within its requests' bounds.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from conftest import HANG_S, assert_state_equal, in_thread, zeros_like_state
from s3_server import (  # noqa: F401 - fixtures
    S3Bucket,
    Tarpit,
    s3_bucket_fixture,
    s3_server_fixture,
    tarpit_fixture,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from dcp_datastates import DataStatesWriter, cli
from dcp_datastates.format.verify import verify_checkpoint
from dcp_datastates.lifecycle import remote
from dcp_datastates.lifecycle.checkpoints import RetentionPolicy
from dcp_datastates.storage.s3 import MultipartUpload, RequestBounds, open_fs

MiB = 1024**2


def state(seed: int = 0, mib: int = 14) -> dict[str, Any]:
    """About ``mib`` MiB of tensors (three parts or more at 5 MiB) plus a non-tensor value."""
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4
    return {
        "w": torch.randn(n // 2, generator=g),
        "b": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g),
        "h": torch.randn(n // 4, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def make_writer(s3: S3Bucket, **kw: Any) -> DataStatesWriter:
    kw.setdefault("host_cache_size", "8MiB")  # smaller than the state: it streams through
    kw.setdefault("chunk_size", "1MiB")
    kw.setdefault("upload_part_size", "5MiB")
    kw.setdefault("upload_concurrency", 3)
    return DataStatesWriter(s3.url("default"), storage_options=s3.storage_options, **kw)


def load(s3: S3Bucket, url: str, like: dict[str, Any]) -> dict[str, Any]:
    """The stock reader with the storage options. (No ``checkpoint_id`` here: DCP's
    ``FsspecReader.reset(checkpoint_id)`` re-creates the file system without them.)"""
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=FsspecReader(url, **s3.storage_options))
    return out


class S3Calls:
    """Wraps S3FileSystem._call_s3 (the one entry of every request): records the order of the
    calls, the most ``upload_part`` requests in flight at once, and can fail one request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail: tuple[str, int] | None = None  # (method, PartNumber or 0)
        self.before: Any = None  # coroutine function run before a failing call
        orig = s3fs.S3FileSystem._call_s3

        async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, str(kwargs.get("Key", ""))))
            if self.fail == (method, int(kwargs.get("PartNumber", 0))):
                if self.before is not None:
                    await self.before()
                else:
                    raise OSError(f"injected failure of {method}")
            if method != "upload_part":
                return await orig(fs, method, *args, **kwargs)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.05)  # keep each part in flight long enough to overlap
                return await orig(fs, method, *args, **kwargs)
            finally:
                self.in_flight -= 1

        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)

    def keys_of(self, method: str) -> list[str]:
        return [k for m, k in self.calls if m == method]


def test_save_streams_parallel_multipart_and_stock_load_reads_it(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = S3Calls(monkeypatch)
    sd = state(1)
    url = s3.url("run", "step-1")
    with make_writer(s3) as w:
        in_thread(lambda: dcp.async_save(sd, storage_writer=w, checkpoint_id=url).result(HANG_S))
    assert_state_equal(sd, load(s3, url, sd))
    # The plain call, options from fsspec's configuration (FSSPEC_S3 in the environment).
    monkeypatch.setitem(fsspec.config.conf, "s3", s3.storage_options)
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=url)
    assert_state_equal(sd, out)

    keys = s3.keys("run/step-1")
    assert keys == [
        "run/step-1/.metadata",
        "run/step-1/__0_0.distcp",
        "run/step-1/__datastates_manifest_0.json",
    ], keys
    assert s3.pending_uploads() == []
    data = s3.fs.info(s3.url("run", "step-1", "__0_0.distcp"))
    parts = int(data["ETag"].strip('"').rsplit("-", 1)[1])  # a multipart ETag ends in -<parts>
    assert parts == -(-data["size"] // (5 * MiB)), (parts, data["size"])
    assert 2 <= calls.max_in_flight <= 3, calls.max_in_flight  # parallel, bounded
    # .metadata is the last object stored, after the data file and the manifest.
    stores = [
        k for m, k in calls.calls if m in ("put_object", "complete_multipart_upload", "copy_object")
    ]
    assert stores and stores[-1].endswith("/.metadata"), stores
    assert calls.keys_of("complete_multipart_upload") == ["run/step-1/__0_0.distcp"]


def test_small_file_is_one_put_and_overwrite_replaces(s3: S3Bucket) -> None:
    url = s3.url("small")
    with make_writer(s3) as w:
        big = state(2)
        in_thread(lambda: dcp.save(big, storage_writer=w, checkpoint_id=url))
        small = {"x": torch.arange(1000), "y": "text"}
        in_thread(lambda: dcp.save(small, storage_writer=w, checkpoint_id=url))
    info = s3.fs.info(s3.url("small", "__0_0.distcp"))
    assert "-" not in info["ETag"].strip('"')  # one PutObject, no multipart
    assert_state_equal(small, load(s3, url, small))
    assert verify_checkpoint(url, storage_options=s3.storage_options).exit_code == 0


@pytest.mark.parametrize("method,part", [("upload_part", 2), ("complete_multipart_upload", 0)])
def test_failed_upload_aborts_and_commits_nothing(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch, method: str, part: int
) -> None:
    calls = S3Calls(monkeypatch)
    calls.fail = (method, part)
    url = s3.url("fail", "step-5")
    with make_writer(s3) as w:
        with pytest.raises(BaseException) as ei:
            in_thread(
                lambda: dcp.async_save(state(5), storage_writer=w, checkpoint_id=url).result(
                    HANG_S
                )
            )
        msg = str(ei.value)
        assert f"{s3.name}/fail/step-5/__0_0.distcp" in msg and "injected failure" in msg, msg
        keys = s3.keys("fail")
        assert keys == ["fail/step-5/.datastates.incomplete"], keys  # partial: marker only
        assert s3.pending_uploads() == []  # the multipart upload was aborted
        assert calls.keys_of("abort_multipart_upload") == ["fail/step-5/__0_0.distcp"]
        # The writer stays usable: the next save to the same path commits.
        calls.fail = None
        sd = state(6)
        in_thread(lambda: dcp.async_save(sd, storage_writer=w, checkpoint_id=url).result(HANG_S))
    assert_state_equal(sd, load(s3, url, sd))


def test_server_stopped_mid_upload_fails_cleanly_and_cleanup_removes_it(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = S3Calls(monkeypatch)
    calls.fail = ("upload_part", 2)

    async def stop_server() -> None:  # the second part finds the server gone
        await asyncio.to_thread(s3.server.stop)

    calls.before = stop_server
    root = s3.url("stopped")
    url = f"{root}/step-7"
    with make_writer(s3) as w:
        with pytest.raises(BaseException) as ei:
            in_thread(
                lambda: dcp.async_save(state(7), storage_writer=w, checkpoint_id=url).result(
                    HANG_S
                )
            )
        msg = str(ei.value)
        assert f"{s3.name}/stopped/step-7/__0_0.distcp" in msg, msg
        s3.server.start()
        # The server was down, so the upload could not be aborted: it is left unfinished, and
        # the checkpoint is partial (no .metadata).
        assert s3.pending_uploads() == ["stopped/step-7/__0_0.distcp"]
        infos = remote.list_checkpoints(root, storage_options=s3.storage_options)
        assert [(i.step, i.partial) for i in infos] == [(7, True)]
        # Too recent for min_age: kept; then removed with its unfinished upload aborted.
        so = s3.storage_options
        assert remote.cleanup_incomplete(root, min_age=3600, storage_options=so) == []
        # The command line (options from fsspec's configuration) refuses without --min-age.
        monkeypatch.setitem(fsspec.config.conf, "s3", so)
        assert cli.main(["cleanup", root]) == 2
        assert "needs --min-age" in capsys.readouterr().err
        assert cli.main(["cleanup", root, "--min-age", "0"]) == 0
        assert capsys.readouterr().out.strip() == f"removed {url}"
    assert s3.keys("stopped") == [] and s3.pending_uploads() == []


def test_verify_api_and_cli_on_s3(s3: S3Bucket) -> None:
    url = s3.url("v", "step-3")
    with make_writer(s3) as w:
        in_thread(lambda: dcp.save(state(3), storage_writer=w, checkpoint_id=url))
    so = s3.storage_options
    rep = verify_checkpoint(url, storage_options=so)
    assert rep.exit_code == 0 and rep.items == 4, rep.summary()
    cli = [sys.executable, "-m", "dcp_datastates", "verify", s3.url("v")]  # a root: expanded
    run = subprocess.run(cli, env=s3.server.env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step-3: 1 rank(s), 4 item(s)" in run.stdout and ": OK" in run.stdout, run.stdout

    # One payload byte flipped in the stored object: both report the damage, naming the file.
    obj = s3.url("v", "step-3", "__0_0.distcp")
    raw = bytearray(s3.fs.cat_file(obj))
    raw[len(raw) // 2] ^= 0x01
    s3.fs.pipe_file(obj, bytes(raw))
    rep = verify_checkpoint(url, storage_options=so)
    assert rep.exit_code == 1 and "__0_0.distcp" in rep.summary(), rep.summary()
    run = subprocess.run(cli, env=s3.server.env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr


def test_retention_latest_and_keep_last_on_s3(s3: S3Bucket) -> None:
    root = s3.url("ret")
    so = s3.storage_options
    states = {}
    with make_writer(s3, upload_part_size="8MiB") as w:
        for step in (1, 2, 3, 4):
            states[step] = state(step, mib=1)
            url = f"{root}/step-{step}"
            fut = dcp.async_save(states[step], storage_writer=w, checkpoint_id=url)
            in_thread(lambda fut=fut: fut.result(HANG_S))
            remote.update_latest(root, f"step-{step}", storage_options=so)
            if step == 2:  # "latest" wins over the highest step
                assert remote.latest_complete(root, storage_options=so) == f"{root}/step-2"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        remote.update_latest(root, "step-9", storage_options=so)
    removed = remote.prune(root, RetentionPolicy(keep_last=2), storage_options=so)
    assert removed == [f"{root}/step-1", f"{root}/step-2"]
    infos = remote.list_checkpoints(root, storage_options=so)
    assert [(i.step, i.complete) for i in infos] == [(3, True), (4, True)]
    assert remote.latest_complete(root, storage_options=so) == f"{root}/step-4"
    assert s3.fs.cat_file(f"{root}/latest") == b"step-4\n"
    assert_state_equal(states[4], load(s3, f"{root}/step-4", states[4]))
    assert not any(k.startswith("ret/step-1/") for k in s3.keys("ret"))


def test_bad_upload_settings_are_refused(s3: S3Bucket) -> None:
    with pytest.raises(ValueError, match="upload_part_size"):
        make_writer(s3, upload_part_size="4MiB")
    with pytest.raises(ValueError, match="upload_concurrency"):
        make_writer(s3, upload_concurrency=0)


def test_upload_benchmark_runs(s3: S3Bucket, tmp_path: Any) -> None:
    """benchmarks/s3_upload.py in its smallest form, against the test server (keeps it working)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import s3_upload

    out = tmp_path / "s3.json"
    args = ["--mib", "6", "--rounds", "1", "--part-mib", "5", "--cache-mib", "16"]
    assert s3_upload.main([*args, "--endpoint", s3.server.endpoint, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["bytes"] > 6 * MiB
    assert set(res["contenders"]) == {"datastates", "s3fs_put", "s3fs_put_part"}


def test_a_server_that_stops_answering_fails_the_save_within_the_timeouts(tarpit: Tarpit) -> None:
    # botocore's read timeout starts only once a request's body is sent, and the body waits for
    # a "100 Continue" that never comes: without the writer's bound each request hangs for good.
    so = tarpit.storage_options(connect_s=1, read_s=1)
    bound = RequestBounds.from_config(so["config_kwargs"]).request_s()
    assert bound == 2 * (1 + 1) + 1 + 1  # 2 attempts, 1 s of backoff, 1 s of slack
    url = "s3://ckpt/run/step-1"
    w = DataStatesWriter("s3://ckpt/run", host_cache_size="8MiB", storage_options=so)
    try:
        t0 = time.monotonic()
        with pytest.raises(BaseException) as ei:
            in_thread(lambda: dcp.async_save(state(1, mib=1), storage_writer=w,
                                             checkpoint_id=url).result(HANG_S))
        took = time.monotonic() - t0
    finally:
        in_thread(w.close, timeout=10, what="close()")
    msg = str(ei.value)
    assert url in msg and ("no answer within" in msg or "ReadTimeoutError" in msg), msg
    assert took < 2 * bound + 5, took  # the first request fails the save; then its clean-up


def test_a_stalled_part_is_cut_at_the_upload_deadline_and_aborted(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = S3Calls(monkeypatch)
    calls.fail = ("upload_part", 2)

    async def stall() -> None:  # the server takes the part and never answers
        await asyncio.sleep(3600)

    calls.before = stall
    fs, path = open_fs(s3.url("up", "obj"), s3.storage_options)
    t0 = time.monotonic()
    up = MultipartUpload(fs, path, part_bytes=5 * MiB, max_in_flight=2,
                         deadline=time.monotonic() + 2.0)
    with pytest.raises(OSError) as ei:
        in_thread(lambda: [up.write(b"x" * MiB) for _ in range(16)] and up.close())
    assert time.monotonic() - t0 < 2.0 + 3, time.monotonic() - t0
    assert f"s3://{s3.name}/up/obj" in str(ei.value) and "deadline" in str(ei.value)
    assert up.abort() is None  # the stalled part is cancelled, the upload aborted
    assert s3.pending_uploads() == [] and s3.keys("up") == []


def test_request_bounds_follow_botocore_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    b = RequestBounds.from_config({"connect_timeout": 3, "read_timeout": 5,
                                   "retries": {"max_attempts": 2}})
    assert (b.connect_timeout_s, b.read_timeout_s, b.attempts) == (3, 5, 3)  # 2 retries
    assert b.request_s() == 3 * (3 + 5) + (1 + 2) + 1
    assert b.request_s(16 * MiB) == b.request_s() + 3 * 16  # 1 MiB/s per attempt
    assert RequestBounds.from_config({"retries": {"total_max_attempts": 2}}).attempts == 2
    assert RequestBounds.from_config(None) == RequestBounds(5.0, 15.0, 5)  # s3fs, legacy mode
    assert RequestBounds.from_config({"retries": {"mode": "standard"}}).attempts == 3
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert RequestBounds.from_config({}).attempts == 4
