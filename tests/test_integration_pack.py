"""pack/unpack/load_packed: framework checkpoint dicts through DCP exactly (issue 11, item 5)."""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import random
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.integrations.pack import (
    PACKED_KEY,
    PackError,
    is_packed,
    load_flat,
    load_packed,
    pack,
    unpack,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


class Pair(NamedTuple):
    left: Any
    right: Any


@dataclasses.dataclass
class Box:
    name: str
    payload: Any


SIDE_EFFECTS: list[str] = []


def _record(msg: str) -> str:
    SIDE_EFFECTS.append(msg)
    return msg


class Evil:
    """An object whose unpickling runs a function (what a malicious checkpoint would do)."""

    def __reduce__(self) -> Any:
        return (_record, ("code ran",))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality: types, key types and order, tensor dtype/shape/bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.requires_grad == b.requires_grad, path
        bits_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{path}: keys"
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, Box):
        assert a.name == b.name
        assert_same(a.payload, b.payload, f"{path}.payload")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def save_packed(obj: Any, path: str, writer: DataStatesWriter | None = None) -> None:
    sd = pack(obj)
    if writer is None:
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    else:
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, no_dist=True).result()


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.complex64]  # fmt: skip


def random_tensor(rng: random.Random) -> torch.Tensor:
    dt = rng.choice(DTYPES)
    shape = rng.choice([(), (0,), (3,), (2, 3), (4, 0, 2), (3, 4)])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dt.is_floating_point or dt.is_complex:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    elif dt == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        t = torch.randint(0, 100, shape, generator=g).to(dt)
    if t.dim() == 2 and rng.random() < 0.5:
        t = t.t()  # non-contiguous
    return t


def random_obj(rng: random.Random, depth: int, pool: list[torch.Tensor]) -> Any:
    leaf = depth <= 0 or rng.random() < 0.3
    if leaf:
        r = rng.random()
        if r < 0.45:
            t = random_tensor(rng)
            pool.append(t)
            return t
        if r < 0.55 and pool:
            return rng.choice(pool)  # the same tensor object twice
        return rng.choice([None, 0, -7, 2.5, "s", b"b", True, (), {}, [], float("inf")])
    kind = rng.choice(["dict", "od", "dd", "list", "tuple", "pair", "box", "intdict"])
    n = rng.randrange(0, 4)
    kids = [random_obj(rng, depth - 1, pool) for _ in range(n)]
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(kids)}
    if kind == "intdict":  # optimizer-style int keys, mixed with a colliding string key
        d: dict[Any, Any] = {i: v for i, v in enumerate(kids)}
        if kids:
            d["0"] = kids[0]
        return d
    if kind == "od":
        return collections.OrderedDict((f"z{i}", v) for i, v in reversed(list(enumerate(kids))))
    if kind == "dd":
        dd: collections.defaultdict[Any, Any] = collections.defaultdict(list)
        for i, v in enumerate(kids):
            dd[i] = v
        return dd
    if kind == "list":
        return kids
    if kind == "tuple":
        return tuple(kids)
    if kind == "pair":
        return Pair(kids[0] if kids else None, kids)
    return Box("box", kids)


def test_random_nested_structures_round_trip_exactly(tmp_path: Any) -> None:
    rng = random.Random(1234)
    writer = DataStatesWriter(str(tmp_path), host_cache_size="64MiB")
    try:
        for i in range(12):
            pool: list[torch.Tensor] = []
            obj = {"root": random_obj(rng, 4, pool), "again": list(pool[:2])}
            path = str(tmp_path / f"c{i}")
            save_packed(obj, path, writer)
            back = load_packed(path, weights_only=False)
            assert_same(obj, back)
            # identity: a tensor object referenced twice comes back as one object
            ids = {id(t) for t in pool}
            if len(ids) < len(pool) or pool[:2]:
                flat_before = [id(t) for t in _tensors(obj)]
                flat_after = [id(t) for t in _tensors(back)]
                assert _pattern(flat_before) == _pattern(flat_after)
    finally:
        writer.close()


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, Box):
            walk(o.payload)

    walk(obj)
    return out


def _pattern(ids: list[int]) -> list[int]:
    first: dict[int, int] = {}
    return [first.setdefault(i, len(first)) for i in ids]


def adam_checkpoint() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "epoch": 3,
        "callbacks": {},
        "loops": collections.OrderedDict(fit={"step": 3}),
    }
    return model, opt, ckpt


def test_plain_dcp_loses_adam_state_which_pack_keeps(tmp_path: Any) -> None:
    """The bug: DCP's flattening turns int keys into strings; Adam then drops its moments."""
    _, opt, ckpt = adam_checkpoint()
    flat = str(tmp_path / "plain")
    dcp.save(ckpt, checkpoint_id=flat, no_dist=True)
    plain = load_flat(flat, weights_only=False)
    assert not is_packed(plain)
    # what the stock empty-planner load gives back: int keys became strings, {} vanished
    assert list(plain["optimizer_states"][0]["state"]) == ["0", "1", "2", "3"]
    assert "callbacks" not in plain

    packed = str(tmp_path / "packed")
    save_packed(ckpt, packed)
    back = load_packed(packed)  # weights_only default (torch's): an Adam checkpoint loads
    assert_same(ckpt, back)
    assert list(back["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    model2, opt2, _ = adam_checkpoint()
    opt2.load_state_dict(back["optimizer_states"][0])
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


def test_storage_sharing_is_kept(tmp_path: Any) -> None:
    emb = torch.randn(6, 4)
    base = torch.arange(20, dtype=torch.float32)
    obj = {
        "tok.weight": emb.detach(),
        "head.weight": emb.detach(),  # tied: two tensor objects, one storage
        "a": base[:8].view(2, 4),
        "b": base[5:].view(3, 5).t(),  # an overlapping, non-contiguous view of the same buffer
        "c": base.view(torch.int32)[10:12],  # another dtype over the same storage
        "param": torch.nn.Parameter(torch.ones(3)),
        "frozen": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
    }
    save_packed(obj, str(tmp_path / "c"))
    back = load_packed(str(tmp_path / "c"))
    assert_same(obj, back)
    ptr = back["a"].untyped_storage().data_ptr()
    assert back["b"].untyped_storage().data_ptr() == ptr
    assert back["c"].untyped_storage().data_ptr() == ptr
    assert back["b"].stride() == obj["b"].stride()
    assert back["tok.weight"] is not back["head.weight"]
    tied = back["tok.weight"].untyped_storage().data_ptr()
    assert back["head.weight"].untyped_storage().data_ptr() == tied
    back["a"][0, 0] = 99.0
    assert back["b"][0, 0].item() != 99.0 and base[0].item() != 99.0  # no aliasing with the source
    assert float(back["a"].reshape(-1)[0]) == 99.0


def test_edge_tensors_and_keys_are_readable(tmp_path: Any) -> None:
    obj = {
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 7),
        "nc": torch.arange(12.0).view(3, 4).t(),
        "nested": {1: {"x": torch.ones(2)}},
    }
    sd = pack(obj)
    assert set(sd) == {"scalar", "empty", "nc", "nested/1/x", PACKED_KEY}
    save_packed(obj, str(tmp_path / "c"))
    assert_same(obj, load_packed(str(tmp_path / "c")))


def test_map_location_forms(tmp_path: Any) -> None:
    obj = {"w": torch.ones(2, 2), "v": [torch.zeros(3)]}
    save_packed(obj, str(tmp_path / "c"))
    for ml in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s):
        back = load_packed(str(tmp_path / "c"), map_location=ml)
        assert_same(obj, back)
    with pytest.raises(RuntimeError):
        load_packed(str(tmp_path / "c"), map_location="nosuchdevice")


def test_weights_only_runs_no_code_and_matches_torch_load(tmp_path: Any) -> None:
    SIDE_EFFECTS.clear()
    obj = {"w": torch.ones(2), "evil": Evil()}
    save_packed(obj, str(tmp_path / "c"))
    assert SIDE_EFFECTS == []
    # torch.load refuses the same object under weights_only=True; so do we, running nothing
    torch.save(obj, tmp_path / "ref.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "ref.pt", weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="weights-only"):
        load_packed(str(tmp_path / "c"), weights_only=True)
    with pytest.raises(pickle.UnpicklingError):
        load_packed(str(tmp_path / "c"))  # None: torch's default, weights-only
    assert SIDE_EFFECTS == []
    back = load_packed(str(tmp_path / "c"), weights_only=False)  # trusted: as torch.load(False)
    assert back["evil"] == "code ran" and SIDE_EFFECTS == ["code ran"]


def test_weights_only_refuses_a_hostile_metadata_file(tmp_path: Any) -> None:
    """The stock reader unpickles .metadata freely; weights-only loading must not."""
    SIDE_EFFECTS.clear()
    path = tmp_path / "c"
    save_packed({"w": torch.ones(2)}, str(path))
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"w": Evil()}  # a global the metadata never legitimately names
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(BaseException, match="refused"):
        load_packed(str(path), weights_only=True)
    assert SIDE_EFFECTS == []


def test_errors_name_what_is_wrong(tmp_path: Any) -> None:
    with pytest.raises(PackError, match="not a packed checkpoint"):
        unpack({"w": torch.ones(1)})
    sd = pack({"a": {"b": torch.ones(2)}})
    del sd["a/b"]
    with pytest.raises(PackError, match="'a/b'"):
        unpack(sd)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pack({"f": lambda: 1})
    with pytest.raises(TypeError, match="m/w: meta"):
        pack({"m": {"w": torch.empty(2, device="meta")}})
    with pytest.raises(TypeError, match="sp: "):
        pack({"sp": torch.eye(2).to_sparse()})
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        load_packed(str(tmp_path / "missing"))
    dcp.save({"w": torch.ones(1)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(PackError, match="plain: not a packed checkpoint"):
        load_packed(str(tmp_path / "plain"))
    assert not os.path.exists(tmp_path / "missing")
