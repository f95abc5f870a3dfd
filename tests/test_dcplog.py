"""DCP's per-key DEBUG events: skipped only when nobody can receive them
(dcp_datastates.runtime.dcplog). Each case runs in a fresh interpreter: the logger is process-wide
state."""

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
    with tempfile.TemporaryDirectory() as d:
        DataStatesWriter(d, host_cache_size="16MiB").close()
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


# -- the per-key pass (_stateful_to_state_dict) ------------------------------------------------

_PASS_PROBE = textwrap.dedent(
    """
    import json, logging, sys, tempfile
    import torch
    from torch.distributed.checkpoint import state_dict_saver as sds
    from torch.distributed.checkpoint.logger import _dcp_logger
    original = sds._stateful_to_state_dict
    {setup}
    from dcp_datastates import DataStatesWriter
    with tempfile.TemporaryDirectory() as d:
        DataStatesWriter(d, host_cache_size="16MiB").close()
        DataStatesWriter(d, host_cache_size="16MiB").close()  # installs once
    replaced = sds._stateful_to_state_dict is not original
    twice = getattr(sds._stateful_to_state_dict, "_dcpds_original", original) is not original

    class Counter:  # a Stateful value: DCP calls its state_dict()
        calls = 0
        def state_dict(self):
            Counter.calls += 1
            return {{"n": torch.tensor(Counter.calls)}}
        def load_state_dict(self, sd):
            pass

    class Broken(Counter):
        def state_dict(self):
            raise RuntimeError("broken state_dict")

    model = torch.nn.Linear(2, 2)
    t = torch.arange(3.0)
    sd = {{"t": t, "nested": {{"a": t}}, "lst": [t, 1], "none": None, "n": 7, "s": "x",
          "p": torch.nn.Parameter(torch.ones(1)), "c": Counter(), "m": model}}
    records = []
    h = logging.Handler(); h.emit = records.append
    _dcp_logger.addHandler(h)
    out = sds._stateful_to_state_dict(sd)
    same = (list(out) == list(sd) and all(out[k] is sd[k] for k in
            ("t", "nested", "lst", "none", "n", "s", "p")))
    stateful_ok = (Counter.calls == 1 and int(out["c"]["n"]) == 1
                   and set(out["m"]) == {{"weight", "bias"}})
    raised = ""
    try:
        sds._stateful_to_state_dict({{"t": t, "b": Broken()}})
    except RuntimeError as e:
        raised = str(e)
    errors = [r.msg for r in records if r.levelno == logging.ERROR]
    names = [m.get("func_name") for m in errors
             if isinstance(m, dict) and m.get("event") == "exception" and "broken" in m["error"]]
    per_key_error = names == ["_stateful_to_state_dict.b", "_stateful_to_state_dict"]
    debug_events = sum(1 for r in records if r.levelno == logging.DEBUG)
    print(json.dumps(dict(replaced=replaced, twice=twice, same=same, stateful_ok=stateful_ok,
                          raised=raised, per_key_error=per_key_error, n_errors=len(errors),
                          debug_events=debug_events)))
    """
)


def _pass_probe(setup: str = "", env: dict[str, str] | None = None) -> dict[str, object]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _PASS_PROBE.format(setup=setup)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_per_key_pass_is_replaced_and_gives_what_dcps_gives() -> None:
    r = _pass_probe()
    assert r["replaced"] and not r["twice"], r
    # Plain values come back as they are, Stateful ones (an object, a module) through their
    # state_dict(), once; a failing state_dict() raises and is logged by DCP's own per-key
    # logger (ERROR records go out at INFO level too), as without the replacement.
    assert r["same"] and r["stateful_ok"], r
    assert r["raised"] == "broken state_dict" and r["per_key_error"], r
    assert r["debug_events"] == 0, r  # nobody listens at DEBUG: none built


@pytest.mark.parametrize(
    ("setup", "env"),
    [
        ("_dcp_logger.addHandler(logging.StreamHandler(sys.stderr))", None),
        ("", {"DCPDS_KEEP_DCP_DEBUG_LOG": "1"}),
    ],
    ids=["someone-listens", "opt-out"],
)
def test_the_per_key_pass_is_kept_where_its_debug_events_are(
    setup: str, env: dict[str, str] | None
) -> None:
    r = _pass_probe(setup, env)
    assert not r["replaced"], r
    assert r["same"] and r["stateful_ok"] and r["raised"] == "broken state_dict", r
    assert r["debug_events"] > 0, r


def test_dcps_pass_comes_back_when_its_logger_is_set_to_debug_again() -> None:
    r = _pass_probe(setup="", env=None)
    assert r["replaced"], r
    code = _PASS_PROBE.format(setup="").replace(
        "records = []", "records = []\n_dcp_logger.setLevel(logging.DEBUG)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    r2 = json.loads(out.stdout.strip().splitlines()[-1])
    assert r2["replaced"] and r2["same"] and r2["debug_events"] > 0, r2
