"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1.

``moto.server.ThreadedMotoServer`` serves the S3 REST API over HTTP from a thread of the test
process (state in memory), on a free port of the loopback interface; s3fs talks to it exactly as
to AWS (signed requests, multipart uploads, listings). Nothing leaves the machine.

Fixtures (import them into a test module: ``from s3_server import s3_bucket_fixture,
s3_server_fixture``):

* ``s3_server`` (module scope): the running server; ``stop()`` and ``start()`` may be called by
  a test (a stopped server refuses connections), the fixture restarts it for the next test;
* ``s3`` (function scope): a fresh bucket on it, as an :class:`S3Bucket` with ``url(name)``,
  ``storage_options`` (endpoint, credentials, short timeouts) and ``fs`` (an s3fs file system);
* ``tarpit`` (function scope): a :class:`Tarpit`, an endpoint that accepts connections and
  never answers (an S3 server that stopped answering).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import s3fs  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

REGION = "us-east-1"
_bucket_ids = itertools.count()


class S3Server:
    """moto's S3 server on 127.0.0.1 (a free port), started and stopped by the fixture."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._server: ThreadedMotoServer | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        if self._server is not None:
            return
        # Port 0 on the first start picks a free port; later starts reuse it, so that a
        # file system made before a restart reaches the server again. moto keeps its state in
        # this process, so the buckets survive a stop and start.
        srv = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        srv.start()
        self.port = int(srv.get_host_and_port()[1])
        self._server = srv

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server; short timeouts so a test never hangs."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": REGION},
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 20,
                "retries": {"max_attempts": 2, "mode": "standard"},
            },
        }

    def env(self) -> dict[str, str]:
        """Environment of a subprocess that reaches this server through fsspec's configuration
        (``FSSPEC_S3`` holds the s3 storage options as JSON)."""
        env = dict(os.environ)
        env["FSSPEC_S3"] = json.dumps(self.storage_options())
        return env


@dataclass
class S3Bucket:
    """A bucket on the test server."""

    server: S3Server
    name: str
    fs: Any

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.server.storage_options()

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}", *parts])

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under ``prefix`` (no listing cache)."""
        self.fs.invalidate_cache()
        return sorted(p.split("/", 1)[1] for p in self.fs.find(f"{self.name}/{prefix}"))

    def pending_uploads(self) -> list[str]:
        """Keys of the unfinished multipart uploads in the bucket."""
        out = self.fs.call_s3("list_multipart_uploads", Bucket=self.name)
        return sorted(u["Key"] for u in out.get("Uploads", []))


@pytest.fixture(scope="module", name="s3_server")
def s3_server_fixture() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="s3")
def s3_bucket_fixture(s3_server: S3Server) -> Iterator[S3Bucket]:
    s3_server.start()  # a test may have stopped it
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    name = f"ckpt-{os.getpid()}-{next(_bucket_ids)}"
    fs.call_s3("create_bucket", Bucket=name)
    yield S3Bucket(server=s3_server, name=name, fs=fs)
    s3_server.start()


class Tarpit:
    """A server on 127.0.0.1 that accepts TCP connections and never answers (nor reads): an
    S3 endpoint that stopped answering. Connections are held until :meth:`close`."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tarpit", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the accept timeout, or the socket closed
                continue
            self._conns.append(conn)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def storage_options(self, connect_s: float = 1, read_s: float = 1) -> dict[str, Any]:
        """Options reaching the tarpit: short timeouts, 2 attempts per request."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": REGION},
            "config_kwargs": {
                "connect_timeout": connect_s,
                "read_timeout": read_s,
                "retries": {"total_max_attempts": 2, "mode": "standard"},
            },
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self._conns:
            c.close()
        self._sock.close()


@pytest.fixture(name="tarpit")
def tarpit_fixture() -> Iterator[Tarpit]:
    t = Tarpit()
    try:
        yield t
    finally:
        t.close()
