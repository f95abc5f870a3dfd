"""verify covers every byte the reader interprets, survives damaged input, and reports clearly.

Each test here failed before the fix it guards (issue 9 items 5, 9, 10, 14): archive header and
trailer flips passed verify; damaged manifests and .metadata crashed it; .metadata flips passed
verify yet broke dcp.load; checksums=False said OK; ``../`` file names were opened; a root and a
missing path gave tracebacks; running from a source tree gave a circular-import error.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates
from dcp_datastates import IntegrityError, verify_checkpoint
from dcp_datastates.cli import main
from dcp_datastates.format.manifest import RankManifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CLI_TIMEOUT_S = 120


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "m": {"w": torch.randn(3, 4, generator=g), "h": torch.arange(6, dtype=torch.int16)},
        "step": 7,
    }


def _save(path: Path, writer_factory: Any, **kw: Any) -> dict[str, Any]:
    sd = _state()
    dcp.save(sd, storage_writer=writer_factory(**kw), checkpoint_id=str(path))
    return sd


def _manifest(path: Path, rank: int = 0) -> RankManifest:
    return RankManifest.from_json((path / f"__datastates_manifest_{rank}.json").read_text())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command line in this process (a subprocess costs seconds of torch import)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = int(e.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _flip(path: Path, offset: int) -> int:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
    return old


def _restore(path: Path, offset: int, old: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([old]))


def test_every_archive_header_and_trailer_byte_is_covered(tmp_path: Path, writer_factory: Any):
    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    assert verify_checkpoint(str(ck)).fully_verified
    tensors = [it for it in _manifest(ck).items if it.dtype != "bytes"]
    assert len(tensors) == 2
    missed: list[str] = []
    flipped = 0
    for it in tensors:
        data = ck / it.file
        header = range(it.archive_offset, it.payload_offset)
        trailer = range(it.payload_offset + it.payload_bytes, it.archive_offset + it.archive_length)
        for off in [*header, *trailer]:
            old = _flip(data, off)
            try:
                rep = verify_checkpoint(str(ck))
                flipped += 1
                if rep.ok or not any(f"'{it.fqn}'" in p for p in rep.problems):
                    missed.append(f"{it.fqn}@{off}")
            finally:
                _restore(data, off, old)
    assert flipped > 2000  # both archives' header and trailer bytes, every one of them
    assert not missed, f"{len(missed)} flips passed verify, e.g. {missed[:5]}"
    assert verify_checkpoint(str(ck)).fully_verified


def test_metadata_flips_are_found_or_harmless(tmp_path: Path, writer_factory: Any) -> None:
    """A flipped .metadata byte either fails verify or still loads the exact values."""
    ck = tmp_path / "ck"
    sd = _save(ck, writer_factory)
    meta = ck / ".metadata"
    size = meta.stat().st_size
    passed_but_broken: list[str] = []
    for off in range(size):
        old = _flip(meta, off)
        try:
            rep = verify_checkpoint(str(ck))  # must never raise
            if not rep.ok:
                continue
            out = {"m": {"w": torch.zeros(3, 4), "h": torch.zeros(6, dtype=torch.int16)}, "step": 0}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.load(out, checkpoint_id=str(ck))
                exact = (
                    torch.equal(out["m"]["w"], sd["m"]["w"])
                    and torch.equal(out["m"]["h"], sd["m"]["h"])
                    and out["step"] == 7
                )
                if not exact:
                    passed_but_broken.append(f"{off}: wrong values")
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                passed_but_broken.append(f"{off}: {type(e).__name__}")
        finally:
            _restore(meta, off, old)
    assert not passed_but_broken, passed_but_broken[:10]


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b'{"version": 1, "rank": 0, "checksums": true, "save_id": "x", "items": [{"fqn": 3}]}',
        b'{"version": 1, "rank": "0", "checksums": true, "save_id": "x", "items": []}',
        b"\xff\xfe\x00garbage",
    ],
)
def test_damaged_manifest_is_a_problem_not_a_traceback(
    tmp_path: Path, writer_factory: Any, damage: bytes
) -> None:
    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    (ck / "__datastates_manifest_0.json").write_bytes(damage)
    rep = verify_checkpoint(str(ck))
    assert not rep.ok
    assert any("__datastates_manifest_0.json" in p for p in rep.problems), rep.summary()
    with pytest.raises(IntegrityError):
        dcp_datastates.load(_state(), str(ck))


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty", "huge_length"])
def test_damaged_metadata_is_a_problem_and_every_path_is_checked(
    tmp_path: Path, writer_factory: Any, damage: str
) -> None:
    bad, good = tmp_path / "bad", tmp_path / "good"
    _save(bad, writer_factory)
    _save(good, writer_factory)
    meta = bad / ".metadata"
    raw = meta.read_bytes()
    if damage == "garbage":
        meta.write_bytes(b"\x80\x04garbage" + raw[10:])
    elif damage == "truncate":
        meta.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        meta.write_bytes(b"")
    else:  # a BINUNICODE8 length of 2**62: a naive unpickler tries to allocate it
        meta.write_bytes(b"\x80\x04\x8d" + (1 << 62).to_bytes(8, "little") + b"x")
    rep = verify_checkpoint(str(bad))
    assert any(".metadata is damaged" in p for p in rep.problems), rep.summary()
    r = _cli("verify", str(bad), str(good))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert f"{bad}: " in r.stdout and "DAMAGED" in r.stdout
    assert f"{good}: " in r.stdout and ": OK" in r.stdout


def test_metadata_pickle_is_never_executed(tmp_path: Path, writer_factory: Any) -> None:
    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {sentinel}",))

    (ck / ".metadata").write_bytes(pickle.dumps(Evil()))
    rep = verify_checkpoint(str(ck))
    assert not sentinel.exists()
    assert any("refusing to load" in p and "system" in p for p in rep.problems), rep.summary()


def test_metadata_disagreeing_with_manifest_is_found(tmp_path: Path, writer_factory: Any) -> None:
    """Well-formed but wrong .metadata (chunk size, dtype, location) fails verify."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    good = (ck / ".metadata").read_bytes()
    cases = {}
    md = pickle.loads(good)
    md.state_dict_metadata["m.w"].chunks[0] = ChunkStorageMetadata(
        offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3])
    )
    cases["shape"] = md
    md = pickle.loads(good)
    md.state_dict_metadata["m.h"].properties.dtype = torch.uint16
    cases["dtype"] = md
    md = pickle.loads(good)
    key = next(k for k in md.storage_data if k.fqn == "m.w")
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(info.relative_path, info.offset + 64, info.length)
    cases["location"] = md
    for what, bad in cases.items():
        (ck / ".metadata").write_bytes(pickle.dumps(bad))
        rep = verify_checkpoint(str(ck))
        assert not rep.ok, what
        assert any(("'m.w'" in p or "'m.h'" in p) for p in rep.problems), (what, rep.summary())
    (ck / ".metadata").write_bytes(good)
    assert verify_checkpoint(str(ck)).fully_verified


def test_checksums_false_is_reported_as_not_verified(tmp_path: Path, writer_factory: Any) -> None:
    ck = tmp_path / "ck"
    _save(ck, writer_factory, checksums=False)
    it = next(i for i in _manifest(ck).items if i.fqn == "m.w")
    _flip(ck / it.file, it.payload_offset + 5)  # undetectable without checksums
    rep = verify_checkpoint(str(ck))
    assert rep.ok and not rep.fully_verified
    assert "NOT FULLY VERIFIED" in rep.summary() and ": OK" not in rep.summary()
    assert any("checksums=False" in u for u in rep.unverified)
    r = _cli("verify", str(ck))
    assert r.returncode == 3 and "NOT FULLY VERIFIED" in r.stdout, r.stdout + r.stderr
    # ... while the archive headers are still checked
    _flip(ck / it.file, it.archive_offset + 40)
    assert not verify_checkpoint(str(ck)).ok


def test_manifest_file_names_outside_the_checkpoint_are_refused(
    tmp_path: Path, writer_factory: Any
) -> None:
    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    mpath = ck / "__datastates_manifest_0.json"
    raw = json.loads(mpath.read_text())
    raw["items"][0]["file"] = "../secret.distcp"
    mpath.write_text(json.dumps(raw))
    # a file that would pass the data checks if it were opened
    shutil.copy(ck / _manifest(ck).items[1].file, tmp_path / "secret.distcp")
    rep = verify_checkpoint(str(ck))
    assert any("not a plain file name" in p and "'../secret.distcp'" in p for p in rep.problems)


def test_cli_missing_path_root_and_usage(tmp_path: Path, writer_factory: Any) -> None:
    missing = tmp_path / "nope"
    r = subprocess.run(  # once through `python -m`, the way users run it
        [sys.executable, "-m", "dcp_datastates", "verify", str(missing)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no such checkpoint directory" in r.stdout
    root = tmp_path / "root"
    root.mkdir()
    (root / "empty").mkdir()
    r = _cli("verify", str(root / "empty"))
    assert r.returncode == 2 and "not a checkpoint" in r.stdout
    for step in (10, 20):
        _save(root / f"step-{step}", writer_factory)
    r = _cli("verify", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{root / 'step-10'}: " in r.stdout and f"{root / 'step-20'}: " in r.stdout
    assert ".metadata" not in r.stdout
    r = _cli("verify", f"file://{root / 'step-10'}", str(missing))  # could not check: 2
    assert r.returncode == 2 and ": OK" in r.stdout
    (root / "step-20" / ".metadata").write_bytes(b"x")
    r = _cli("verify", str(missing), str(root))
    assert r.returncode == 1  # damage outranks "could not check"
    assert _cli("verify").returncode == 2  # usage


def test_running_from_a_source_tree_fails_clearly(tmp_path: Path) -> None:
    """A source checkout without the built _core shadows the installed package: say so."""
    shadow = tmp_path / "src"
    shutil.copytree(
        Path(dcp_datastates.__file__).parent,
        shadow / "dcp_datastates",
        ignore=shutil.ignore_patterns("_core*.so", "_core*.pyd", "__pycache__"),
    )
    code = (
        "import sys, runpy\n"
        # an editable install's import hook would redirect to the built tree; a plain install
        # has none, so that the current directory wins, as it does for a user
        "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in type(f).__name__"
        " and 'Redirect' not in type(f).__name__]\n"
        "sys.path.insert(0, '.')\n"
        "runpy.run_module('dcp_datastates', run_name='__main__')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "verify", "x"],
        capture_output=True,
        text=True,
        cwd=shadow,
        timeout=CLI_TIMEOUT_S,
    )
    assert r.returncode != 0
    assert "circular import" not in r.stderr.splitlines()[-1]
    assert "shadows the installed package" in r.stderr, r.stderr[-2000:]


def test_load_metadata_roundtrip_of_a_real_checkpoint(tmp_path: Path, writer_factory: Any) -> None:
    from dcp_datastates.format.verify import load_metadata

    ck = tmp_path / "ck"
    _save(ck, writer_factory)
    raw = (ck / ".metadata").read_bytes()
    keys = pickle.loads(raw).state_dict_metadata.keys()
    assert load_metadata(raw).state_dict_metadata.keys() == keys
    with pytest.raises(ValueError, match="refusing"):
        load_metadata(pickle.dumps(io.BytesIO(b"x")))
