// Copies from memory that another thread of this process may release meanwhile.
//
// A lazily captured tensor is copied into the host cache after the save call returned, so its
// owner may have freed or resized the storage by then (FSDP-style `resize_(0)`). A plain memcpy
// from an unmapped source would kill the process with SIGSEGV. This unit turns such a fault into
// an error of that one copy, by one of two means, fastest first:
//
// 1. A *guarded memcpy*: a process-wide SIGSEGV/SIGBUS handler, installed once, that recognises a
//    fault raised inside a guarded copy (same thread, address within the source range) and
//    returns from the copy with an error (siglongjmp). Every other fault is passed on to the
//    handler that was installed before ours (Python's faulthandler, or the default action), so
//    crashes elsewhere still crash and still get reported. Used only while our handler is the
//    one installed: code that installs its own SIGSEGV handler after ours (for instance
//    `faulthandler.enable()` called again) silently switches copies to the next means.
// 2. `process_vm_readv` on this very process: the kernel reports an unmapped source as EFAULT.
//    About 2.4x slower than memcpy (it pins every source page), but needs no signal handler.
// Setting the environment variable DCPDS_NO_FAULT_GUARD=1 before the first engine starts keeps
// the handler out (the kernel path is used).
// Where neither is available (seccomp refusing process_vm_readv and a foreign handler), plain
// memcpy: the caller's storage check is then the only protection.
//
// Threads: any thread may call these functions, concurrently. The guarded region runs only
// memcpy and the CRC (no locks, no allocation), so leaving it by siglongjmp is safe.
// Fork: a child inherits the handler; it stays inert there unless a copy is guarded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dcpds {

enum class CopyPath : int { kGuarded = 0, kKernel = 1, kPlain = 2 };

// Installs the fault handler (idempotent, thread-safe). Returns whether it is installed.
bool install_copy_guard();

// Copies `bytes` from `src` to `dst`; with `crc` non-null also extends *crc (CRC-32C) over the
// copied bytes, block by block while they are still in the CPU cache. Returns false (with
// nothing guaranteed about `dst` and *crc) if the source was not readable. `path` receives the
// means used.
bool checked_copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes,
                  std::uint32_t* crc, CopyPath* path);

// Copies made by each means since the process started (for tests and diagnostics).
std::uint64_t copies_by_path(CopyPath path);

}  // namespace dcpds
