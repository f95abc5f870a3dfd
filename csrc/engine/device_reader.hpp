// DeviceReader: the restore data path into device (GPU) memory. Checkpoint bytes are read with
// pread()s into page-locked *staging* slots and copied to their device destinations with
// asynchronous host-to-device copies, while the same thread fills its other slot: reads from a
// memory tier (/dev/shm) or the page cache and the DMA over the link overlap, and the reads of
// several threads run at once. Like the rest of the engine it knows nothing of Python, torch or
// DCP: paths, offsets, sizes and device addresses; the CUDA runtime is the dlopen()ed one
// (CudaRuntime).
//
// Staging (DeviceStaging): `slots` slots of `slot_bytes`, one allocation registered once with
// cudaHostRegister (where that fails the slots stay pageable and every copy is synchronous for
// the host: correct, slower; pinned() / pin_error() tell). Two slots per reader thread.
// Work: spans are cut into pieces of at most min(block_bytes, slot_bytes) (at block boundaries
// of the file), and consecutive pieces are grouped to fill a slot. A thread takes a group,
// waits until the slot it fills next is no longer read by a copy (its event), reads the group
// with one pread() per run of pieces adjacent in one file (at most 1 MiB each, the CRC-32C of
// each piece taken right after, while in cache; through O_DIRECT when `o_direct`, the file
// system takes it and the run starts 4 KiB-aligned, as large payloads do), then queues the
// copies on its own stream (runs adjacent in the device and in the slot become one copy; two or
// more go in one cudaMemcpyBatchAsync where the runtime has it, else one cudaMemcpyAsync each)
// and records the slot's event. Many small tensors thus cost one read and one call per slot, not one each.
// Ordering: the copies are ordered after nothing the caller queued: the caller must make sure
// no device work still writes the destinations (synchronize them) before read(). read()
// returns only once every copy it queued is complete (streams synchronized), error or not.
// Threads: read() starts its threads (each sets the staging's device, creates a stream and two
// events, and destroys them before it ends) and joins them; the caller's current device is not
// touched. One read() at a time per staging (others wait); a staging may be used by any thread.
// Failures: the first error stops the remaining work and read() throws EngineError naming the
// item: an open/read error or truncated file (as ParallelReader), a checksum mismatch (compared
// once all copies are done), a failing CUDA call ("'<item>': copy to device <d> failed: <call>
// failed: <message> (cudaError N)"; a failure found when waiting for a slot names the slot's
// first item and how many others it held). Destinations of a failed read hold partial data.
// Batch calls the runtime refuses as a whole switch batching off for this staging's runtime;
// the same copies are issued one by one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime.hpp"
#include "reader.hpp"

namespace dcpds {

class DeviceStaging {
 public:
  // Loads the runtime at `runtime_path` (CudaRuntime), allocates slots x slot_bytes of host
  // memory and registers it. `batch` false: never use cudaMemcpyBatchAsync.
  DeviceStaging(const std::string& runtime_path, int device, std::size_t slots,
                std::size_t slot_bytes, bool batch = true);
  ~DeviceStaging();  // unregisters and frees (no read() may be running)
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  int device() const { return device_; }
  std::size_t slots() const { return slots_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  bool pinned() const { return pinned_; }
  const std::string& pin_error() const { return pin_error_; }
  const CudaRuntime& runtime() const { return *runtime_; }
  std::uint8_t* slot(std::size_t i) const { return base_ + i * slot_bytes_; }
  std::mutex& mutex() const { return mu_; }

 private:
  std::unique_ptr<CudaRuntime> runtime_;
  int device_;
  std::size_t slots_;
  std::size_t slot_bytes_;
  std::uint8_t* base_ = nullptr;
  bool pinned_ = false;
  std::string pin_error_;
  mutable std::mutex mu_;
};

class DeviceReader {
 public:
  // options.threads is capped at staging.slots() / 2; options.o_direct: runs that start
  // 4 KiB-aligned in the file are read with O_DIRECT where the file system takes it.
  DeviceReader(const DeviceStaging& staging, const ReaderOptions& options);
  // Reads every span (dst: a device address on the staging's device); see the file comment.
  ReadStats read(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                 const std::vector<std::string>& names) const;

 private:
  const DeviceStaging& staging_;
  ReaderOptions options_;
};

}  // namespace dcpds
