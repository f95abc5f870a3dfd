"""The host cache allocator: FIFO reuse, wrap-around, backpressure, content integrity."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from dcp_datastates import _core


def test_basic_fifo_and_wrap() -> None:
    r = _core.RingAllocator(1000)
    a = r.allocate(400, 1)
    b = r.allocate(400, 1)
    assert (a, b) == (0, 400)
    assert r.try_allocate(400, 1) is None  # 200 left at the end, the front is busy
    r.release(a)
    c = r.allocate(300, 1)  # wraps to the start
    assert c == 0
    assert r.try_allocate(200, 1) is None  # only [300, 400) free before b
    r.release(b)
    r.release(c)
    assert r.used_bytes == 0 and r.live_blocks == 0
    assert r.allocate(1000, 1) == 0


def test_out_of_order_release_keeps_space_reserved() -> None:
    r = _core.RingAllocator(300)
    a, b, c = (r.allocate(100, 1) for _ in range(3))
    r.release(b)  # released early, but a is still live: nothing is reusable yet
    assert r.try_allocate(50, 1) is None
    r.release(a)  # now a and b are reusable
    assert r.allocate(200, 1) == 0
    r.release(c)


def test_alignment_and_errors() -> None:
    r = _core.RingAllocator(1 << 16)
    a = r.allocate(10, 64)
    b = r.allocate(10, 4096)
    assert a % 64 == 0 and b % 4096 == 0 and b >= 10
    with pytest.raises(_core.EngineError, match="exceeds the host cache"):
        r.allocate((1 << 16) + 1, 1)
    with pytest.raises(_core.EngineError, match="unknown host cache offset"):
        r.release(12345)


def test_try_allocate_with_ticket_keeps_the_line() -> None:
    """A ticket is served only when it is first in line and the request fits; a failed try keeps
    it in line (later served by allocate_with_ticket), and nobody overtakes it meanwhile."""
    r = _core.RingAllocator(300)
    t1, t2 = r.take_ticket(), r.take_ticket()
    assert r.try_allocate_with_ticket(t2, 100, 1) is None  # t1 is first in line
    assert r.try_allocate(100, 1) is None  # an untracked request never overtakes a ticket
    assert r.try_allocate_with_ticket(t1, 200, 1) == 0
    assert r.try_allocate_with_ticket(t2, 200, 1) is None  # first now, but 100 bytes left
    t3 = r.take_ticket()
    assert r.try_allocate_with_ticket(t3, 50, 1) is None  # t2 still waits ahead of it
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(r.allocate_with_ticket(t2, 200, 1)))
    waiter.start()
    time.sleep(0.05)
    assert not got
    r.release(0)
    waiter.join(5)
    assert got == [0]
    assert r.try_allocate_with_ticket(t3, 50, 1) == 200
    with pytest.raises(_core.EngineError, match="exceeds the host cache"):
        r.try_allocate_with_ticket(r.take_ticket(), 301, 1)
    assert r.try_allocate_with_ticket(r.take_ticket(), 10, 1) == 250  # the line moved on


def test_blocking_allocate_waits_for_release() -> None:
    r = _core.RingAllocator(100)
    a = r.allocate(100, 1)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(r.allocate(60, 1)))
    t.start()
    time.sleep(0.1)
    assert not got  # backpressure: still waiting
    r.release(a)
    t.join(5)
    assert got == [0]


def test_shutdown_wakes_waiters() -> None:
    r = _core.RingAllocator(100)
    r.allocate(100, 1)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(r.allocate(50, 1)))
    t.start()
    time.sleep(0.05)
    r.shutdown()
    t.join(5)
    assert got == [None]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_randomized_concurrent_stress(seed: int) -> None:
    """Producers fill blocks with a signature, consumers check it and release in random order.

    The cache is far smaller than the data moved. Any overlap of two live blocks (a wrap-around
    bug) corrupts a signature and fails the check.
    """
    cap = 64 * 1024
    ring = _core.RingAllocator(cap)
    arena = np.zeros(cap, dtype=np.uint8)
    live: list[tuple[int, int, int]] = []
    live_lock = threading.Condition()
    errors: list[str] = []
    moved = [0]
    stop = threading.Event()
    n_per_producer = 1500

    def producer(pid: int) -> None:
        rng = random.Random(seed * 100 + pid)
        for i in range(n_per_producer):
            size = rng.choice([1, 7, 64, 500, 4096, 10_000, rng.randint(1, cap // 3)])
            align = rng.choice([1, 64, 4096])
            off = ring.allocate(size, align)
            assert off is not None and off % align == 0 and off + size <= cap
            tag = (pid * 1_000_003 + i) % 251 + 1
            arena[off : off + size] = tag
            with live_lock:
                live.append((off, size, tag))
                live_lock.notify_all()

    def consumer(cid: int) -> None:
        rng = random.Random(seed * 1000 + cid)
        while True:
            with live_lock:
                while not live and not stop.is_set():
                    live_lock.wait(0.05)
                if not live:
                    return
                off, size, tag = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                time.sleep(0.0001)
            block = arena[off : off + size]
            if not (block == tag).all():
                errors.append(f"block at {off}+{size} corrupted (tag {tag})")
            moved[0] += size
            ring.release(off)

    producers = [threading.Thread(target=producer, args=(i,)) for i in range(3)]
    consumers = [threading.Thread(target=consumer, args=(i,)) for i in range(3)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(120)
    stop.set()
    for t in consumers:
        t.join(120)
    assert not errors, errors[:5]
    assert ring.live_blocks == 0 and ring.used_bytes == 0
    assert moved[0] > 10 * cap  # the ring wrapped many times
