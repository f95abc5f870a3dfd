"""torchsnapshot through the ``datastates`` storage plugin: discovery by entry point, take and
async_take restored bit for bit (1 and 2 ranks), partial reads, the stock fs plugin reading the
same files, verification, and misuse (corruption, write failures, a plugin never closed)."""

from __future__ import annotations

import asyncio
import glob
import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchsnapshot")
from dist_utils import run_ranks  # noqa: E402
from torchsnapshot import Snapshot, StateDict  # noqa: E402
from torchsnapshot.io_types import ReadIO, WriteIO  # noqa: E402
from torchsnapshot.storage_plugin import url_to_storage_plugin  # noqa: E402

from dcp_datastates import _core  # noqa: E402
from dcp_datastates.errors import CheckpointSaveError, IntegrityError  # noqa: E402
from dcp_datastates.format.verify import verify_checkpoint  # noqa: E402
from dcp_datastates.integrations.torchsnapshot import (  # noqa: E402
    DataStatesStoragePlugin,
    storage_plugin,
)

REPO = Path(__file__).resolve().parent.parent
GROUP, NAME = "storage_plugins", "datastates"


def _declared_entry_point() -> str:
    """The entry point pyproject.toml declares for torchsnapshot (what an install registers)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    return str(doc["project"]["entry-points"][GROUP][NAME])


def _installed_entry_point() -> str | None:
    """The ``datastates`` storage plugin the environment's installed metadata registers."""
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name == NAME:
            return str(ep.value)
    return None


def _entry_point_dir(tmp: Path) -> str | None:
    """Where the package is not installed (a source tree on PYTHONPATH), a directory holding
    distribution metadata with the declared entry point, to put on sys.path so that
    torchsnapshot's real discovery (importlib metadata) finds it; None where it is installed.
    In CI (``CI`` set) the installed package must register it: a missing one fails."""
    if _installed_entry_point() is not None:
        return None
    if os.environ.get("CI"):
        pytest.fail("the installed dcp_datastates registers no 'datastates' storage_plugins entry "
                    "point (pyproject.toml [project.entry-points.storage_plugins])")
    info = tmp / "dcp_datastates_entry_points-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcp_datastates_entry_points\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{NAME} = {_declared_entry_point()}\n")
    return str(tmp)


@pytest.fixture(scope="module")
def discoverable(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """Makes ``datastates://`` resolve through the entry point (see _entry_point_dir)."""
    extra = _entry_point_dir(tmp_path_factory.mktemp("ep"))
    if extra is not None:
        sys.path.append(extra)
    yield extra
    if extra is not None:
        sys.path.remove(extra)


# -- discovery -----------------------------------------------------------------------------------
def test_pyproject_registers_the_factory() -> None:
    value = _declared_entry_point()
    module, _, attr = value.partition(":")
    assert getattr(importlib.import_module(module), attr) is storage_plugin
    installed = _installed_entry_point()
    if installed is not None or os.environ.get("CI"):
        assert installed == value


def test_url_resolves_through_the_entry_point(discoverable: str | None, tmp_path: Path) -> None:
    plugin = url_to_storage_plugin(f"datastates://{tmp_path}/s", {"buffer_size": "8MiB"})
    try:
        assert isinstance(plugin, DataStatesStoragePlugin)
        assert plugin.root == f"{tmp_path}/s" and plugin.options.buffer_size == 8 << 20
    finally:
        plugin.sync_close()


def test_bad_options_and_object_store_urls_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown datastates storage option"):
        storage_plugin(str(tmp_path), {"cache": 1})
    with pytest.raises(ValueError, match="local paths only"):
        storage_plugin("s3://bucket/ckpt", None)


# -- the plugin on its own -----------------------------------------------------------------------
SIZES = {"empty": 0, "tiny": 10, "odd": (1 << 20) + 3, "big": (9 << 20) + 5}


def _payload(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


@pytest.mark.parametrize("o_direct", [True, False])
def test_plugin_writes_plain_files_and_reads_them_verified(tmp_path: Path, o_direct: bool) -> None:
    # a 2 MiB buffer and 1 MiB chunks: the 9 MiB object streams through it (backpressure)
    opts = {"buffer_size": "2MiB", "chunk_size": "1MiB", "o_direct": o_direct}
    plugin = storage_plugin(str(tmp_path), opts)
    loop = asyncio.new_event_loop()
    data = {k: _payload(n, i) for i, (k, n) in enumerate(SIZES.items())}

    async def write_all() -> None:
        writes = [plugin.write(WriteIO(path=f"0/obj/{k}", buf=v)) for k, v in data.items()]
        writes.append(plugin.write(WriteIO(path="view", buf=memoryview(bytearray(data["big"])))))
        await asyncio.gather(*writes)

    loop.run_until_complete(write_all())
    for k, v in data.items():
        assert (tmp_path / "0" / "obj" / k).read_bytes() == v  # plain bytes: stock-readable
        rio = ReadIO(path=f"0/obj/{k}")
        plugin.sync_read(rio, loop)
        assert rio.buf.getvalue() == v
    big = data["big"]
    for lo, hi in [(0, 1), (5, (1 << 20) + 7), ((3 << 20), (4 << 20)), (len(big) - 9, len(big))]:
        rio = ReadIO(path="0/obj/big", byte_range=(lo, hi))
        plugin.sync_read(rio, loop)
        assert rio.buf.getvalue() == big[lo:hi]
    assert plugin.stats["objects_written"] == 5
    assert plugin.stats["bytes_verified"] >= sum(SIZES.values())
    plugin.sync_close(loop)
    plugin.sync_close(loop)  # idempotent
    loop.close()


def test_stock_written_object_is_read_unverified(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"abc" * 1000)
    plugin = storage_plugin(str(tmp_path), None)
    rio = ReadIO(path="x", byte_range=(3, 9))
    plugin.sync_read(rio)
    assert rio.buf.getvalue() == b"abcabc"
    plugin.sync_close()


# -- torchsnapshot end to end --------------------------------------------------------------------
class Counter:
    """A Stateful application object."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(range(self.n))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        assert sd["history"] == list(range(self.n))


def _app(seed: int, trained: bool) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))
    model.register_buffer("big", torch.randn(600_000))  # 2.4 MB: its own O_DIRECT chunks
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    counter = Counter(0)
    if trained:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 64)).square().sum().backward()
            opt.step()
        counter.n = 17
    return {"model": model, "optim": opt, "counter": counter, "extra": StateDict(step=3)}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, t in a["model"].state_dict().items():
        u = b["model"].state_dict()[k]
        assert t.dtype == u.dtype and torch.equal(t.view(-1).view(torch.uint8),
                                                  u.view(-1).view(torch.uint8)), k
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k, v in st.items():
            w = sb["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
    assert a["counter"].n == b["counter"].n and b["extra"]["step"] == a["extra"]["step"]


def _take_restore_body(rank: int, world: int, root: str, mode: str, ep_dir: str | None) -> int:
    if ep_dir is not None and ep_dir not in sys.path:
        sys.path.append(ep_dir)
    url = f"datastates://{root}"
    app = _app(seed=rank, trained=True)
    opts = {"buffer_size": "4MiB", "chunk_size": "1MiB"}
    if mode == "take":
        Snapshot.take(url, app, storage_options=opts)
    else:
        Snapshot.async_take(url, app, storage_options=opts).wait()
    fresh = _app(seed=100 + rank, trained=False)
    Snapshot(url).restore(fresh)
    _assert_same(app, fresh)
    # the same files through torchsnapshot's stock fs plugin
    stock = _app(seed=200 + rank, trained=False)
    Snapshot(root).restore(stock)
    _assert_same(app, stock)
    # a partial read: one tensor out of a batched object (a byte range)
    w = Snapshot(url).read_object(f"{rank}/model/0.weight")
    assert torch.equal(w, app["model"][0].weight)
    return rank


@pytest.mark.parametrize("mode", ["take", "async_take"])
@pytest.mark.parametrize("world", [1, 2])
def test_take_and_restore_bit_exact(
    discoverable: str | None, tmp_path: Path, world: int, mode: str
) -> None:
    root = str(tmp_path / "snap")
    out = run_ranks(_take_restore_body, root, mode, discoverable, tmp_path=tmp_path,
                    world_size=world, timeout_s=300)
    assert out == list(range(world))
    rep = verify_checkpoint(f"datastates://{root}")
    assert rep.exit_code == 0, rep.summary()
    assert rep.ranks == world and rep.items >= 3
    assert len(glob.glob(os.path.join(root, ".datastates", "*.crc.jsonl"))) == world


def test_take_in_process_and_verify_damage(discoverable: str | None, tmp_path: Path) -> None:
    root = tmp_path / "snap"
    app = _app(seed=1, trained=True)
    Snapshot.take(f"datastates://{root}", app)
    assert verify_checkpoint(str(root)).exit_code == 0
    victim = max((p for p in root.rglob("*") if p.is_file() and ".datastates" not in p.parts),
                 key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = verify_checkpoint(str(root))
    assert rep.exit_code == 1 and str(victim) in "\n".join(rep.problems), rep.summary()
    with pytest.raises(IntegrityError, match=str(victim)):
        Snapshot(f"datastates://{root}").restore(_app(seed=2, trained=False))
    # a snapshot of the stock plugin: verify says it has nothing to check against
    Snapshot.take(str(tmp_path / "stock"), _app(seed=1, trained=True))
    rep = verify_checkpoint(str(tmp_path / "stock"))
    assert rep.exit_code == 2 and "checksum index" in (rep.error or "")


# -- failures ------------------------------------------------------------------------------------
def test_unwritable_directory_fails_clearly(discoverable: str | None, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(CheckpointSaveError, match=str(blocker)):
        Snapshot.take(f"datastates://{blocker}/snap", _app(seed=1, trained=True))


def test_write_fault_fails_the_take(discoverable: str | None, tmp_path: Path) -> None:
    root = tmp_path / "snap"
    _core.set_write_fault(f"{root}/batched", 5)  # EIO on every write of a batched object
    try:
        with pytest.raises(CheckpointSaveError, match=f"{root}/batched/.*injected fault"):
            Snapshot.take(f"datastates://{root}", _app(seed=1, trained=True),
                          storage_options={"o_direct": False})
    finally:
        _core.set_write_fault("", 0)
    assert not (root / ".snapshot_metadata").exists()  # nothing committed


def test_plugin_dropped_without_close_exits(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        from torchsnapshot.io_types import WriteIO
        from dcp_datastates.integrations.torchsnapshot import storage_plugin
        p = storage_plugin({str(tmp_path)!r}, {{"buffer_size": "4MiB"}})
        p.sync_write(WriteIO(path="a", buf=b"x" * (3 << 20)))
        del p
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert (tmp_path / "a").stat().st_size == 3 << 20


def test_benchmark_quick(tmp_path: Path) -> None:
    """benchmarks/torchsnapshot_plugin.py end to end on a small state: JSON and PNG written."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--size", "8MB", "--rounds", "1", "--out", str(out), "--plot", str(png)]
    env = dict(os.environ, BENCH_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([*(p for p in sys.path if p), str(REPO)]))
    run = subprocess.run([sys.executable, "-m", "benchmarks.torchsnapshot_plugin", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    doc = json.loads(out.read_text())
    assert [r["state"].split("-")[1] for r in doc["rows"]] == ["mixed", "large"]
    for r in doc["rows"]:
        for mode in ("take", "async_take"):
            assert set(r["median"][mode]) == {"fs", "datastates"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
