"""Plan caching keyed by the structure of what is saved: repeated saves skip the global planning.

Why: DCP's ``enable_plan_caching`` keys its caches by the planner's class name
(``_cached_plans_key``), one entry for every state dict the process saves, and decides that a
rank's plan is unchanged with ``_compare_save_plans``, which compares names, offsets and sizes
but not dtypes nor the flattening mappings. A model saved after another of the same names and
shapes but other dtypes (or nesting) gets the other one's metadata: its ``.metadata`` says
float32 for bfloat16 data, and a load that builds its tensors from the metadata gets the wrong
dtype or structure. Its coordinator also merges a rank's "unchanged" plan with whatever plan it
cached last at that rank's position.

What: every cache here is keyed by content, never by position or class alone:

* a rank's **structure key** is a hash (BLAKE2b) of everything in its local plan (each item's
  name, offsets, sizes, tensor size, dtype and other properties, the flattening mappings) and of
  the planner's configuration (class, ``flatten_state_dict``, ``flatten_sharded_tensors``,
  ``dedup_save_to_lowest_rank``). A rank whose key has a global plan cached sends the
  coordinator a :class:`CachedPlanRef` (its key and the token of the global plan it holds) in
  place of its plan; any other rank sends its plan with its key (:class:`KeyedPlannerData`);
* the coordinator keeps the local plans it received by key, and the global metadata by the
  **combined key** of all ranks (every rank's key, in rank order). A rank's global plan is a
  function of its local plan and of what the global planning kept of it (which items, with
  which index hints), so its **token** is the hash of its key and of that;
* when every rank's key and token match a cached combined key, nothing is planned: each rank is
  told to reuse its global plan (:class:`ReuseGlobalPlan`), and the metadata is the cached one.
  Otherwise the coordinator plans afresh (with the cached plans of the ranks that sent keys),
  and a rank holding the global plan the new planning gives it is still told to reuse it.

So a changed structure (any rank's key) is planned again, and an unchanged one with changed
values (same keys) is not. Only content decides: a rank reuses a plan only when the
coordinator computed the same token for it, whatever the cache held before.

Lifetime: the entries are process-wide, :data:`CAPACITY` structures each (the least recently
used dropped first): each rank's last ``CAPACITY`` local structures and their global plans,
and, on the coordinator, the local plans of the last ``CAPACITY`` structures of each rank
position and the metadata of the last ``CAPACITY`` combined keys. A rank only refers to a plan
its coordinator holds as long as its saves go through that coordinator: a rank saving one
structure through process groups with different coordinators can refer to a plan the other
coordinator never received; that save fails with a message saying so, the rank drops its cache
(:meth:`RankCache.begin`), and the next save plans afresh. :func:`clear` empties every cache
(call it on every rank).

Memory on the coordinator: the cached local plans, as DCP's own cache keeps them (about 1 KB per
item in Python objects: 4,096 ranks x 2,000 items, several GB), so :data:`CAPACITY` is small.

Threads: every cache is guarded by one lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import marshal
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

#: How many structures each cache keeps (see the module docstring).
CAPACITY = 2

_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class KeyedPlannerData:
    """A rank's full local plan carries this as its ``planner_data``: the planner's own data
    (the flattening mappings) and the key of the plan's structure."""

    data: Any
    key: bytes


@dataclasses.dataclass(frozen=True)
class CachedPlanRef:
    """What a rank sends instead of its local plan when its structure has a global plan
    cached: its key and the token of that global plan."""

    key: bytes
    token: bytes


@dataclasses.dataclass(frozen=True)
class ReuseGlobalPlan:
    """The coordinator's answer to a rank whose cached global plan (this token) is the one the
    planning gives it."""

    token: bytes


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


_NAMES: dict[Any, str] = {}


def _name(value: Any) -> str:
    """``str`` of a dtype, layout or memory format (a handful of values), remembered."""
    name = _NAMES.get(value)
    if name is None:
        name = _NAMES[value] = str(value)
    return name


def structure_key(plan: SavePlan, config: tuple[Any, ...]) -> bytes:
    """The hash of everything in ``plan`` that planning reads, and of the planner's ``config``.

    Serialized with ``marshal`` version 2 (plain values, no references: equal content gives
    equal bytes in every process, unlike ``hash`` of strings), or ``repr`` where a value is not
    plain. An item of another class than ``WriteItem`` is represented by its ``repr`` (every
    dataclass field). 2,000 items: about 5 ms."""
    rows: list[Any] = []
    add = rows.append
    for item in plan.items:
        if type(item) is not WriteItem:
            add(repr(item))
            continue
        ix, td = item.index, item.tensor_data
        off = None if ix.offset is None else tuple(ix.offset)
        if td is None:
            add((ix.fqn, off, ix.index, item.type.value, repr(item.bytes_io_data)))
            continue
        p, c = td.properties, td.chunk
        add((ix.fqn, off, ix.index, item.type.value, tuple(td.size), tuple(c.offsets),
             tuple(c.sizes), _name(p.dtype), _name(p.layout), p.requires_grad,
             _name(p.memory_format), p.pin_memory))
    parts = [repr(config), rows, plan.planner_data, repr(plan.storage_data)]
    try:
        data = marshal.dumps(parts, 2)
    except ValueError:  # not plain values (a custom planner's data): their repr
        data = repr(parts).encode()
    return _digest(data)


def plan_token(key: bytes, hints: array) -> bytes:
    """The token of the global plan a rank of structure ``key`` gets when the planning keeps
    these items of its local plan, with these index hints (global_plan.GlobalPlan.hints)."""
    return _digest(key, array("q", hints).tobytes())


class RankCache:
    """Every rank's cache: its structure keys and the global plans it received for them."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, tuple[bytes, SavePlan]] = OrderedDict()
        self.in_flight = False

    def begin(self, key: bytes) -> bytes | None:
        """The token of the global plan held for ``key``, if any (the rank then sends a
        :class:`CachedPlanRef`). A planning that referred to a cached plan and never reached
        :meth:`finish` (it failed) empties the cache first: the next save sends full plans."""
        with _lock:
            if self.in_flight:
                self.entries.clear()
            entry = self.entries.get(key)
            self.in_flight = entry is not None
            return None if entry is None else entry[0]

    def finish(
        self, key: bytes, local: SavePlan, received: SavePlan,
        hints_of: Callable[[SavePlan, SavePlan], array | None],
    ) -> SavePlan:
        """The rank's final plan: the cached one when told to reuse it, else ``received``,
        which is cached (with its token) for the next save of this structure."""
        with _lock:
            self.in_flight = False
            answer = received.planner_data
            if not received.usable and isinstance(answer, ReuseGlobalPlan):
                entry = self.entries.get(key)
                if entry is None or entry[0] != answer.token:
                    self.entries.clear()
                    raise RuntimeError(
                        "DataStatesSavePlanner: the coordinator answered with a cached global "
                        "plan this rank does not hold; the plan cache is cleared"
                    )
                self.entries.move_to_end(key)
                plan = entry[1]
                if received.storage_data is not None:  # the storage writer's, of this save
                    plan = dataclasses.replace(plan, storage_data=received.storage_data)
                return plan
            hints = hints_of(local, received)
            if hints is not None:
                self.entries[key] = (plan_token(key, hints), received)
                self.entries.move_to_end(key)
                while len(self.entries) > CAPACITY:
                    self.entries.popitem(last=False)
            return received


@dataclasses.dataclass
class Resolved:
    """The local plans of one save as the coordinator plans them."""

    plans: list[SavePlan]  # each rank's local plan, its planner_data the planner's own
    keys: list[bytes | None]  # each rank's structure key (None: a plan without one)
    tokens: list[bytes | None]  # the token of the global plan each rank holds (None: none)

    def combined_key(self) -> bytes | None:
        if any(k is None for k in self.keys):
            return None
        return _digest(len(self.keys).to_bytes(8, "little"), *self.keys)  # type: ignore[arg-type]


@dataclasses.dataclass
class GlobalEntry:
    metadata: Metadata  # never handed out: a save gets a copy (its storage writer fills it in)
    tokens: list[bytes | None]


@dataclasses.dataclass
class Pending:
    """What the coordinator caches once the planning's results reached every rank."""

    combined: bytes | None
    entry: GlobalEntry | None
    resolved: Resolved


class CoordinatorCache:
    """The coordinator's cache: local plans by structure key, metadata by combined key."""

    def __init__(self) -> None:
        self.plans: dict[bytes, SavePlan] = {}
        self.refs: dict[bytes, int] = {}
        self.positions: list[OrderedDict[bytes, None]] = []
        self.entries: OrderedDict[bytes, GlobalEntry] = OrderedDict()

    def resolve(self, all_plans: Sequence[SavePlan]) -> Resolved:
        """The local plans (cached ones in place of references), keys and tokens."""
        out = Resolved([], [], [])
        with _lock:
            for rank, plan in enumerate(all_plans):
                data = plan.planner_data
                token = None
                if isinstance(data, CachedPlanRef):
                    key, token = data.key, data.token
                    cached = self.plans.get(key)
                    if cached is None:
                        raise RuntimeError(
                            f"DataStatesSavePlanner: rank {rank} referred to a cached plan this "
                            "coordinator does not hold (its earlier saves went through another "
                            "coordinator, or its cache was cleared on some ranks only). The "
                            "ranks that referred to one drop their plan cache: the next save "
                            "plans afresh. Saves through several process groups: "
                            "enable_plan_caching=False"
                        )
                    plan = cached
                elif isinstance(data, KeyedPlannerData):
                    key, plan = data.key, dataclasses.replace(plan, planner_data=data.data)
                else:
                    key = None
                out.plans.append(plan)
                out.keys.append(key)
                out.tokens.append(token)
        return out

    def lookup(self, resolved: Resolved) -> tuple[bytes | None, GlobalEntry | None]:
        """The combined key, and its entry when every rank holds its global plan of it."""
        combined = resolved.combined_key()
        with _lock:
            entry = None if combined is None else self.entries.get(combined)
        if entry is None or None in entry.tokens or entry.tokens != resolved.tokens:
            return combined, None
        return combined, entry

    def commit(self, pending: Pending) -> None:
        """Caches a save's plans and metadata: called once its global plans reached the ranks
        (the coordinator's ``finish_plan``), when every rank caches its own."""
        res = pending.resolved
        with _lock:
            while len(self.positions) < len(res.keys):
                self.positions.append(OrderedDict())
            for lru, key, plan in zip(self.positions, res.keys, res.plans, strict=False):
                if key is None:
                    continue
                if key in lru:
                    lru.move_to_end(key)
                    continue
                lru[key] = None
                self.refs[key] = self.refs.get(key, 0) + 1
                self.plans.setdefault(key, plan)
                if len(lru) > CAPACITY:
                    self._release(lru.popitem(last=False)[0])
            if pending.combined is not None and pending.entry is not None:
                self.entries[pending.combined] = pending.entry
                self.entries.move_to_end(pending.combined)
                while len(self.entries) > CAPACITY:
                    self.entries.popitem(last=False)

    def _release(self, key: bytes) -> None:
        n = self.refs[key] - 1
        if n:
            self.refs[key] = n
        else:
            del self.refs[key]
            del self.plans[key]


RANK = RankCache()
COORDINATOR = CoordinatorCache()


def clear() -> None:
    """Empties this process's plan caches (every rank's and the coordinator's)."""
    with _lock:
        RANK.entries.clear()
        RANK.in_flight = False
        COORDINATOR.__init__()  # type: ignore[misc]
