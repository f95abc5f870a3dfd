#include "ring_allocator.hpp"

#include "error.hpp"

namespace dcpds {
namespace {

std::size_t align_up(std::size_t v, std::size_t align) { return (v + align - 1) & ~(align - 1); }

}  // namespace

RingAllocator::RingAllocator(std::size_t capacity_bytes) : capacity_(capacity_bytes) {
  DCPDS_CHECK(capacity_bytes > 0, "ring capacity must be positive");
}

std::optional<std::size_t> RingAllocator::try_allocate_locked(std::size_t bytes, std::size_t align) {
  if (bytes == 0) bytes = 1;  // every block occupies space so that offsets stay unique
  if (blocks_.empty()) {
    head_ = 0;
    wrapped_ = false;
  }
  std::size_t start;
  if (!wrapped_) {
    // Live data (if any) is [front.start, head_): free space is [head_, cap) then [0, front.start).
    start = align_up(head_, align);
    if (start + bytes > capacity_) {
      const std::size_t limit = blocks_.empty() ? capacity_ : blocks_.front().start;
      if (bytes > limit) return std::nullopt;
      start = 0;
      wrapped_ = !blocks_.empty();
    }
  } else {
    // Live data is [front.start, cap) and [0, head_): free space is [head_, front.start).
    start = align_up(head_, align);
    if (start + bytes > blocks_.front().start) return std::nullopt;
  }
  const std::uint64_t seq = front_seq_ + blocks_.size();
  blocks_.push_back(Block{start, start + bytes, false});
  seq_by_offset_[start] = seq;
  head_ = start + bytes;
  return start;
}

std::optional<std::size_t> RingAllocator::try_allocate(std::size_t bytes, std::size_t align) {
  DCPDS_CHECK(align > 0 && (align & (align - 1)) == 0, "alignment must be a power of two");
  DCPDS_CHECK(bytes <= capacity_, "allocation of " + std::to_string(bytes) +
                                      " bytes exceeds the host cache capacity of " +
                                      std::to_string(capacity_) + " bytes");
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_ || !waiting_tickets_.empty()) return std::nullopt;  // never overtake a waiter
  return try_allocate_locked(bytes, align);
}

std::optional<std::size_t> RingAllocator::allocate(std::size_t bytes, std::size_t align,
                                                   const std::function<bool()>& cancelled) {
  return allocate_with_ticket(take_ticket(), bytes, align, cancelled);
}

std::uint64_t RingAllocator::take_ticket() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t t = next_ticket_++;
  waiting_tickets_.insert(t);
  return t;
}

std::optional<std::size_t> RingAllocator::allocate_with_ticket(
    std::uint64_t ticket, std::size_t bytes, std::size_t align,
    const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  auto leave = [&]() {
    waiting_tickets_.erase(ticket);
    cv_.notify_all();  // the next ticket may now be at the head of the line
  };
  if (!(align > 0 && (align & (align - 1)) == 0) || bytes > capacity_) {
    leave();
    lock.unlock();
    DCPDS_CHECK(bytes <= capacity_, "allocation of " + std::to_string(bytes) +
                                        " bytes exceeds the host cache capacity of " +
                                        std::to_string(capacity_) + " bytes");
    DCPDS_CHECK(false, "alignment must be a power of two");
  }
  for (;;) {
    if (shutdown_ || (cancelled && cancelled())) {
      leave();
      return std::nullopt;
    }
    if (!waiting_tickets_.empty() && *waiting_tickets_.begin() == ticket) {
      if (auto off = try_allocate_locked(bytes, align)) {
        leave();
        return off;
      }
    }
    cv_.wait(lock);
  }
}

std::optional<std::size_t> RingAllocator::try_allocate_with_ticket(std::uint64_t ticket,
                                                                   std::size_t bytes,
                                                                   std::size_t align) {
  if (!(align > 0 && (align & (align - 1)) == 0) || bytes > capacity_) {
    {  // a request that can never be served leaves the line, as in allocate_with_ticket()
      std::lock_guard<std::mutex> lock(mu_);
      waiting_tickets_.erase(ticket);
    }
    cv_.notify_all();
    DCPDS_CHECK(bytes <= capacity_, "allocation of " + std::to_string(bytes) +
                                        " bytes exceeds the host cache capacity of " +
                                        std::to_string(capacity_) + " bytes");
    DCPDS_CHECK(false, "alignment must be a power of two");
  }
  std::optional<std::size_t> off;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_ || waiting_tickets_.empty() || *waiting_tickets_.begin() != ticket)
      return std::nullopt;
    off = try_allocate_locked(bytes, align);
    if (!off) return std::nullopt;
    waiting_tickets_.erase(ticket);
  }
  cv_.notify_all();  // the next ticket may now be at the head of the line
  return off;
}

void RingAllocator::pop_released_locked() {
  while (!blocks_.empty() && blocks_.front().released) {
    const std::size_t old_start = blocks_.front().start;
    blocks_.pop_front();
    ++front_seq_;
    if (blocks_.empty()) {
      head_ = 0;
      wrapped_ = false;
    } else if (wrapped_ && blocks_.front().start < old_start) {
      wrapped_ = false;  // the oldest live block is now past the wrap point
    }
  }
}

void RingAllocator::release(std::size_t offset) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seq_by_offset_.find(offset);
    DCPDS_CHECK(it != seq_by_offset_.end(),
                "release of unknown host cache offset " + std::to_string(offset));
    blocks_[it->second - front_seq_].released = true;
    seq_by_offset_.erase(it);
    pop_released_locked();
  }
  cv_.notify_all();
}

void RingAllocator::notify_waiters() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

void RingAllocator::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

std::size_t RingAllocator::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (blocks_.empty()) return 0;
  const std::size_t tail = blocks_.front().start;
  return wrapped_ ? capacity_ - tail + head_ : head_ - tail;
}

std::size_t RingAllocator::live_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq_by_offset_.size();
}

}  // namespace dcpds
