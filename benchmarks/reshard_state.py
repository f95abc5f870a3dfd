"""A seeded FSDP2 training state that any world size can rebuild and check bit for bit.

The model is transformer-shaped (an embedding, ``layers`` blocks of layer norms, a fused QKV
projection, an output projection and an MLP, a final norm and an untied head), every parameter
sharded by :func:`torch.distributed.fsdp.fully_shard` over the world (``Shard(0)``; a world of
one keeps plain tensors). An AdamW that has stepped once owns it, so the optimizer's state has
its real structure (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, ``param_groups``).

The *values* are seeded, not computed by the step: every parameter and moment is then set to
the slice this rank holds of a full tensor hashed from (seed, kind, name, index), which a rank
computes for its slice alone (:func:`expected`).
An AdamW step on shards and one on the full tensor need not agree to the bit (an elementwise
kernel's vectorised body and its scalar tail can round differently, and which elements fall in
the tail depends on the shard), so only seeded values let a world of any size recompute what a
checkpoint must hold. Sizes are chosen so that some first dimensions do not divide by 16 (the
vocabulary, the model and MLP widths): FSDP2's last shards are then shorter, or empty.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

KINDS = ("param", "exp_avg", "exp_avg_sq")
LR = 1e-3  # the saved param_groups' learning rate; a load target starts with another


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's dimensions and the seed of its values."""

    vocab: int = 8003
    d_model: int = 392
    ffn: int = 1500
    layers: int = 12
    seed: int = 0

    def numel(self) -> int:
        """Parameters in the model (the checkpoint holds three times as many floats)."""
        with torch.device("meta"):
            return sum(p.numel() for p in TinyTransformer(self).parameters())


TINY = Shape(vocab=37, d_model=20, ffn=44, layers=2, seed=1)  # for tests: seconds, uneven shards


class Block(nn.Module):
    """Pre-norm attention and MLP weights (no forward: only the state is saved)."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, ffn)
        self.down = nn.Linear(ffn, d)


class TinyTransformer(nn.Module):
    """An embedding, ``layers`` blocks, a final norm and an untied output head."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.blocks = nn.ModuleList(Block(s.d_model, s.ffn) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)


def build(shape: Shape, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2-sharded over the default group's ranks when ``world`` > 1, else plain)
    and an AdamW that stepped once with zero gradients (its state exists, values unset)."""
    with torch.device("meta"):
        model = TinyTransformer(shape)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _flat_index(global_shape: torch.Size, where: tuple[slice, ...]) -> torch.Tensor:
    """The row-major flat index in the full tensor of every element of the slice ``where``."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        view = [1] * len(global_shape)
        view[d] = -1
        idx = idx + torch.arange(where[d].start, where[d].stop).view(view) * stride
        stride *= global_shape[d]
    return idx


_EXPECTED: dict[tuple[Any, ...], torch.Tensor] = {}  # one copy of this rank's state, at most


def expected(shape: Shape, kind: str, fqn: str, global_shape: torch.Size,
             where: tuple[slice, ...]) -> torch.Tensor:
    """The slice ``where`` of the full tensor a checkpoint holds for parameter ``fqn``'s
    ``kind`` (one of KINDS), computed for that slice alone and kept for the next call.

    Each element is a hash of (seed, kind, name, flat index): 24 bits give a value in [-1, 1),
    4 more a power-of-two scale from 2**-8 to 2**7, so every value is exact in float32 and the
    bits vary across mantissa, exponent and sign (``exp_avg_sq`` is non-negative).
    """
    cache_key = (shape, kind, fqn, tuple(global_shape),
                 tuple((w.start, w.stop) for w in where))
    if cache_key in _EXPECTED:
        return _EXPECTED[cache_key]
    key = zlib.crc32(f"{shape.seed}:{kind}:{fqn}".encode())
    x = (_flat_index(global_shape, where) * 0x9E3779B1 + key) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x045D9F3B) & 0xFFFFFFFF  # a multiplier < 2**31: no int64 overflow
    x = x ^ (x >> 16)
    scale = torch.pow(2.0, ((x >> 24) & 0xF).to(torch.float32) - 31)
    value = ((x & 0xFFFFFF) - (1 << 23)).to(torch.float32) * scale  # exact: 24 bits, 2**k
    _EXPECTED[cache_key] = value.abs_() if kind == "exp_avg_sq" else value
    return _EXPECTED[cache_key]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype and the same bits (-0.0 differs from 0.0, a NaN equals itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = _SAME_SIZE_INT[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's local tensor of ``t`` (a DTensor or a plain tensor) and where it lies in the
    full tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def tensors(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[tuple[str, str, Any]]:
    """(kind, parameter FQN, tensor) for every parameter and AdamW moment of the live objects."""
    for fqn, p in model.named_parameters():
        yield "param", fqn, p
        st = opt.state[p]
        yield "exp_avg", fqn, st["exp_avg"]
        yield "exp_avg_sq", fqn, st["exp_avg_sq"]


@torch.no_grad()
def fill(model: nn.Module, opt: torch.optim.Optimizer, shape: Shape) -> None:
    """Sets every parameter and moment to its seeded value (this rank's slice)."""
    for kind, fqn, t in tensors(model, opt):
        local, where = local_part(t)
        local.copy_(expected(shape, kind, fqn, t.shape, where))


@torch.no_grad()
def scramble(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A load target: every value wrong (NaN-free, so a missed tensor fails ``torch.equal``),
    ``step`` 0 and another learning rate."""
    for _, _, t in tensors(model, opt):
        local_part(t)[0].fill_(-3.0)
    for st in opt.state.values():
        st["step"].zero_()
    for group in opt.param_groups:
        group["lr"] = 0.5


def mismatches(model: nn.Module, opt: torch.optim.Optimizer, shape: Shape) -> list[str]:
    """Every value of this rank that differs from the seeded state, by ``kind:fqn``, plus
    ``step`` and ``lr`` where they differ; empty when all is bit-exact."""
    bad = []
    for kind, fqn, t in tensors(model, opt):
        local, where = local_part(t)
        if not bit_equal(local, expected(shape, kind, fqn, t.shape, where)):
            bad.append(f"{kind}:{fqn}")
    bad += [f"step:{i}" for i, st in enumerate(opt.state.values()) if float(st["step"]) != 1.0]
    bad += ["lr" for g in opt.param_groups if g["lr"] != LR]
    return bad


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters and moments this rank holds."""
    return sum(local_part(t)[0].nbytes for _, _, t in tensors(model, opt))


def app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What is saved and loaded: ``get_state_dict``'s model and optimizer state by FQN."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def apply(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a state :func:`app_state` returned (and ``dcp.load`` filled) into the live objects."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
