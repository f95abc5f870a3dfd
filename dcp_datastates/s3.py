"""S3 multipart uploads with several parts in flight, fed from the host cache (through s3fs).

s3fs's own file object uploads one part at a time from one growing buffer. For a checkpoint data
file, :class:`MultipartUpload` instead copies the bytes handed to :meth:`MultipartUpload.write`
(archive headers, payload chunks read straight out of the host cache, trailers) into part buffers
of ``part_bytes`` and uploads up to ``max_in_flight`` parts at once on s3fs's event loop. The
caller (the sequential consumer of :mod:`dcp_datastates.fsspec_sink`) releases each cache chunk
as soon as it is copied, and blocks only when ``max_in_flight`` parts are already uploading: the
memory held is at most ``(max_in_flight + 1) * part_bytes``, whatever the size of the file.

Guarantees:

* the object appears only when :meth:`close` completes the upload (``CompleteMultipartUpload``, or
  one ``PutObject`` for a file smaller than one part): an upload that fails or is abandoned never
  leaves a partial object under the file's name;
* on any failure the caller calls :meth:`abort`: it waits for the parts still in flight, then
  aborts the multipart upload, so no stored parts are left behind (a failure to abort is returned
  for the error message, never raised over the original error);
* errors are ``OSError`` naming the ``s3://bucket/key`` and the part number.

Threads: an upload is used by one thread (the DCP save thread); its parts run as coroutines on
s3fs's I/O loop thread. Blocking waits release the GIL (``concurrent.futures`` waits). Requests are
bounded in time by botocore's ``connect_timeout``/``read_timeout`` and retries (pass them as
``config_kwargs`` in the writer's ``storage_options``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from typing import Any

logger = logging.getLogger(__name__)

MIN_PART_BYTES = 5 * 1024**2
"""S3's smallest part (every part but the last)."""

MAX_PART_BYTES = 5 * 1024**3
"""S3's largest part."""

MAX_PARTS = 10_000
"""S3's largest part number."""


def is_s3(fs: Any) -> bool:
    """True if ``fs`` is an s3fs ``S3FileSystem`` (multipart uploads apply)."""
    try:
        import s3fs
    except ImportError:
        return False
    return isinstance(fs, s3fs.S3FileSystem)


def check_part_bytes(part_bytes: int) -> None:
    """Raises ValueError unless ``part_bytes`` is a valid S3 part size (5 MiB .. 5 GiB)."""
    if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
        raise ValueError(
            f"upload_part_size must be between 5 MiB and 5 GiB (S3's part limits), got "
            f"{part_bytes} bytes"
        )


class MultipartUpload:
    """One S3 object written sequentially as a multipart upload (see the module docstring).

    Args:
        fs: an s3fs ``S3FileSystem`` (synchronous mode: it runs its own I/O loop thread).
        path: the object's path (``bucket/key`` or ``s3://bucket/key``).
        part_bytes: bytes of every part but the last (5 MiB .. 5 GiB).
        max_in_flight: parts uploading at once (at least 1).
    """

    def __init__(self, fs: Any, path: str, *, part_bytes: int, max_in_flight: int) -> None:
        check_part_bytes(part_bytes)
        if max_in_flight < 1:
            raise ValueError(f"upload_concurrency must be at least 1, got {max_in_flight}")
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self.url = f"s3://{self._bucket}/{self._key}"
        self._part_bytes = part_bytes
        self._max_in_flight = max_in_flight
        self._buf = bytearray(part_bytes)
        self._fill = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._in_flight: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._done: list[dict[str, Any]] = []
        self._closed = False
        self.bytes_written = 0
        self.parts_uploaded = 0

    # -- the sequential file interface -----------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Appends ``data``; uploads each part as it fills (blocks while too many are in flight).

        ``data`` is copied before this returns: the caller may release or reuse its memory.
        """
        if self._closed:
            raise ValueError(f"write to {self.url} after close")
        mv = memoryview(data).cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            take = min(n - pos, self._part_bytes - self._fill)
            self._buf[self._fill : self._fill + take] = mv[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == self._part_bytes:
                self._submit_part(self._buf)
                self._buf = bytearray(self._part_bytes)
                self._fill = 0
        self.bytes_written += n
        return n

    def close(self) -> None:
        """Uploads what is left and completes the object; it exists under its name only now."""
        if self._closed:
            return
        if self._upload_id is None:  # smaller than one part: one PUT, atomic as well
            self._call(
                "put_object",
                "upload",
                Bucket=self._bucket,
                Key=self._key,
                Body=bytes(self._buf[: self._fill]),
            )
        else:
            if self._fill:
                self._submit_part(self._buf[: self._fill])
            while self._in_flight:
                self._finish_oldest()
            self._call(
                "complete_multipart_upload",
                "completing the upload of",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._done},
            )
        self._closed = True
        self._buf = bytearray()
        self._fs.invalidate_cache(self._path)  # s3fs caches listings; it did not see this write

    def abort(self) -> str | None:
        """Abandons the upload: no object is created and no stored part is left behind.

        Waits for the parts in flight (each ends within botocore's timeouts), then aborts the
        multipart upload. Never raises: returns a description of what could not be cleaned up,
        or None.
        """
        if self._closed:
            return None
        self._closed = True
        self._buf = bytearray()
        for _, fut in self._in_flight:
            fut.cancel()
        for _, fut in self._in_flight:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - cancelled or failed: either way it is over
                pass
        self._in_flight.clear()
        if self._upload_id is None:
            return None
        try:
            self._call(
                "abort_multipart_upload",
                "aborting the upload of",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
            )
        except OSError as e:
            return f"multipart upload {self._upload_id} of {self.url} was not aborted: {e}"
        return None

    # -- internals -------------------------------------------------------------------------
    def _submit_part(self, body: bytearray) -> None:
        if self._upload_id is None:
            out = self._call(
                "create_multipart_upload", "starting the upload of", Bucket=self._bucket,
                Key=self._key,
            )
            self._upload_id = str(out["UploadId"])
        if self._next_part > MAX_PARTS:
            raise OSError(
                f"upload of {self.url}: more than {MAX_PARTS} parts of {self._part_bytes} bytes; "
                "raise upload_part_size"
            )
        while len(self._in_flight) >= self._max_in_flight:
            self._finish_oldest()
        number = self._next_part
        self._next_part += 1
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        self._in_flight.append((number, asyncio.run_coroutine_threadsafe(coro, self._fs.loop)))

    def _finish_oldest(self) -> None:
        number, fut = self._in_flight.popleft()
        try:
            out = fut.result()
        except Exception as e:
            raise OSError(f"upload of {self.url} failed at part {number}: {_describe(e)}") from e
        self._done.append({"PartNumber": number, "ETag": out["ETag"]})
        self.parts_uploaded += 1

    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        coro = self._fs._call_s3(method, **kwargs)
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._fs.loop).result()
        except Exception as e:
            raise OSError(f"{what} {self.url} failed: {_describe(e)}") from e


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def abort_stale_uploads(fs: Any, prefix: str) -> list[str]:
    """Aborts every unfinished multipart upload whose key starts with ``prefix`` (a path
    ``bucket/key-prefix``); returns the ``s3://`` URLs of the objects they were for.

    For cleaning up after a writer that died mid-upload (its parts are stored, and billed,
    until aborted). Raises OSError naming the prefix if the listing or an abort fails.
    """
    bucket, key, _ = fs.split_path(prefix)
    aborted: list[str] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
    try:
        while True:
            out = fs.call_s3("list_multipart_uploads", **kwargs)
            for up in out.get("Uploads", []):
                fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]
                )
                aborted.append(f"s3://{bucket}/{up['Key']}")
            if not out.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = out.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker", "")
    except Exception as e:
        where = f"s3://{bucket}/{key}"
        raise OSError(f"aborting unfinished uploads under {where}: {_describe(e)}") from e
    return aborted


def newest_upload_start(fs: Any, prefix: str) -> float | None:
    """Start time (seconds since the epoch) of the newest unfinished multipart upload under
    ``prefix``, or None if there is none."""
    bucket, key, _ = fs.split_path(prefix)
    try:
        out = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    except Exception as e:
        where = f"s3://{bucket}/{key}"
        raise OSError(f"listing unfinished uploads under {where}: {_describe(e)}") from e
    starts = [up["Initiated"].timestamp() for up in out.get("Uploads", []) if "Initiated" in up]
    return max(starts) if starts else None


__all__ = [
    "MAX_PARTS",
    "MAX_PART_BYTES",
    "MIN_PART_BYTES",
    "MultipartUpload",
    "abort_stale_uploads",
    "check_part_bytes",
    "is_s3",
    "newest_upload_start",
]
