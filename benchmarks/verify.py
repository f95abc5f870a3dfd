"""Bit-exact comparison of a loaded checkpoint with the state that was saved.

Tensors are compared byte for byte (``view(uint8)``), so ``-0.0`` vs ``0.0`` or differing NaN
payloads count as mismatches, as they should for a checkpoint. Non-tensor leaves compare with
``==``. Containers are walked recursively; a missing key is a mismatch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class VerifyResult:
    tensors: int = 0
    bytes: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "mismatches": self.mismatches[:10],
            "n_mismatches": len(self.mismatches),
        }


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def empty_like_tree(obj: Any) -> Any:
    """Same structure with uninitialised CPU tensors (the target ``dcp.load`` fills in place)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="cpu")
    if isinstance(obj, dict):
        return {k: empty_like_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [empty_like_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(empty_like_tree(v) for v in obj)
    return copy.deepcopy(obj)


def clone_tree(obj: Any) -> Any:
    """A deep copy of the tensors (kept on their device) for later comparison."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def compare_trees(
    expected: Any, actual: Any, path: str = "", out: VerifyResult | None = None
) -> VerifyResult:
    """Compare ``actual`` against ``expected`` recursively; collect mismatching paths."""
    res = out if out is not None else VerifyResult()
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            res.mismatches.append(f"{path}: expected tensor, got {type(actual).__name__}")
            return res
        res.tensors += 1
        res.bytes += expected.numel() * expected.element_size()
        if expected.dtype != actual.dtype or tuple(expected.shape) != tuple(actual.shape):
            got = f"{actual.dtype}{tuple(actual.shape)}"
            want = f"{expected.dtype}{tuple(expected.shape)}"
            res.mismatches.append(f"{path}: {got} != {want}")
        elif not torch.equal(_raw(expected), _raw(actual)):
            res.mismatches.append(f"{path}: payload differs")
        return res
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            res.mismatches.append(f"{path}: expected dict, got {type(actual).__name__}")
            return res
        for k, v in expected.items():
            if k not in actual:
                res.mismatches.append(f"{path}/{k}: missing")
                continue
            compare_trees(v, actual[k], f"{path}/{k}", res)
        return res
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            res.mismatches.append(f"{path}: sequence differs")
            return res
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            compare_trees(e, a, f"{path}[{i}]", res)
        return res
    if expected != actual:
        res.mismatches.append(f"{path}: {actual!r} != {expected!r}")
    return res
