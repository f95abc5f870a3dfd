"""Command line: ``python -m dcp_datastates verify PATH...`` and ``... cleanup ROOT``.

Exit status of ``verify``: 0 every checkpoint verified intact; 1 at least one is damaged; 2 a path
could not be checked (missing, not a checkpoint, unreadable) or bad usage; 3 no damage found but
something could not be verified (a save made with ``checksums=False``). ``cleanup`` exits 0 on
success and 2 if the root is missing or not a directory. Object-store URLs (``s3://...``) take
their storage options from fsspec's configuration (``FSSPEC_S3='{"endpoint_url": ...}'``);
``cleanup`` of such a root requires ``--min-age`` (:mod:`dcp_datastates.remote`).
"""

from __future__ import annotations

import argparse
import sys

from .verify import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, EXIT_UNVERIFIED, verify_paths


def _verify(paths: list[str]) -> int:
    reports = verify_paths(paths)
    for rep in reports:
        print(rep.summary(), flush=True)
    codes = {rep.exit_code for rep in reports}
    for code in (EXIT_DAMAGED, EXIT_ERROR, EXIT_UNVERIFIED):
        if code in codes:
            return code
    return EXIT_OK


def _cleanup_remote(root: str, min_age: float | None, exclude: list[str]) -> int:
    """Object stores (no lock there): --min-age is required; options from FSSPEC_<PROTOCOL>."""
    from .remote import cleanup_incomplete

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
    from .checkpoints import cleanup_incomplete, local_root

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
    try:
        removed = cleanup_incomplete(path, exclude=exclude, min_age=min_age)
    except OSError as e:
        print(f"error: cleanup of {root} failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    for p in removed:
        print(f"removed {p}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dcp_datastates",
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
    args = p.parse_args(argv)
    if args.cmd == "verify":
        return _verify(args.paths)
    if args.min_age is not None and args.min_age < 0:
        p.error("--min-age must be >= 0")
    return _cleanup(args.root, args.min_age, args.exclude)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
