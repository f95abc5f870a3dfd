// HostCache: the page-aligned host memory arena a writer copies tensors into before flushing.
//
// Ownership: allocated once in the constructor (anonymous mmap, optionally pre-faulted so that
// copies never pay first-touch page faults), freed in the destructor. Move-only.
// Pinning: pin() registers the arena with the CUDA runtime (page-locked, so device-to-host copies
// run at full speed and asynchronously); the destructor unregisters it before unmapping.
// Thread-safety: data()/size() are immutable after construction; pin()/unpin() are not thread-safe
// and are called by the Engine before any copy is issued.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcpds {

class CudaRuntime;

class HostCache {
 public:
  HostCache(std::size_t bytes, bool prefault);
  ~HostCache();
  HostCache(HostCache&& other) noexcept;
  HostCache& operator=(HostCache&&) = delete;
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  std::uint8_t* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool pinned() const { return pinned_by_ != nullptr; }

  // Page-locks the arena through `cuda` (which must outlive this cache). Idempotent.
  void pin(const CudaRuntime& cuda);

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t mapped_bytes_ = 0;
  const CudaRuntime* pinned_by_ = nullptr;
};

}  // namespace dcpds
