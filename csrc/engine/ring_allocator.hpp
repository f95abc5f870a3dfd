// RingAllocator: hands out byte ranges of a fixed-size arena in FIFO order, with backpressure.
//
// The arena is used as a ring: allocations are placed after the newest live block and wrap to the
// start when the end is reached; the space of the oldest block is reused only once it and every
// block allocated before it have been released (releases may arrive in any order; a block released
// early stays reserved until the blocks before it are released too). This is the DataStates host
// cache discipline, with the wrap-around bookkeeping made exact: a new block never overlaps a live
// one (proven by tests/test_ring_allocator.py's randomized concurrent stress test).
//
// Thread-safety: every method may be called from any thread concurrently.
// Blocking: allocate() waits while the ring has no room; it returns std::nullopt if the wait is
// cancelled (cancel predicate true when woken) or the allocator is shut down.
// Limits: a request larger than capacity() is a programming error of the caller (it must split
// data into chunks) and throws EngineError.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

namespace dcpds {

class RingAllocator {
 public:
  explicit RingAllocator(std::size_t capacity_bytes);

  RingAllocator(const RingAllocator&) = delete;
  RingAllocator& operator=(const RingAllocator&) = delete;

  // Non-blocking: an offset aligned to `align` (a power of two) of `bytes` bytes, or nullopt.
  std::optional<std::size_t> try_allocate(std::size_t bytes, std::size_t align);

  // Blocking: waits until the request fits. `cancelled` is evaluated under the allocator lock each
  // time the caller wakes; returning true abandons the wait (nullopt). Use notify_waiters() to wake
  // waiters after changing what `cancelled` reads.
  std::optional<std::size_t> allocate(std::size_t bytes, std::size_t align,
                                      const std::function<bool()>& cancelled = {});

  // FIFO-fair variant: waiters are served strictly in ticket order, so that allocation order
  // equals the order in which tickets were taken (the engine takes them in copy-queue order,
  // which keeps in-order consumers such as a sequential stream writer from deadlocking).
  // Every ticket must be passed to exactly one allocate_with_ticket() call.
  std::uint64_t take_ticket();
  std::optional<std::size_t> allocate_with_ticket(std::uint64_t ticket, std::size_t bytes,
                                                  std::size_t align,
                                                  const std::function<bool()>& cancelled = {});
  // Non-blocking: allocates for `ticket` if it is first in line and the request fits now (the
  // ticket is then used up); otherwise returns nullopt and the ticket stays in line, to be
  // passed to allocate_with_ticket() later. A request that can never fit uses the ticket up and
  // throws EngineError.
  std::optional<std::size_t> try_allocate_with_ticket(std::uint64_t ticket, std::size_t bytes,
                                                      std::size_t align);

  // Releases the block that starts at `offset`. Unknown offsets throw EngineError.
  void release(std::size_t offset);

  // Wakes all waiters so they re-check their cancel predicate.
  void notify_waiters();

  // Wakes all waiters and makes every later allocate() return nullopt.
  void shutdown();

  std::size_t capacity() const { return capacity_; }
  std::size_t used_bytes() const;   // bytes between the oldest live block and the newest end
  std::size_t live_blocks() const;

 private:
  struct Block {
    std::size_t start;
    std::size_t end;
    bool released;
  };

  std::optional<std::size_t> try_allocate_locked(std::size_t bytes, std::size_t align);
  void pop_released_locked();

  const std::size_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> blocks_;                          // allocation order, oldest first
  std::uint64_t front_seq_ = 0;                       // sequence number of blocks_.front()
  std::unordered_map<std::size_t, std::uint64_t> seq_by_offset_;
  std::size_t head_ = 0;                              // end of the newest block
  bool wrapped_ = false;                              // newest blocks lie before the oldest
  bool shutdown_ = false;
  std::uint64_t next_ticket_ = 0;
  std::set<std::uint64_t> waiting_tickets_;  // taken and not yet served or abandoned
};

}  // namespace dcpds
