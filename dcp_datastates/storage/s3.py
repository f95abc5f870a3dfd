"""S3 multipart uploads with several parts in flight, fed from the host cache (through s3fs).

s3fs's own file object uploads one part at a time from one growing buffer. For a checkpoint data
file, :class:`MultipartUpload` instead copies the bytes handed to :meth:`MultipartUpload.write`
(archive headers, payload chunks read straight out of the host cache, trailers) into part buffers
of ``part_bytes`` and uploads up to ``max_in_flight`` parts at once on s3fs's event loop. The
caller (the sequential consumer of :mod:`dcp_datastates.storage.fsspec_sink`) releases each cache
chunk as soon as it is copied, and blocks only when ``max_in_flight`` parts are already uploading:
the memory held is at most ``(max_in_flight + 1) * part_bytes``, whatever the size of the file.

Guarantees:

* the object appears only when :meth:`close` completes the upload (``CompleteMultipartUpload``, or
  one ``PutObject`` for a file smaller than one part): an upload that fails or is abandoned never
  leaves a partial object under the file's name;
* on any failure the caller calls :meth:`abort`: it waits for the parts still in flight, then
  aborts the multipart upload, so no stored parts are left behind (a failure to abort is returned
  for the error message, never raised over the original error);
* errors are ``OSError`` naming the ``s3://bucket/key`` and the part number.

Threads: an upload is used by one thread (the DCP save thread, or a promotion thread); its parts
run as coroutines on s3fs's I/O loop thread. Blocking waits release the GIL
(``concurrent.futures`` waits).

Time bounds (:class:`RequestBounds`): every request the package makes to S3 goes through a file
system from :func:`open_fs`, which ends each request after at most ``attempts x (connect_timeout +
read_timeout + body / MIN_UPLOAD_BYTES_PER_S) + backoff`` seconds, with botocore's
``connect_timeout``, ``read_timeout`` and retry attempts taken from ``config_kwargs`` (s3fs's
defaults: 5 s, 15 s; botocore's: 5 attempts in its legacy retry mode, 3 in standard mode).
botocore's own timeouts alone do not bound a request with a body: aiohttp starts its read timeout
only once the body is sent, and sending waits without a limit for the server's ``100 Continue``
or for a peer that stops reading. Such a file system also makes s3fs's own retry layer (which
would re-run a request that botocore gave up on, 5 times) a single pass: botocore's attempts are
the only retries. A request past its bound is cancelled (its connection closed) and fails with
``OSError(ETIMEDOUT)`` naming the object's URL and the bounds. :class:`MultipartUpload` also
takes an overall ``deadline`` (the persistent tier's ``persist_timeout``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import fsspec

logger = logging.getLogger(__name__)

MIN_PART_BYTES = 5 * 1024**2
"""S3's smallest part (every part but the last)."""

MAX_PART_BYTES = 5 * 1024**3
"""S3's largest part."""

MAX_PARTS = 10_000
"""S3's largest part number."""


MIN_UPLOAD_BYTES_PER_S = 1024**2
"""The slowest upload a request's bound allows for: a body of N bytes adds N / 1 MiB seconds
per attempt (a 16 MiB part: 16 s)."""

_BOUND_SLACK_S = 1.0  # scheduling, signing and checksums of one request
_S3FS_CONNECT_TIMEOUT_S = 5.0  # s3fs's defaults where config_kwargs set none
_S3FS_READ_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class RequestBounds:
    """How long one S3 request may take, from botocore's settings (see the module docstring).

    Attributes:
        connect_timeout_s: botocore's ``connect_timeout``.
        read_timeout_s: botocore's ``read_timeout``.
        attempts: botocore's total attempts per request (the first one included).
    """

    connect_timeout_s: float
    read_timeout_s: float
    attempts: int

    @classmethod
    def from_config(cls, config_kwargs: dict[str, Any] | None) -> RequestBounds:
        """The bounds botocore applies for s3fs's ``config_kwargs`` (and the ``AWS_MAX_ATTEMPTS``
        and ``AWS_RETRY_MODE`` variables, as botocore reads them)."""
        ck = dict(config_kwargs or {})
        retries = dict(ck.get("retries") or {})
        if "total_max_attempts" in retries:
            attempts = int(retries["total_max_attempts"])
        elif "max_attempts" in retries:  # botocore's client setting counts retries only
            attempts = int(retries["max_attempts"]) + 1
        elif os.environ.get("AWS_MAX_ATTEMPTS", "").strip().isdigit():
            attempts = int(os.environ["AWS_MAX_ATTEMPTS"])
        else:
            mode = retries.get("mode") or os.environ.get("AWS_RETRY_MODE") or "legacy"
            attempts = 5 if mode == "legacy" else 3
        return cls(
            connect_timeout_s=float(ck.get("connect_timeout", _S3FS_CONNECT_TIMEOUT_S)),
            read_timeout_s=float(ck.get("read_timeout", _S3FS_READ_TIMEOUT_S)),
            attempts=max(1, attempts),
        )

    def request_s(self, body_bytes: int = 0) -> float:
        """Seconds one request carrying ``body_bytes`` may take, its retries included."""
        per_attempt = (
            self.connect_timeout_s + self.read_timeout_s + body_bytes / MIN_UPLOAD_BYTES_PER_S
        )
        backoff = sum(min(2.0**i, 20.0) for i in range(self.attempts - 1))  # botocore's caps
        return self.attempts * per_attempt + backoff + _BOUND_SLACK_S

    def describe(self) -> str:
        return (
            f"connect_timeout {self.connect_timeout_s:g} s, read_timeout "
            f"{self.read_timeout_s:g} s, {self.attempts} attempt(s)"
        )


def _body_bytes(body: Any) -> int:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return memoryview(body).nbytes
    return 0


def _request_url(kwargs: dict[str, Any]) -> str:
    bucket, key = kwargs.get("Bucket"), kwargs.get("Key", kwargs.get("Prefix", ""))
    return f"s3://{bucket}/{key}" if bucket else "s3://"


class RequestTimeoutError(OSError):
    """An S3 request (its retries included) that did not end within its bound; ``errno`` is
    ``ETIMEDOUT``. Not a ``TimeoutError``: fsspec would replace it by an ``FSTimeoutError``
    without a message."""


async def bounded(coro: Any, seconds: float, what: str) -> Any:
    """Awaits ``coro`` for at most ``seconds``; past that, cancels it and raises
    :class:`RequestTimeoutError` naming ``what``."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:  # the caller gave up first (a deadline): so does the request
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)  # let it close its connection
        raise RequestTimeoutError(errno.ETIMEDOUT, f"{what}: no answer within {seconds:.1f} s")
    return task.result()


def _transport_errors() -> tuple[type[BaseException], ...]:
    """botocore's errors of the connection (timeouts, refused, reset), not of the request."""
    from botocore import exceptions as bx

    return (bx.ConnectTimeoutError, bx.ReadTimeoutError, bx.EndpointConnectionError,
            bx.ConnectionClosedError)


_bounded_class: type | None = None


def _bounded_fs_class() -> type:
    """s3fs's ``S3FileSystem`` with every request bounded (created once, on first use)."""
    global _bounded_class
    if _bounded_class is None:
        import s3fs
        from fsspec.asyn import sync_wrapper

        class BoundedS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
            """``S3FileSystem`` whose requests end within their :class:`RequestBounds`."""

            retries = 1  # botocore's attempts are the only retries (see RequestBounds)

            @property
            def bounds(self) -> RequestBounds:
                return RequestBounds.from_config(self.config_kwargs)

            async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
                b = self.bounds
                seconds = b.request_s(_body_bytes(kwargs.get("Body")))
                what = f"{method} {_request_url(kwargs)} ({b.describe()})"
                try:
                    return await bounded(super()._call_s3(method, *args, **kwargs), seconds, what)
                except _transport_errors() as e:  # they name the endpoint, not the object
                    cls = RequestTimeoutError if "Timeout" in type(e).__name__ else OSError
                    raise cls(errno.ETIMEDOUT if cls is RequestTimeoutError else errno.EIO,
                              f"{what}: {_describe(e)}") from e

            call_s3 = sync_wrapper(_call_s3)

        BoundedS3FileSystem.__module__ = __name__
        BoundedS3FileSystem.__qualname__ = "BoundedS3FileSystem"  # pickled by name
        _bounded_class = BoundedS3FileSystem
    return _bounded_class


def __getattr__(name: str) -> Any:
    """``BoundedS3FileSystem``, created on first use (importing s3fs is not free)."""
    if name == "BoundedS3FileSystem":
        return _bounded_fs_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs(url, **storage_options)``, with s3fs replaced by a file system
    whose every request is bounded in time (module docstring). fsspec's configuration
    (``FSSPEC_S3``) applies as usual. Instances are cached by fsspec, apart from the caller's
    own ``S3FileSystem`` instances (their settings are left alone; the listing cache is
    shared with the caller's instance of the same options)."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if is_s3(fs) and not hasattr(fs, "bounds"):
        plain = fs
        fs = _bounded_fs_class()(**plain.storage_options)
        # One listing cache for both: s3fs invalidates it on each write, so the caller's own
        # file system (the stock reader's) sees what the writer stored.
        fs.dircache = plain.dircache
    return fs, path


def fs_bounds(fs: Any) -> RequestBounds | None:
    """The request bounds of a file system from :func:`open_fs` (None if it has none)."""
    b = getattr(fs, "bounds", None)
    return b if isinstance(b, RequestBounds) else None


def is_s3(fs: Any) -> bool:
    """True if ``fs`` is an s3fs ``S3FileSystem`` (multipart uploads apply).

    Never imports s3fs: an instance exists only once s3fs is imported, and importing it (with
    botocore, ~0.3 s) for every local save would slow the first save of each process."""
    s3fs = sys.modules.get("s3fs")
    return s3fs is not None and isinstance(fs, s3fs.S3FileSystem)


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
        deadline: a ``time.monotonic()`` time by which the upload must be complete, or None:
            a wait past it fails with ``OSError(ETIMEDOUT)`` (each request is bounded anyway
            when ``fs`` comes from :func:`open_fs`).
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        part_bytes: int,
        max_in_flight: int,
        deadline: float | None = None,
    ) -> None:
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
        self._deadline = deadline
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

        Cancels the parts in flight, then aborts the multipart upload (one request, bounded as
        every request, the deadline notwithstanding). Never raises: returns a description of
        what could not be cleaned up, or None.
        """
        if self._closed:
            return None
        self._closed = True
        self._buf = bytearray()
        for _, fut in self._in_flight:
            fut.cancel()
        concurrent.futures.wait([f for _, f in self._in_flight], timeout=5.0)
        self._in_flight.clear()
        if self._upload_id is None:
            return None
        self._deadline = None  # the abort gets its own request's bound
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

    def _left(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def _result(self, fut: concurrent.futures.Future[Any], what: str) -> Any:
        try:
            return fut.result(self._left())
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RequestTimeoutError(
                errno.ETIMEDOUT, f"{what} {self.url}: not done by the upload's deadline"
            ) from None

    def _finish_oldest(self) -> None:
        number, fut = self._in_flight.popleft()
        try:
            out = self._result(fut, f"part {number} of")
        except Exception as e:
            raise OSError(f"upload of {self.url} failed at part {number}: {_describe(e)}") from e
        self._done.append({"PartNumber": number, "ETag": out["ETag"]})
        self.parts_uploaded += 1

    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        coro = self._fs._call_s3(method, **kwargs)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)
            return self._result(fut, what)
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
    "MIN_UPLOAD_BYTES_PER_S",
    "MAX_PART_BYTES",
    "MIN_PART_BYTES",
    "MultipartUpload",
    "RequestBounds",
    "RequestTimeoutError",
    "abort_stale_uploads",
    "check_part_bytes",
    "fs_bounds",
    "is_s3",
    "newest_upload_start",
    "open_fs",
]
