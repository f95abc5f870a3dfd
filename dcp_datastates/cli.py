"""Command line: ``python -m dcp_datastates verify PATH`` and ``... cleanup ROOT``."""

from __future__ import annotations

import argparse
import sys

from .verify import verify_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcp_datastates", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check every chunk of a checkpoint against its checksums")
    v.add_argument("paths", nargs="+", help="checkpoint directories or fsspec URLs")
    c = sub.add_parser("cleanup", help="remove partial (never committed) checkpoints under ROOT")
    c.add_argument("root")
    args = p.parse_args(argv)
    if args.cmd == "verify":
        bad = 0
        for path in args.paths:
            rep = verify_checkpoint(path)
            print(rep.summary())
            bad += 0 if rep.ok else 1
        return 1 if bad else 0
    if args.cmd == "cleanup":
        from .checkpoints import cleanup_incomplete

        for removed in cleanup_incomplete(args.root):
            print(f"removed {removed}")
        return 0
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
