"""Command line: ``dcp-datastates verify PATH...``, ``dcp-datastates cleanup ROOT``,
``dcp-datastates export CKPT OUT`` and ``dcp-datastates persist-agent FAST_ROOT``.

``dcp-datastates`` is the console command the package installs; it works from any directory.
``python -m dcp_datastates ...`` is the same, except inside a source checkout that was not built
in place (the source folder shadows the installed package, and the import says so).

Exit status of ``verify``: 0 every checkpoint verified intact; 1 at least one is damaged; 2 a path
could not be checked (missing, not a checkpoint, unreadable) or bad usage; 3 no damage found but
something could not be verified (a save made with ``checksums=False``). ``cleanup`` exits 0 on
success, 1 if a partial checkpoint could not be removed (each is named; the others are removed)
and 2 if the root is missing or not a directory. ``export`` exits 0 on success, 1 if the
checkpoint cannot be exported (damaged data, a checksum mismatch, a tensor safetensors cannot
hold: the error names it), 2 if the input is not a checkpoint, the selection holds no tensor (a
``--prefix`` matching nothing: the error lists the prefixes there are), the output exists
(without ``--overwrite``) or on bad usage. ``verify`` and ``export`` draw progress on stderr when
it is a terminal (``--progress`` forces it, ``--quiet`` turns it off). Object-store URLs
(``s3://...``) take their storage options from fsspec's configuration
(``FSSPEC_S3='{"endpoint_url": ...}'``); ``cleanup`` of such a root requires ``--min-age``
(:mod:`dcp_datastates.lifecycle.remote`). ``persist-agent`` exits 0 when everything it was
handed or found is on the persistent tier (or another agent serves the root), 1 if a copy failed,
2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .format.verify import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, EXIT_UNVERIFIED, verify_paths


def _progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", action="store_true",
                   help="draw progress on stderr even when it is not a terminal")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress goes to stderr when it is a terminal, or with --progress; never with --quiet."""
    if args.quiet:
        return False
    return bool(args.progress or sys.stderr.isatty())


def _verify(paths: list[str], progress: bool = False) -> int:
    reports = verify_paths(paths, progress=progress)
    for rep in reports:
        print(rep.summary(), flush=True)
    codes = {rep.exit_code for rep in reports}
    for code in (EXIT_DAMAGED, EXIT_ERROR, EXIT_UNVERIFIED):
        if code in codes:
            return code
    return EXIT_OK


def _cleanup_remote(root: str, min_age: float | None, exclude: list[str]) -> int:
    """Object stores (no lock there): --min-age is required; options from FSSPEC_<PROTOCOL>."""
    from .lifecycle.remote import cleanup_incomplete

    if min_age is None:
        print(
            f"error: {root} is not a local path: object stores have no lock, so cleanup needs "
            "--min-age SECONDS, longer than your longest save",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        removed = cleanup_incomplete(root, min_age=min_age, exclude=exclude)
    except (OSError, ValueError) as e:
        print(f"error: cleanup of {root} failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    for url in removed:
        print(f"removed {url}")
    return EXIT_OK


def _cleanup(root: str, min_age: float | None, exclude: list[str]) -> int:
    from .lifecycle.checkpoints import cleanup_incomplete, local_root

    try:
        path = local_root(root)
    except ValueError:
        return _cleanup_remote(root, min_age, exclude)
    min_age = 0.0 if min_age is None else min_age
    if not path.exists():
        print(f"error: checkpoint root {root} does not exist", file=sys.stderr)
        return EXIT_ERROR
    if not path.is_dir():
        print(f"error: checkpoint root {root} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    failed: dict[Path, OSError] = {}
    try:
        removed = cleanup_incomplete(path, exclude=exclude, min_age=min_age, failed=failed)
    except OSError as e:
        print(f"error: cleanup of {root} failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    for p in removed:
        print(f"removed {p}")
    for p, err in failed.items():
        print(f"error: could not remove {p}: {err}", file=sys.stderr)
    return EXIT_DAMAGED if failed else EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from .config import parse_size
    from .format.export import (
        ExportError,
        NotACheckpointError,
        NothingToExportError,
        OutputExistsError,
        export_checkpoint,
        parse_dtype,
    )

    try:
        max_shard = parse_size(args.max_shard_size, default_unit=1, what="--max-shard-size")
        buffer = parse_size(args.buffer, default_unit=1, what="--buffer")
        dtype = parse_dtype(args.dtype) if args.dtype else None
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        res = export_checkpoint(
            args.ckpt, args.out, max_shard_bytes=max_shard, buffer_bytes=buffer, dtype=dtype,
            prefix=args.prefix, overwrite=args.overwrite, progress=_show_progress(args),
            include_all=args.all,
        )
    except (NotACheckpointError, OutputExistsError, NothingToExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if res.skipped:
        print(f"skipped {len(res.skipped)} non-tensor value(s): {', '.join(res.skipped)}",
              file=sys.stderr)
    if res.excluded:
        print(f"left out {len(res.excluded)} optimizer-state tensor(s) (e.g. "
              f"{res.excluded[0]}); --all exports them", file=sys.stderr)
    if res.unverified:
        print(f"warning: {len(res.unverified)} tensor(s) were saved without checksums "
              f"(checksums=False) and exported unchecked: {', '.join(res.unverified[:5])}"
              + (" ..." if len(res.unverified) > 5 else ""), file=sys.stderr)
    print(f"exported {res.tensors} tensor(s), {res.bytes} bytes ({res.bytes_verified} payload "
          f"bytes checked against their checksums): {', '.join(res.files)}")
    return EXIT_OK


_AGENT_HELP = """\
Copies the checkpoints committed under FAST_ROOT (the writers' path: /dev/shm, local NVMe) to the
persistent tier, in a process that outlives the trainers. Writers created with persist_to= start
one on their own (this command, with --config); start it yourself when a launcher supervises it,
or afterwards (--once) to finish the promotion of a job that is gone.

One agent per FAST_ROOT (a lock file under FAST_ROOT/.datastates-agent/; a second one exits at
once). At start it queues every checkpoint complete on the fast tier but not on the persistent one;
then it copies what writers queue there (.metadata last, then `latest`, then retention). It exits
when no registered trainer is alive, nothing is queued and nothing is found (with --linger, not
before SECONDS after its start; with --once, without waiting for trainers). See
docs/configuration.md, "Recovery".
"""


def _add_agent_parser(sub: Any) -> None:
    a = sub.add_parser(
        "persist-agent", help="copy committed fast-tier checkpoints to the persistent tier, "
        "outliving the trainers", description=_AGENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("fast_root", help="the fast tier's root (the writers' path)")
    a.add_argument("--persist-to", default=None, metavar="URL",
                   help="the persistent tier: a path or an fsspec URL (what the writers' "
                   "persist_to says); default: from --config or FAST_ROOT's config.json")
    a.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON configuration written by a writer (what writers pass)")
    a.add_argument("--storage-options", default=None, metavar="JSON",
                   help="fsspec options of --persist-to, as a JSON object")
    a.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="bound of one copy (persist_timeout; default 600)")
    a.add_argument("--persist-retention", type=int, default=None, metavar="N",
                   help="keep the newest N complete checkpoints on the persistent tier")
    a.add_argument("--fast-retention", type=int, default=None, metavar="N",
                   help="keep the newest N checkpoints on the fast tier (deleting only "
                   "persisted ones)")
    a.add_argument("--no-durable", action="store_true", help="do not fsync the copies")
    a.add_argument("--no-verify", action="store_true",
                   help="do not verify fast checkpoints (checksums) before copying them")
    a.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="wait at least SECONDS for a trainer to register (a launcher starting "
                   "the agent before its trainers); default 0")
    a.add_argument("--once", action="store_true",
                   help="do not wait for trainers: copy what is queued or missing, then exit")
    a.add_argument("--status", action="store_true",
                   help="print whether an agent runs, its queue and trainers (JSON); exit")


def _agent_config(args: argparse.Namespace) -> Any:
    """The agent's configuration from its options; None: the one in FAST_ROOT (config.json)."""
    import json

    from .lifecycle.checkpoints import RetentionPolicy
    from .lifecycle.persist_queue import AgentConfig

    if args.config is not None:
        with open(args.config, "rb") as f:
            return AgentConfig.from_json(json.loads(f.read()))
    if args.persist_to is None:
        return None
    opts = json.loads(args.storage_options) if args.storage_options else {}
    if not isinstance(opts, dict):
        raise ValueError("--storage-options must be a JSON object")

    def policy(n: int | None) -> RetentionPolicy | None:
        return None if n is None else RetentionPolicy(keep_last=n)

    return AgentConfig(
        slow_root=args.persist_to, storage_options=opts, timeout_s=args.timeout,
        durable=not args.no_durable, fast_retention=policy(args.fast_retention),
        persist_retention=policy(args.persist_retention), verify=not args.no_verify,
    )


def _persist_agent(args: argparse.Namespace) -> int:
    import json
    import logging

    from .lifecycle.persist_agent import agent_summary, run_agent

    if args.status:
        print(json.dumps(agent_summary(args.fast_root), indent=1))
        return EXIT_OK
    try:
        config = _agent_config(args)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"error: bad agent configuration: {e}", file=sys.stderr)
        return EXIT_ERROR
    if config is None and not Path(args.fast_root, ".datastates-agent", "config.json").is_file():
        print("error: give --persist-to (or --config)", file=sys.stderr)
        return EXIT_ERROR
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    _, failed = run_agent(args.fast_root, config, linger_s=args.linger, once=args.once)
    return EXIT_DAMAGED if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dcp-datastates",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser(
        "verify", help="check checkpoints (every byte the reader uses) against their manifests"
    )
    v.add_argument(
        "paths", nargs="+", help="checkpoint directories, checkpoint roots, or fsspec URLs"
    )
    _progress_flags(v)
    c = sub.add_parser(
        "cleanup",
        help="remove partial (never committed) checkpoints under ROOT whose writer is gone",
    )
    c.add_argument(
        "root", help="checkpoint root (a local path, file:// URL, or fsspec URL such as s3://)"
    )
    c.add_argument(
        "--min-age",
        type=float,
        default=None,
        metavar="SECONDS",
        help="only remove partial checkpoints untouched for at least SECONDS (default 0 for "
        "local roots; required for object stores, which have no lock)",
    )
    c.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NAME",
        help="never remove this checkpoint (a name under ROOT or a path); repeatable",
    )
    x = sub.add_parser(
        "export",
        help="consolidate a checkpoint into Hugging Face safetensors (model.safetensors, or "
        "shards + model.safetensors.index.json), in bounded memory",
        description="Writes the model weights (optimizer state is left out unless --all) of a "
        "checkpoint into Hugging Face safetensors, checking every byte against the CRC-32C "
        "its manifest recorded (a mismatch: exit 1, naming the tensor and file; nothing is "
        "left under the output names). Incremental checkpoints are read through their "
        "references. Exit status 0 exported, 1 damaged or unexportable, 2 not a checkpoint, "
        "nothing selected, output exists or bad usage.",
    )
    x.add_argument("ckpt", help="checkpoint directory (written by DataStatesWriter)")
    x.add_argument("out", help="output directory (created if missing)")
    x.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest output file (default 5GB; bare numbers are bytes)")
    x.add_argument("--buffer", default="256MiB", metavar="SIZE",
                   help="memory used for tensor data (default 256MiB)")
    x.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="cast floating-point tensors (2+ bytes) to bf16, fp16 or fp32")
    x.add_argument("--prefix", default=None,
                   help="export only tensors named PREFIX..., without the prefix: model. for a "
                   "{'model': ..., 'optim': ...} state; torchtitan and get_model_state_dict "
                   "checkpoints keep the weights at the top level (no prefix needed). A prefix "
                   "matching no tensor is an error listing the prefixes there are")
    x.add_argument("--all", action="store_true",
                   help="export every tensor; by default optimizer state (the state.* and "
                   "param_groups.* of an optimizer state dict, e.g. optim.state.*) is left out")
    x.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _progress_flags(x)
    _add_agent_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "persist-agent":
        return _persist_agent(args)
    if args.cmd == "export":
        return _export(args)
    if args.cmd == "verify":
        return _verify(args.paths, _show_progress(args))
    if args.min_age is not None and args.min_age < 0:
        p.error("--min-age must be >= 0")
    return _cleanup(args.root, args.min_age, args.exclude)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
