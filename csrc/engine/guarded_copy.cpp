#include "guarded_copy.hpp"

#include <setjmp.h>
#include <signal.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "crc32c.hpp"

namespace dcpds {
namespace {

constexpr std::size_t kBlock = 256u << 10;  // CRC block: small enough to stay in L2

struct Guard {
  sigjmp_buf jump;
  std::uintptr_t lo = 0;  // page-rounded source range
  std::uintptr_t hi = 0;
  volatile sig_atomic_t active = 0;
};

// initial-exec: the handler must not run the lazy TLS allocator (not async-signal-safe).
__attribute__((tls_model("initial-exec"))) thread_local Guard* t_guard = nullptr;

struct sigaction g_prev_segv;
struct sigaction g_prev_bus;
std::atomic<bool> g_installed{false};
std::atomic<int> g_kernel_ok{1};  // process_vm_readv usable (ENOSYS/EPERM turn it off)
std::atomic<std::uint64_t> g_counts[3];

void pass_on(int sig, siginfo_t* info, void* context) {
  const struct sigaction& prev = sig == SIGBUS ? g_prev_bus : g_prev_segv;
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction != nullptr) {
      prev.sa_sigaction(sig, info, context);
      return;
    }
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the faulting instruction runs again and the kernel
  // terminates the process as it would have without us (core dump included).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
}

void on_fault(int sig, siginfo_t* info, void* context) {
  Guard* g = t_guard;
  if (g != nullptr && g->active) {
    const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
    if (addr >= g->lo && addr < g->hi) {
      g->active = 0;
      siglongjmp(g->jump, 1);
    }
  }
  pass_on(sig, info, context);
}

bool handler_is_ours() {
  if (!g_installed.load(std::memory_order_acquire)) return false;
  struct sigaction cur;
  if (::sigaction(SIGSEGV, nullptr, &cur) != 0) return false;
  return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_fault;
}

void copy_blocks(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes,
                 std::uint32_t* crc) {
  if (crc == nullptr) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::uint32_t sum = *crc;
  for (std::size_t off = 0; off < bytes; off += kBlock) {
    const std::size_t n = std::min(kBlock, bytes - off);
    std::memcpy(dst + off, src + off, n);
    sum = crc32c(sum, dst + off, n);
  }
  *crc = sum;
}

// No objects with destructors may live in this frame between sigsetjmp and the end of the
// guarded region: siglongjmp skips them.
bool guarded_copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes,
                  std::uint32_t* crc) {
  Guard guard;
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = reinterpret_cast<std::uintptr_t>(src);
  guard.lo = lo / page * page;
  guard.hi = (lo + bytes + page - 1) / page * page;
  t_guard = &guard;
  if (sigsetjmp(guard.jump, 1) != 0) {  // came back from on_fault: the source is gone
    t_guard = nullptr;
    return false;
  }
  guard.active = 1;
  copy_blocks(dst, src, bytes, crc);
  guard.active = 0;
  t_guard = nullptr;
  return true;
}

// 0: copied; 1: the source is unreadable; 2: the call is unavailable here.
int kernel_copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    iovec local{dst + done, bytes - done};
    iovec remote{const_cast<std::uint8_t*>(src) + done, bytes - done};
    const ssize_t n = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if ((n < 0 && errno == EFAULT) || n == 0) return 1;
    if (done == 0) return 2;  // ENOSYS, EPERM (seccomp)
    return 1;
  }
  return 0;
}

}  // namespace

bool install_copy_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* off = std::getenv("DCPDS_NO_FAULT_GUARD");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // on the alternate stack where the thread has one
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGSEGV, &sa, &g_prev_segv) != 0) return;
    if (::sigaction(SIGBUS, &sa, &g_prev_bus) != 0) {
      ::sigaction(SIGSEGV, &g_prev_segv, nullptr);
      return;
    }
    g_installed.store(true, std::memory_order_release);
  });
  return g_installed.load(std::memory_order_acquire);
}

bool checked_copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes,
                  std::uint32_t* crc, CopyPath* path) {
  if (bytes == 0) {
    *path = CopyPath::kPlain;
    return true;
  }
  if (handler_is_ours()) {
    *path = CopyPath::kGuarded;
    g_counts[0].fetch_add(1, std::memory_order_relaxed);
    return guarded_copy(dst, src, bytes, crc);
  }
  if (g_kernel_ok.load(std::memory_order_relaxed) == 1) {
    // Block by block, so that the CRC reads each block while it is in the CPU cache.
    std::uint32_t sum = crc != nullptr ? *crc : 0;
    int r = 0;
    for (std::size_t off = 0; off < bytes && r == 0; off += kBlock) {
      const std::size_t n = std::min(kBlock, bytes - off);
      r = kernel_copy(dst + off, src + off, n);
      if (r == 0 && crc != nullptr) sum = crc32c(sum, dst + off, n);
      if (r == 2 && off > 0) r = 1;  // refused midway: treat as unreadable
    }
    if (r != 2) {
      *path = CopyPath::kKernel;
      g_counts[1].fetch_add(1, std::memory_order_relaxed);
      if (r == 1) return false;
      if (crc != nullptr) *crc = sum;
      return true;
    }
    g_kernel_ok.store(0);
  }
  *path = CopyPath::kPlain;
  g_counts[2].fetch_add(1, std::memory_order_relaxed);
  copy_blocks(dst, src, bytes, crc);
  return true;
}

std::uint64_t copies_by_path(CopyPath path) {
  return g_counts[static_cast<int>(path)].load(std::memory_order_relaxed);
}

}  // namespace dcpds
