#include "host_cache.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "cuda_runtime.hpp"
#include "error.hpp"

namespace dcpds {

HostCache::HostCache(std::size_t bytes, bool prefault) : bytes_(bytes) {
  DCPDS_CHECK(bytes > 0, "host cache size must be positive");
  const std::size_t page = 4096;
  mapped_bytes_ = (bytes + page - 1) / page * page;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (prefault) flags |= MAP_POPULATE;
  void* p = ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    DCPDS_CHECK(false, errno_message("cannot allocate a host cache of " + std::to_string(bytes) +
                                         " bytes",
                                     errno));
  }
#ifdef MADV_HUGEPAGE
  ::madvise(p, mapped_bytes_, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
  data_ = static_cast<std::uint8_t*>(p);
}

HostCache::HostCache(HostCache&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)),
      pinned_by_(std::exchange(other.pinned_by_, nullptr)) {}

HostCache::~HostCache() {
  if (data_ == nullptr) return;
  if (pinned_by_ != nullptr) pinned_by_->host_unregister(data_);  // errors ignored at teardown
  ::munmap(data_, mapped_bytes_);
}

void HostCache::pin(const CudaRuntime& cuda) {
  if (pinned_by_ != nullptr) return;
  cuda.host_register(data_, mapped_bytes_);
  pinned_by_ = &cuda;
}

}  // namespace dcpds
