"""DCP's per-key DEBUG events: skipped only when nobody can receive them (dcp_datastates.dcplog).
Each case runs in a fresh interpreter: the logger is process-wide state."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import logging, sys, tempfile
    from torch.distributed.checkpoint.logger import _dcp_logger
    {setup}
    from dcp_datastates import DataStatesWriter
    w = DataStatesWriter(tempfile.mkdtemp(), host_cache_size="16MiB")
    w.close()
    print(logging.getLevelName(_dcp_logger.level))
    """
)


def _level_after_writer(setup: str = "", env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(setup=setup)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_unheard_debug_events_are_skipped() -> None:
    assert _level_after_writer() == "INFO"


@pytest.mark.parametrize(
    "setup",
    [
        "_dcp_logger.addHandler(logging.StreamHandler(sys.stderr))",
        "_dcp_logger.propagate = True",
    ],
    ids=["handler-attached", "propagating"],
)
def test_debug_events_someone_can_receive_are_kept(setup: str) -> None:
    assert _level_after_writer(setup) == "DEBUG"


def test_opt_out_keeps_them() -> None:
    assert _level_after_writer(env={"DCPDS_KEEP_DCP_DEBUG_LOG": "1"}) == "DEBUG"
