"""Unit tests for dcp_datastates.lifecycle.checkpoints (pure stdlib, no torch needed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dcp_datastates.lifecycle.checkpoints import (
    INCOMPLETE_MARKER,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointState,
    RetentionPolicy,
    cleanup_incomplete,
    latest_complete,
    list_checkpoints,
    parse_step,
    prune,
    update_latest,
)


def make_complete(root: Path, name: str, *, files: int = 2) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for i in range(files):
        (d / f"__{i}_0.distcp").write_bytes(b"x" * 16)
    (d / METADATA_FILE).write_bytes(b"meta")
    return d


def make_partial(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / INCOMPLETE_MARKER).touch()
    (d / "__0_0.distcp").write_bytes(b"x" * 16)
    return d


def make_unknown(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    return d


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-100", 100),
        ("step_100", 100),
        ("100", 100),
        ("step-0", 0),
        ("007", 7),
        ("step-", None),
        ("step100", None),
        ("Step-1", None),
        ("ckpt-1", None),
        ("step-1.tmp", None),
        ("-1", None),
        ("latest", None),
        ("", None),
    ],
)
def test_parse_step(name: str, step: int | None) -> None:
    assert parse_step(name) == step


# --------------------------------------------------------------------------- listing


def test_list_missing_root_is_empty(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "nope") == []
    assert latest_complete(tmp_path / "nope") is None
    assert cleanup_incomplete(tmp_path / "nope") == []
    assert prune(tmp_path / "nope", RetentionPolicy(keep_last=1)) == []
    assert prune(tmp_path / "nope", RetentionPolicy()) == []


def test_root_that_is_a_file_raises(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        list_checkpoints(f)
    with pytest.raises(NotADirectoryError):
        latest_complete(f)
    with pytest.raises(NotADirectoryError):
        cleanup_incomplete(f)
    with pytest.raises(NotADirectoryError):
        prune(f, RetentionPolicy(keep_last=1))
    with pytest.raises(NotADirectoryError):
        prune(f, RetentionPolicy())
    with pytest.raises((NotADirectoryError, ValueError)):
        update_latest(f, "step-1")


def test_list_sorted_by_step_with_states(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-100")
    make_complete(tmp_path, "step_20")
    make_partial(tmp_path, "300")
    make_unknown(tmp_path, "step-5")
    # ignored: not a step name, a plain file, a symlink to a checkpoint
    make_complete(tmp_path, "best")
    (tmp_path / "step-7").write_text("not a dir")
    (tmp_path / LATEST_FILE).write_text("step-100\n")
    os.symlink(tmp_path / "step-100", tmp_path / "step-999")

    infos = list_checkpoints(tmp_path)
    assert [(i.name, i.step, i.state) for i in infos] == [
        ("step-5", 5, CheckpointState.UNKNOWN),
        ("step_20", 20, CheckpointState.COMPLETE),
        ("step-100", 100, CheckpointState.COMPLETE),
        ("300", 300, CheckpointState.PARTIAL),
    ]
    assert [i.complete for i in infos] == [False, True, True, False]
    assert [i.partial for i in infos] == [False, False, False, True]
    assert all(isinstance(i.path, Path) and i.path.parent == tmp_path for i in infos)
    assert all(i.mtime > 0 for i in infos)


def test_metadata_wins_over_marker(tmp_path: Path) -> None:
    """A save that committed but has not yet removed its marker is complete."""
    d = make_partial(tmp_path, "step-1")
    (d / METADATA_FILE).write_bytes(b"meta")
    (info,) = list_checkpoints(tmp_path)
    assert info.complete
    assert not info.partial
    assert cleanup_incomplete(tmp_path) == []
    assert d.exists()


def test_mtime_of_complete_is_commit_time(tmp_path: Path) -> None:
    d = make_complete(tmp_path, "step-1")
    os.utime(d / METADATA_FILE, (1000.0, 1000.0))
    os.utime(d, (2000.0, 2000.0))
    (info,) = list_checkpoints(tmp_path)
    assert info.mtime == 1000.0


def test_duplicate_steps_sorted_by_name(tmp_path: Path) -> None:
    make_complete(tmp_path, "step_3")
    make_complete(tmp_path, "step-3")
    make_complete(tmp_path, "3")
    assert [i.name for i in list_checkpoints(tmp_path)] == ["3", "step-3", "step_3"]


# --------------------------------------------------------------------------- latest


def test_latest_complete_fallback_to_highest_step(tmp_path: Path) -> None:
    assert latest_complete(tmp_path) is None
    make_complete(tmp_path, "step-10")
    make_complete(tmp_path, "step-30")
    make_partial(tmp_path, "step-40")
    make_unknown(tmp_path, "step-50")
    assert latest_complete(tmp_path) == tmp_path / "step-30"


def test_latest_pointer_wins(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-10")
    make_complete(tmp_path, "step-30")
    update_latest(tmp_path, "step-10")
    assert latest_complete(tmp_path) == tmp_path / "step-10"
    # the pointer may name a directory that is not step-named
    make_complete(tmp_path, "best")
    update_latest(tmp_path, "best")
    assert latest_complete(tmp_path) == tmp_path / "best"


@pytest.mark.parametrize(
    "content",
    [
        "step-99\n",  # missing
        "step-40\n",  # partial
        "step-50\n",  # unknown (no metadata, no marker)
        "",  # empty
        "\n\n",
        "../step-10\n",  # escapes the root
        "/etc\n",
        ".\n",
        "..\n",
        "a/b\n",
    ],
)
def test_latest_pointer_unusable_falls_back(tmp_path: Path, content: str) -> None:
    make_complete(tmp_path, "step-10")
    make_complete(tmp_path, "step-30")
    make_partial(tmp_path, "step-40")
    make_unknown(tmp_path, "step-50")
    (tmp_path / LATEST_FILE).write_text(content)
    assert latest_complete(tmp_path) == tmp_path / "step-30"


def test_latest_pointer_binary_garbage_falls_back(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-1")
    (tmp_path / LATEST_FILE).write_bytes(b"\xff\xfe\x00garbage")
    assert latest_complete(tmp_path) == tmp_path / "step-1"


def test_latest_pointer_is_a_directory_falls_back(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-1")
    (tmp_path / LATEST_FILE).mkdir()
    assert latest_complete(tmp_path) == tmp_path / "step-1"


def test_latest_pointer_to_missing_with_no_fallback(tmp_path: Path) -> None:
    (tmp_path / LATEST_FILE).write_text("step-5\n")
    make_partial(tmp_path, "step-6")
    assert latest_complete(tmp_path) is None


# --------------------------------------------------------------------------- update_latest


def test_update_latest_writes_and_replaces(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-1")
    make_complete(tmp_path, "step-2")
    out = update_latest(tmp_path, "step-1")
    assert out == tmp_path / LATEST_FILE
    assert out.read_text() == "step-1\n"
    assert out.stat().st_mode & 0o777 == 0o644
    update_latest(tmp_path, "step-2")
    assert out.read_text() == "step-2\n"
    # accepts a path whose parent is the root
    update_latest(tmp_path, str(tmp_path / "step-1"))
    assert out.read_text() == "step-1\n"
    # no temp files left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "step-1", "step-2"]


def test_update_latest_is_atomic_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the rename fails, the old pointer stays and the temp file is removed."""
    make_complete(tmp_path, "step-1")
    make_complete(tmp_path, "step-2")
    update_latest(tmp_path, "step-1")

    def boom(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        update_latest(tmp_path, "step-2")
    monkeypatch.undo()
    assert (tmp_path / LATEST_FILE).read_text() == "step-1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "step-1", "step-2"]


def test_update_latest_fsyncs_file_and_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_complete(tmp_path, "step-1")
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    update_latest(tmp_path, "step-1")
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path
    assert Path(synced[0]).name.startswith(".latest.")
    assert Path(synced[1]) == tmp_path


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "step-1\0"])
def test_update_latest_rejects_bad_names(tmp_path: Path, name: str) -> None:
    make_complete(tmp_path, "step-1")
    with pytest.raises(ValueError, match="latest must name a subdirectory"):
        update_latest(tmp_path, name)
    assert not (tmp_path / LATEST_FILE).exists()


def test_update_latest_rejects_missing_partial_unknown(tmp_path: Path) -> None:
    make_partial(tmp_path, "step-2")
    make_unknown(tmp_path, "step-3")
    for name in ("step-1", "step-2", "step-3"):
        with pytest.raises(ValueError, match="not a complete checkpoint"):
            update_latest(tmp_path, name)
    assert not (tmp_path / LATEST_FILE).exists()


def test_update_latest_missing_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        update_latest(tmp_path / "nope", "step-1")


def test_update_latest_rejects_path_outside_root(tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_complete(other, "step-1")
    (tmp_path / "root").mkdir()
    with pytest.raises(ValueError, match="latest must name a subdirectory"):
        update_latest(tmp_path / "root", str(other / "step-1"))


# --------------------------------------------------------------------------- cleanup


def test_cleanup_incomplete(tmp_path: Path) -> None:
    make_complete(tmp_path, "step-1")
    p2 = make_partial(tmp_path, "step-2")
    p3 = make_partial(tmp_path, "step_3")
    p4 = make_partial(tmp_path, "step-4")
    make_unknown(tmp_path, "step-5")
    nested = make_partial(tmp_path, "step-6")
    (nested / "sub").mkdir()
    (nested / "sub" / "f").write_bytes(b"y")
    make_partial(tmp_path, "scratch")  # not step-named: left alone

    removed = cleanup_incomplete(tmp_path, exclude=[p3, "step-4"])
    assert removed == [p2, nested]
    assert not p2.exists()
    assert not nested.exists()
    assert p3.exists()
    assert p4.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "scratch",
        "step-1",
        "step-4",
        "step-5",
        "step_3",
    ]
    # idempotent
    assert cleanup_incomplete(tmp_path, exclude=[p3, "step-4"]) == []


def test_cleanup_replaces_a_symlinked_marker_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A partial directory whose marker is a symlink (to a file elsewhere, or dangling) is
    removed like the others, links unlinked and never followed; the later ones go too."""
    from dcp_datastates.cli import main

    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "keep.bin"
    victim.write_bytes(b"precious")
    p1 = make_partial(root, "step-1")
    p2 = root / "step-2"
    p2.mkdir()
    (p2 / INCOMPLETE_MARKER).symlink_to(victim)
    (p2 / "__0_0.distcp").symlink_to(outside)  # a linked directory: the link goes, not it
    p3 = root / "step-3"
    p3.mkdir()
    (p3 / INCOMPLETE_MARKER).symlink_to(outside / "nothing-here")
    (p3 / "__0_0.distcp").write_bytes(b"x")
    p4 = make_partial(root, "step-4")
    assert main(["cleanup", str(root)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert all(f"removed {p}" in out for p in (p1, p2, p3, p4)), out
    assert list(root.iterdir()) == []
    assert victim.read_bytes() == b"precious" and sorted(os.listdir(outside)) == ["keep.bin"]


def test_cleanup_goes_on_past_a_directory_it_cannot_remove(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError on one partial directory is reported naming it (exit 1); the others go."""
    import dcp_datastates.lifecycle.checkpoints as ck
    from dcp_datastates.cli import main

    p1, p2, p3 = (make_partial(tmp_path, f"step-{i}") for i in (1, 2, 3))
    real = ck._remove_checkpoint_dir

    def refuse_p2(path: Path, *args: object, **kwargs: object) -> bool:
        if path == p2:
            raise PermissionError(13, "Permission denied", str(path / "__0_0.distcp"))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ck, "_remove_checkpoint_dir", refuse_p2)
    assert main(["cleanup", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"could not remove {p2}" in err and "Permission denied" in err, err
    assert not p1.exists() and p2.exists() and not p3.exists()
    with pytest.raises(PermissionError, match="step-2"):
        cleanup_incomplete(tmp_path)


def test_cleanup_exclude_accepts_str_paths_and_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    p1 = make_partial(root, "step-1")
    p2 = make_partial(root, "step-2")
    monkeypatch.chdir(tmp_path)
    removed = cleanup_incomplete("ckpt", exclude=[str(p1), Path("ckpt") / "step-2"])
    assert removed == []
    assert p1.exists()
    assert p2.exists()


# --------------------------------------------------------------------------- retention policy


@pytest.mark.parametrize(
    "kwargs",
    [{"keep_last": 0}, {"keep_last": -1}, {"keep_every": 0}, {"keep_every": -5}],
)
def test_policy_rejects_non_positive(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        RetentionPolicy(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"keep_last": 1.0}, {"keep_last": "2"}, {"keep_every": True}, {"keep_last": False}],
)
def test_policy_rejects_non_int(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_is_frozen() -> None:
    policy = RetentionPolicy(keep_last=2)
    with pytest.raises(AttributeError):
        policy.keep_last = 3  # type: ignore[misc]


def test_policy_kept_steps() -> None:
    steps = [10, 20, 30, 40, 50, 60]
    assert RetentionPolicy().kept_steps(steps) == set(steps)
    assert RetentionPolicy(keep_last=2).kept_steps(steps) == {50, 60}
    assert RetentionPolicy(keep_last=100).kept_steps(steps) == set(steps)
    assert RetentionPolicy(keep_every=20).kept_steps(steps) == {20, 40, 60}
    assert RetentionPolicy(keep_last=1, keep_every=25).kept_steps(steps) == {50, 60}
    assert RetentionPolicy(keep_last=1).kept_steps([]) == set()


# --------------------------------------------------------------------------- prune


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_prune_keep_last(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4, 5):
        make_complete(tmp_path, f"step-{s}")
    removed = prune(tmp_path, RetentionPolicy(keep_last=2))
    assert removed == [tmp_path / "step-1", tmp_path / "step-2", tmp_path / "step-3"]
    assert names(tmp_path) == ["step-4", "step-5"]


def test_prune_keep_every_and_last(tmp_path: Path) -> None:
    for s in range(10, 101, 10):
        make_complete(tmp_path, f"step-{s}")
    removed = prune(tmp_path, RetentionPolicy(keep_last=1, keep_every=40))
    assert [p.name for p in removed] == [f"step-{s}" for s in (10, 20, 30, 50, 60, 70, 90)]
    assert names(tmp_path) == ["step-100", "step-40", "step-80"]


def test_prune_keep_every_only_protects_newest(tmp_path: Path) -> None:
    """With no latest pointer, the newest complete checkpoint is the resume point."""
    for s in (3, 4, 5):
        make_complete(tmp_path, f"step-{s}")
    removed = prune(tmp_path, RetentionPolicy(keep_every=4))
    assert [p.name for p in removed] == ["step-3"]
    assert names(tmp_path) == ["step-4", "step-5"]


def test_prune_never_deletes_latest_partial_unknown_or_excluded(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4, 5):
        make_complete(tmp_path, f"step-{s}")
    make_partial(tmp_path, "step-6")
    make_unknown(tmp_path, "step-0")
    make_complete(tmp_path, "step-7")  # an in-flight save that just committed
    update_latest(tmp_path, "step-2")
    removed = prune(tmp_path, RetentionPolicy(keep_last=1), exclude=["step-7"])
    assert [p.name for p in removed] == ["step-1", "step-3", "step-4"]
    assert names(tmp_path) == [LATEST_FILE, "step-0", "step-2", "step-5", "step-6", "step-7"]
    assert latest_complete(tmp_path) == tmp_path / "step-2"


def test_prune_excluded_do_not_count_towards_keep_last(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        make_complete(tmp_path, f"step-{s}")
    update_latest(tmp_path, "step-2")
    removed = prune(tmp_path, RetentionPolicy(keep_last=1), exclude=[tmp_path / "step-3"])
    # step-3 is excluded, step-2 is the newest remaining and latest; step-1 goes
    assert [p.name for p in removed] == ["step-1"]


def test_prune_latest_pointing_at_missing(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        make_complete(tmp_path, f"step-{s}")
    (tmp_path / LATEST_FILE).write_text("step-9\n")
    removed = prune(tmp_path, RetentionPolicy(keep_last=1))
    assert [p.name for p in removed] == ["step-1", "step-2"]
    assert names(tmp_path) == [LATEST_FILE, "step-3"]


def test_prune_keeps_everything_by_default(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        make_complete(tmp_path, f"step-{s}")
    assert prune(tmp_path, RetentionPolicy()) == []
    assert names(tmp_path) == ["step-1", "step-2", "step-3"]


def test_prune_rejects_non_policy(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        prune(tmp_path, 3)  # type: ignore[arg-type]


def test_prune_removes_metadata_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while deleting leaves a partial directory, never a fake-complete one."""
    for s in (1, 2):
        d = make_complete(tmp_path, f"step-{s}", files=3)
        (d / "sub").mkdir()
        (d / "sub" / "x").write_bytes(b"z")
    events: list[str] = []
    real_unlink = os.unlink

    def spy_unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        name = os.path.basename(os.fspath(path))
        events.append(name)
        if name == METADATA_FILE:
            real_unlink(path)
            return
        raise OSError("simulated crash")

    # Path.unlink goes through os.unlink too
    monkeypatch.setattr(os, "unlink", spy_unlink)
    monkeypatch.setattr(shutil, "rmtree", spy_unlink)
    with pytest.raises(OSError, match="simulated crash"):
        prune(tmp_path, RetentionPolicy(keep_last=1))
    monkeypatch.undo()

    assert events[0] == METADATA_FILE
    assert len(events) == 2  # the crash hit the first data entry
    (first, second) = list_checkpoints(tmp_path)
    assert first.name == "step-1"
    assert first.partial
    assert second.complete
    # the partial leftovers are swept up afterwards
    assert cleanup_incomplete(tmp_path) == [tmp_path / "step-1"]
    assert names(tmp_path) == ["step-2"]


def test_prune_deletes_nested_dirs(tmp_path: Path) -> None:
    d = make_complete(tmp_path, "step-1")
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "b" / "c").write_bytes(b"1")
    make_complete(tmp_path, "step-2")
    assert prune(tmp_path, RetentionPolicy(keep_last=1)) == [d]
    assert not d.exists()


def test_prune_does_not_follow_symlinks_out_of_checkpoint(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    root = tmp_path / "root"
    d = make_complete(root, "step-1")
    os.symlink(outside, d / "link")
    make_complete(root, "step-2")
    assert prune(root, RetentionPolicy(keep_last=1)) == [d]
    assert (outside / "precious").read_bytes() == b"keep me"
