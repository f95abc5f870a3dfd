"""Workloads: synthetic state dicts of a chosen size and tensor-size mix, and the GPT setup.

A synthetic state dict is a flat ``{name: tensor}`` of float32 tensors whose sizes follow a
*mix*: a list of ``(tensor_bytes, share_of_total)``. The mixes span the range checkpoint
engines care about, from many small tensors (per-item overhead dominates) to a few huge ones
(bandwidth dominates, and a host cache smaller than one tensor forces chunking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from benchmarks.tiny_gpt import PRESETS, GPTConfig, TinyGPT

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "KIB": KiB,
    "MIB": MiB,
    "GIB": GiB,
}


def parse_size(text: str) -> int:
    """Parse ``"512MiB"``, ``"1GB"``, ``"1.5GiB"``, ``"4096"`` into bytes (KB/MB/GB are decimal)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB, 1GB, 8GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: float) -> str:
    """Human-readable binary size, e.g. ``1.00 GiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


# name -> [(tensor_bytes or fraction-of-total if < 1, share of total bytes)]
MIXES: dict[str, list[tuple[float, float]]] = {
    # many small tensors: per-item costs (planning, archive headers, syscalls) dominate
    "small": [(64 * KiB, 1.0)],
    # GPT-like spread: biases/norms, medium matrices, large embeddings
    "mixed": [(4 * KiB, 0.01), (256 * KiB, 0.09), (4 * MiB, 0.30), (64 * MiB, 0.60)],
    # a few huge tensors: each a quarter of the checkpoint
    "large": [(0.25, 1.0)],
}


@dataclass(frozen=True)
class SyntheticSpec:
    """``total_bytes`` of float32 tensors following mix ``mix`` (a key of :data:`MIXES`)."""

    total_bytes: int
    mix: str

    @classmethod
    def parse(cls, text: str) -> SyntheticSpec:
        """``"1GB:mixed"`` -> SyntheticSpec(10**9, "mixed")."""
        size, _, mix = text.partition(":")
        mix = mix or "mixed"
        if mix not in MIXES:
            raise ValueError(f"unknown mix {mix!r}; choose from {sorted(MIXES)}")
        return cls(parse_size(size), mix)

    @property
    def label(self) -> str:
        return f"{format_size(self.total_bytes).replace(' ', '')}-{self.mix}"

    def tensor_sizes(self) -> list[int]:
        """Element counts of the tensors, largest first."""
        counts: list[int] = []
        for size, share in MIXES[self.mix]:
            tensor_bytes = size * self.total_bytes if size < 1 else size
            elems = max(1, int(tensor_bytes) // 4)
            budget = int(share * self.total_bytes) // 4
            n = max(1, budget // elems) if budget >= elems else 0
            counts.extend([elems] * n)
            rest = budget - n * elems
            if rest > 0:
                counts.append(rest)
        return sorted(counts, reverse=True)


def synthetic_state_dict(
    spec: SyntheticSpec, device: torch.device, seed: int = 0, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Allocate the state dict described by ``spec`` filled with seeded random values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i, numel in enumerate(spec.tensor_sizes()):
        t = torch.empty(numel, dtype=torch.float32)
        # uniform_ with a generator is far cheaper than randn for GBs of data
        t.uniform_(-1.0, 1.0, generator=gen)
        sd[f"{prefix}t{i:06d}"] = t.to(device) if device.type != "cpu" else t
    return sd


def state_bytes(obj: object) -> int:
    """Bytes of tensor payload in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def count_tensors(obj: object) -> int:
    """Number of tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


@torch.no_grad()
def perturb_(sd: dict[str, torch.Tensor], step: int) -> None:
    """Change every tensor in place, as an optimizer step would (each checkpoint then differs)."""
    for t in sd.values():
        t.add_(1.0 / (step + 2))


def gpt_config(preset: str) -> GPTConfig:
    """The GPT shape named ``preset``; ``NAME@bN`` is preset NAME with a batch of N sequences
    (a longer step for the same checkpoint: e.g. ``large@b128`` on a GPU, to checkpoint every
    iteration with a step longer than the checkpoint's flush)."""
    name, at, batch = preset.partition("@")
    if name not in PRESETS or (at and not (batch[:1] == "b" and batch[1:].isdigit()
                                           and int(batch[1:]) > 0)):
        raise ValueError(f"unknown GPT preset {preset!r}; choose from {sorted(PRESETS)}, "
                         "optionally with @bN (a batch of N sequences)")
    cfg = PRESETS[name]
    return replace(cfg, batch_size=int(batch[1:])) if at else cfg


def make_gpt(
    cfg: GPTConfig, device: torch.device, seed: int = 0
) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A freshly initialised model and AdamW optimizer (same seed -> same weights)."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return model, opt
