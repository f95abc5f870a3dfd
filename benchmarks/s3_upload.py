"""Upload throughput to S3: DataStatesWriter (``s3://``) against s3fs's own ``put``, one run.

Both contenders send the same bytes to the same S3 server, interleaved round by round:

* ``datastates``: ``dcp.save`` of a state dict through a ``DataStatesWriter`` to
  ``s3://bench/ours-<round>``: copies into the host cache, multipart parts of ``--part-mib``
  uploaded ``--concurrency`` at a time, manifest, ``.metadata``; timed from the call until the
  checkpoint is committed;
* ``s3fs_put``: ``S3FileSystem.put`` of a local file holding exactly the writer's data file
  (downloaded once after the first round), with s3fs's defaults (its own multipart upload);
* ``s3fs_put_part``: the same ``put`` with ``--part-mib`` as s3fs's block size.

The server is moto's standalone server on 127.0.0.1 (in this process, state in memory) unless
``--endpoint`` names another S3-compatible server. With moto, every request is served by Python
on the same cores: the figures compare the *CPU cost* of the two clients and the server, not a
network. JSON on stdout (and ``--out``); objects are deleted after each round.

    python -m benchmarks.s3_upload --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch


def _start_moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    return srv, f"http://{host}:{port}"


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = mib * 1024**2 // 4 // 8  # eight float32 tensors
    return {f"t{i}": torch.randn(per, generator=g) for i in range(8)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--part-mib", type=int, default=16, help="multipart part size (MiB)")
    p.add_argument("--concurrency", type=int, default=4, help="parts in flight (ours)")
    p.add_argument("--cache-mib", type=int, default=512, help="host cache of the writer (MiB)")
    p.add_argument("--endpoint", default="", help="S3 endpoint (default: moto on 127.0.0.1)")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args(argv)

    import s3fs
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    srv = None
    endpoint = args.endpoint
    if not endpoint:
        srv, endpoint = _start_moto()
    so: dict[str, Any] = {
        "endpoint_url": endpoint,
        "key": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        "client_kwargs": {"region_name": "us-east-1"},
    }
    fs = s3fs.S3FileSystem(**so)
    bucket = f"bench-{os.getpid()}"
    fs.call_s3("create_bucket", Bucket=bucket)
    sd = _state(args.mib)
    part = args.part_mib * 1024**2
    times: dict[str, list[float]] = {"datastates": [], "s3fs_put": [], "s3fs_put_part": []}
    nbytes = 0
    local = ""
    tmpdir = tempfile.mkdtemp(prefix="s3bench-")
    try:
        with DataStatesWriter(
            "",
            host_cache_size=f"{args.cache_mib}MiB",
            storage_options=so,
            upload_part_size=f"{args.part_mib}MiB",
            upload_concurrency=args.concurrency,
        ) as w:
            for r in range(args.rounds):
                url = f"s3://{bucket}/ours-{r}"
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=w, checkpoint_id=url)
                times["datastates"].append(time.perf_counter() - t0)
                if not local:
                    local = os.path.join(tmpdir, "data.distcp")
                    fs.get(f"{bucket}/ours-{r}/__0_0.distcp", local)
                    nbytes = os.path.getsize(local)
                t0 = time.perf_counter()
                fs.put(local, f"{bucket}/put-{r}")
                times["s3fs_put"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                fs.put(local, f"{bucket}/putp-{r}", block_size=part)
                times["s3fs_put_part"].append(time.perf_counter() - t0)
                fs.rm([f"{bucket}/ours-{r}", f"{bucket}/put-{r}", f"{bucket}/putp-{r}"],
                      recursive=True)
    finally:
        if local:
            os.unlink(local)
        os.rmdir(tmpdir)
        if srv is not None:
            srv.stop()
    result = {
        "bytes": nbytes,
        "rounds": args.rounds,
        "part_mib": args.part_mib,
        "concurrency": args.concurrency,
        "server": "moto (in process)" if srv is not None else endpoint,
        "cores": os.cpu_count(),
        "contenders": {
            k: {
                "seconds": v,
                "median_s": statistics.median(v),
                "median_MBps": nbytes / statistics.median(v) / 1e6,
            }
            for k, v in times.items()
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
