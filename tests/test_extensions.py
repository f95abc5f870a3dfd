"""Stream-transform extensions (``_extensions``): what DataStatesWriter writes through DCP's
extensions (ZStandard, a custom one), torch's stock FileSystemReader reads bit for bit.

The patterns of torch's own DCP tests of ``FileSystemWriter(_extensions=...)`` (a module state
dict plus a Stateful blob, one and two writing threads, a custom extension loaded through a
registry that knows it, ZStandard through the default registry), with our writer, plus what is
ours: ``async_save`` off the caller's thread, backpressure through a small cache, spilled
at-call state, the manifest and ``verify``, and failures that commit nothing.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import threading
from typing import IO, Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.stateful import Stateful

from dcp_datastates import DataStatesWriter, verify_checkpoint
from dcp_datastates.restore.reader import DataStatesReader

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.skipif(not ZStandard.is_available(), reason="needs the zstandard package"),
]


class XorMask(StreamTransformExtension):
    """A custom transform: every byte XORed with a key (its own inverse). Records the threads
    its writers ran in, and can be told to fail after some bytes."""

    threads: set[int] = set()
    fail_after: int | None = None  # bytes written before the next writer raises OSError

    def __init__(self, key: int = 0x5A) -> None:
        super().__init__()
        self.key = key

    @staticmethod
    def registry_name() -> str:
        return "stream.test-xor"

    @staticmethod
    def from_descriptor(version: str) -> XorMask:
        if version != "1":
            raise ValueError(f"unknown version {version!r}")
        return XorMask()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def _xor(self, b: Any) -> bytes:
        data = bytes(memoryview(b).cast("B"))
        table = bytes(i ^ self.key for i in range(256))
        return data.translate(table)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        XorMask.threads.add(threading.get_ident())
        ext = self

        class Writer(io.RawIOBase):
            written = 0

            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                n = len(memoryview(b))
                if XorMask.fail_after is not None and self.written + n > XorMask.fail_after:
                    XorMask.fail_after = None  # once
                    raise OSError(28, "No space left on device (injected)")
                self.written += n
                output.write(ext._xor(b))
                return n

            def flush(self) -> None:
                output.flush()

            def close(self) -> None:
                if not self.closed:
                    output.close()
                super().close()

        return Writer()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - DCP's name
        ext = self

        class Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                data = input.read(len(memoryview(b)))
                if not data:
                    return 0
                memoryview(b).cast("B")[: len(data)] = ext._xor(data)
                return len(data)

        return io.BufferedReader(Reader())  # type: ignore[return-value]


def xor_registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(XorMask)
    return reg


class Blob(Stateful):
    """A Stateful holding raw bytes: DCP saves it as a BYTE_IO item."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"blob": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["blob"]


def module_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1))
    sd: dict[str, Any] = dict(m.state_dict())
    g = torch.Generator().manual_seed(seed)
    sd["compressible"] = torch.zeros(256, 256)  # 256 KiB of zeros
    sd["compressible"][::7] = 1.5
    sd["random"] = torch.randn(300, 200, generator=g)  # 240 KB
    sd["bf16"] = torch.randn(33, 7, generator=g).to(torch.bfloat16)
    sd["empty"] = torch.empty(0, 5)
    sd["scalar"] = torch.tensor(3.25)
    sd["strided"] = torch.arange(64.0).reshape(8, 8)[::2, 1::3]
    sd["nested"] = {"step": 7, "name": "run-α", "ints": torch.arange(10)}
    sd["test_blob"] = Blob(b"SomeBlobForTesting" * 100)
    return sd


def fresh_dest(sd: dict[str, Any]) -> dict[str, Any]:
    out = zeros_like_state({k: v for k, v in sd.items() if k != "test_blob"})
    out["test_blob"] = Blob(b"")
    return out


def assert_loaded(sd: dict[str, Any], out: dict[str, Any]) -> None:
    assert out["test_blob"].value == sd["test_blob"].value
    assert_state_equal(
        {k: v for k, v in sd.items() if k != "test_blob"},
        {k: v for k, v in out.items() if k != "test_blob"},
    )


def metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def save(w: DataStatesWriter, sd: dict[str, Any], path: str, mode: str) -> None:
    if mode == "save":
        dcp.save(sd, storage_writer=w, checkpoint_id=path)
    else:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(timeout=60)


KNOBS = [
    pytest.param({}, id="cache-fits"),
    pytest.param(
        {"host_cache_size": "64KiB", "chunk_size": "16KiB", "flush_threads": 1}, id="backpressure"
    ),
    pytest.param(
        {"host_cache_size": "96KiB", "chunk_size": "8KiB", "files_per_rank": 3,
         "capture": "lazy"},
        id="backpressure-3files-lazy",
    ),
    pytest.param({"host_cache_size": "64KiB", "capture": "eager"}, id="spill"),
]


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("knobs", KNOBS)
def test_zstandard_round_trip_with_stock_reader(
    tmp_path: Any, writer_factory: Any, mode: str, knobs: dict[str, Any]
) -> None:
    sd = module_state()
    w: DataStatesWriter = writer_factory(_extensions=[ZStandard()], **knobs)
    path = str(tmp_path / "ckpt")
    save(w, sd, path, mode)

    md = metadata(path)
    for idx, info in md.storage_data.items():
        assert info.transform_descriptors == ["stream.zstd/1"], idx
    # The stock reader with its default registry, and dcp.load choosing it by itself.
    out = fresh_dest(sd)
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert_loaded(sd, out)
    out = fresh_dest(sd)
    dcp.load(out, checkpoint_id=path)
    assert_loaded(sd, out)
    # Compressed: 256 KiB of mostly zeros take a small fraction of that.
    comp = md.storage_data[next(i for i in md.storage_data if i.fqn == "compressible")]
    assert comp.length < 16 * 1024
    rep = verify_checkpoint(path)
    assert rep.fully_verified, rep.summary()
    assert w.engine_counters()["cache_used_bytes"] == 0
    assert w.engine_counters()["jobs"] == 0


@pytest.mark.parametrize("files", [1, 2])
def test_custom_extension_through_its_registry(
    tmp_path: Any, writer_factory: Any, files: int
) -> None:
    sd = module_state(1)
    w = writer_factory(_extensions=[XorMask()], files_per_rank=files, flush_threads=files)
    path = str(tmp_path / "default")  # the writer's own path: torch's tests pass no checkpoint_id
    dcp.save(state_dict=sd, storage_writer=w)
    data_files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert 1 <= len(data_files) <= files  # a thread that took no item makes no file
    raw = b"".join(open(os.path.join(path, n), "rb").read() for n in data_files)
    assert b"SomeBlobForTesting" not in raw  # transformed on disk
    assert XorMask()._xor(b"SomeBlobForTesting") in raw

    out = fresh_dest(sd)
    dcp.load(out, storage_reader=FileSystemReader(path, _extension_registry=xor_registry()))
    assert_loaded(sd, out)
    # The descriptor is what .metadata records: the default registry does not know it.
    with pytest.raises(BaseException, match="Unknown extension"):
        dcp.load(fresh_dest(sd), storage_reader=FileSystemReader(path))
    # verify checks the stored bytes, and says it could not decode them.
    rep = verify_checkpoint(path)
    assert rep.ok and not rep.fully_verified, rep.summary()
    assert rep.exit_code == 3
    assert any("stream.test-xor/1" in u for u in rep.unverified)


def test_transform_runs_off_the_callers_thread(tmp_path: Any, writer_factory: Any) -> None:
    XorMask.threads = set()
    sd = module_state(2)
    w = writer_factory(_extensions=[XorMask()], files_per_rank=2)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    fut.result(timeout=60)
    assert XorMask.threads
    assert threading.get_ident() not in XorMask.threads


def test_descriptors_match_filesystemwriter(tmp_path: Any, writer_factory: Any) -> None:
    """Same list, same descriptors per item (outermost first), as torch's own writer."""
    sd = {"a": torch.arange(100.0), "b": {"x": 1}}
    exts = [XorMask(), ZStandard()]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    dcp.save(sd, storage_writer=writer_factory(_extensions=exts), checkpoint_id=ours)
    dcp.save(sd, storage_writer=FileSystemWriter(theirs, _extensions=exts))
    got = {k.fqn: v.transform_descriptors for k, v in metadata(ours).storage_data.items()}
    want = {k.fqn: v.transform_descriptors for k, v in metadata(theirs).storage_data.items()}
    assert got == want == {"a": ["stream.zstd/1", "stream.test-xor/1"],
                           "b.x": ["stream.zstd/1", "stream.test-xor/1"]}


def test_our_readers_and_load(tmp_path: Any, writer_factory: Any) -> None:
    from dcp_datastates import load

    sd = module_state(3)
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=writer_factory(_extensions=[ZStandard()]), checkpoint_id=path)
    out = fresh_dest(sd)
    dcp.load(out, storage_reader=DataStatesReader(path))  # takes the stock path for these
    assert_loaded(sd, out)
    out = fresh_dest(sd)
    load(out, path)  # verified first
    assert_loaded(sd, out)


def test_memory_url(writer_factory: Any) -> None:
    sd = module_state(4)
    url = "memory://dcpds-ext/ckpt"
    w = writer_factory(_extensions=[ZStandard()], host_cache_size="64KiB", chunk_size="16KiB")
    dcp.async_save(sd, storage_writer=w, checkpoint_id=url).result(timeout=60)
    out = fresh_dest(sd)
    dcp.load(out, checkpoint_id=url)  # FsspecReader
    assert_loaded(sd, out)
    assert verify_checkpoint(url).fully_verified
    fsspec.filesystem("memory").rm("/dcpds-ext", recursive=True)


def test_manifest_records_transformed_items(tmp_path: Any, writer_factory: Any) -> None:
    sd = {"t": torch.ones(1000), "n": 5}
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=writer_factory(_extensions=[ZStandard()]), checkpoint_id=path)
    with open(os.path.join(path, "__datastates_manifest_0.json")) as f:
        man = json.load(f)
    assert man["version"] == 3
    items = {it["fqn"]: it for it in man["items"]}
    t = items["t"]
    assert t["transform"] == ["stream.zstd/1"] and t["payload_bytes"] == 4000
    assert t["chunks"] == [[t["archive_offset"], t["archive_length"], t["chunks"][0][2]]]
    assert t["decoded_bytes"] > 4000  # the whole torch.save archive
    assert items["n"]["dtype"] == "bytes" and items["n"]["transform"] == ["stream.zstd/1"]
    # Untransformed saves keep version 1 manifests, without these fields.
    plain = str(tmp_path / "plain")
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=plain)
    with open(os.path.join(plain, "__datastates_manifest_0.json")) as f:
        text = f.read()
    assert json.loads(text)["version"] == 1 and "transform" not in text


def test_verify_finds_damage_in_compressed_bytes(tmp_path: Any, writer_factory: Any) -> None:
    sd = {"t": torch.arange(20000.0)}
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=writer_factory(_extensions=[ZStandard()]), checkpoint_id=path)
    info = next(iter(metadata(path).storage_data.values()))
    fp = os.path.join(path, info.relative_path)
    with open(fp, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = verify_checkpoint(path)
    assert not rep.ok
    assert any("'t'" in p and "checksum mismatch" in p for p in rep.problems), rep.summary()


@pytest.mark.parametrize(
    ("exts", "err", "match"),
    [
        ([ZStandard], TypeError, r"_extensions\[0\] is the class ZStandard"),
        ([ZStandard(), object()], TypeError, r"_extensions\[1\] is object.*StreamTransform"),
        (ZStandard(), TypeError, "must be a sequence"),
    ],
)
def test_bad_extensions_named(writer_factory: Any, exts: Any, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        writer_factory(_extensions=exts)


@pytest.mark.parametrize("knob", [{"format": "safetensors"}, {"incremental": True}])
def test_incompatible_settings_refused(writer_factory: Any, knob: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="_extensions needs format='torch' and incremental=False"):
        writer_factory(_extensions=[ZStandard()], **knob)


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_failing_transform_commits_nothing(tmp_path: Any, writer_factory: Any, mode: str) -> None:
    sd = module_state(5)
    w = writer_factory(
        _extensions=[XorMask()], files_per_rank=2, host_cache_size="64KiB", chunk_size="16KiB"
    )
    path = str(tmp_path / "c")
    XorMask.fail_after = 100_000
    try:
        with pytest.raises(BaseException, match=r"_extensions into __0_\d\.distcp.*No space"):
            save(w, sd, path, mode)
    finally:
        XorMask.fail_after = None
    assert not os.path.exists(os.path.join(path, ".metadata"))
    assert not [n for n in os.listdir(path) if n.endswith(".distcp")]  # partial files removed
    assert w.engine_counters()["cache_used_bytes"] == 0
    # The writer stays usable.
    save(w, sd, path, mode)
    out = fresh_dest(sd)
    dcp.load(out, storage_reader=FileSystemReader(path, _extension_registry=xor_registry()))
    assert_loaded(sd, out)


def test_tensor_changed_before_its_lazy_copy_fails_the_save(
    tmp_path: Any, writer_factory: Any
) -> None:
    w = writer_factory(_extensions=[ZStandard()], capture="lazy")
    sd = {"weights": torch.zeros(50_000)}
    path = str(tmp_path / "c")
    w.engine.pause_copies(True)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
    sd["weights"].add_(1.0)  # before its copy: never written torn, never committed
    w.engine.pause_copies(False)
    with pytest.raises(BaseException, match="weights.*modified in place"):
        fut.result(timeout=30)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    w.wait_captured()
    dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(timeout=30)
    out = {"weights": torch.zeros(50_000)}
    dcp.load(out, checkpoint_id=path)
    assert bool((out["weights"] == 1).all())


def _two_rank_body(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = {"rows": torch.randn(5, 64, generator=g), "plain": torch.zeros(4096)}
    sd: dict[str, Any] = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "plain": full["plain"].clone(),  # on every rank: deduplicated by DCP's planner
        "meta": {"step": 3},
    }
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(root, "1MiB", chunk_size="16KiB", _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=w, checkpoint_id=f"{root}/sync", process_group=pg)
    dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/async",
                   process_group=pg).result(timeout=60)
    w.close()
    dist.barrier()
    for name in ("sync", "async"):
        dest = {
            "rows": distribute_tensor(torch.zeros(5, 64), mesh, [Replicate()]),
            "plain": torch.ones(4096),
            "meta": {"step": 0},
        }
        dcp.load(dest, storage_reader=FileSystemReader(f"{root}/{name}"), process_group=pg)
        assert torch.equal(dest["rows"].full_tensor(), full["rows"]), name
        assert torch.equal(dest["plain"], full["plain"]) and dest["meta"]["step"] == 3
        if rank == 0:
            rep = verify_checkpoint(f"{root}/{name}")
            assert rep.fully_verified and rep.ranks == 2, rep.summary()
    dist.barrier()


def test_two_ranks_sync_and_async(tmp_path: Any) -> None:
    from dist_utils import run_ranks

    run_ranks(_two_rank_body, str(tmp_path / "ckpt"), tmp_path=tmp_path, timeout_s=180)


def test_verify_compares_transforms_with_metadata(tmp_path: Any, writer_factory: Any) -> None:
    """A .metadata that no longer records the transforms (the stock reader would then read
    compressed bytes as an archive) is damage, named."""
    path = str(tmp_path / "c")
    dcp.save({"t": torch.ones(100)}, storage_writer=writer_factory(_extensions=[ZStandard()]),
             checkpoint_id=path)
    md = metadata(path)
    for info in md.storage_data.values():
        info.transform_descriptors = None
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    rep = verify_checkpoint(path)
    assert any("'t'" in p and "transforms None" in p for p in rep.problems), rep.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_cuda_tensors_compressed(tmp_path: Any, writer_factory: Any, mode: str) -> None:
    """CUDA state: copied into the host cache by the engine's streams, then compressed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"w": torch.randn(512, 256, device="cuda", generator=g),
          "z": torch.zeros(4096, device="cuda", dtype=torch.bfloat16), "step": 3}
    w = writer_factory(_extensions=[ZStandard()], host_cache_size="256KiB", chunk_size="64KiB")
    path = str(tmp_path / "c")
    save(w, sd, path, mode)
    want = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    out = zeros_like_state(want)
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert_state_equal(want, out)
    assert verify_checkpoint(path).fully_verified
