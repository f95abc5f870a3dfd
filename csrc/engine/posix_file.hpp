// PosixFile: one data file of a checkpoint, written at explicit offsets (pwrite/pwritev).
//
// Opened (created, truncated) by the caller's thread when the writer places items; written by any
// number of flush threads concurrently at disjoint offsets; synced and closed once by the thread
// that finalizes the save. With O_DIRECT, 4 KiB-aligned spans of page-aligned memory go through a
// second descriptor opened with O_DIRECT (bypassing the page cache); everything else (unaligned
// heads and tails, headers, payloads under kDirectMinBytes) through the buffered descriptor.
// Buffered bytes are handed to writeback every writeback_kick bytes (sync_file_range, which
// does not wait), so the disk works while later chunks are still being written.
// Small payloads go buffered because an O_DIRECT pwrite waits for the device: thousands of 4 KiB
// tensors written one synchronous request at a time cost more than one memcpy into the page
// cache each and a single fdatasync at the end (measured on the `mixed` benchmark mix). If the file system refuses O_DIRECT
// the file silently uses buffered I/O only (direct_enabled() tells).
// Anonymous files: with `anon_dir`, the file is created unnamed (O_TMPFILE) in that directory, on
// the file system `path` will be on; `path` only names it in errors until the caller links it
// there (link()). Unlinked, it vanishes when closed, also
// when the process dies: bytes flushed before the checkpoint directory is claimed never show.
// Errors: every failure throws EngineError naming the path.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dcpds {

class PosixFile {
 public:
  static constexpr std::size_t kDirectAlign = 4096;
  static constexpr std::size_t kDirectMinBytes = 1u << 20;  // smaller payloads: buffered

  // Creates (truncates) `path`; or, with a non-empty `anon_dir`, an unnamed file in that
  // directory (throws if the file system has no O_TMPFILE).
  // `writeback_kick` > 0: every time that many bytes went through the page cache, starts their
  // writeback (sync_file_range WRITE, no wait), so the final fdatasync finds little left to do.
  PosixFile(std::string path, bool o_direct, const std::string& anon_dir = "",
            std::uint64_t writeback_kick = 0);
  ~PosixFile();  // closes without syncing
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  // Writes all of `iov` contiguously starting at `offset` (retries short writes and EINTR).
  void write_at(std::uint64_t offset, const std::vector<iovec>& iov);
  // Writes [data, data+bytes) at offset, through O_DIRECT for the aligned middle when enabled.
  void write_payload_at(std::uint64_t offset, const std::uint8_t* data, std::size_t bytes);
  void sync();   // fdatasync
  void close();  // idempotent
  // A new descriptor of the file (O_CLOEXEC) that the caller owns and closes; it keeps an
  // unnamed file alive after close().
  int dup_fd() const;
  // Gives an unnamed file its name `path()` (linkat through /proc/self/fd), replacing a file of
  // that name. Throws naming the path (EXDEV, no /proc, a file system without linkat...).
  void link();

  const std::string& path() const { return path_; }
  bool direct_enabled() const { return fd_direct_ >= 0; }
  bool is_open() const { return fd_ >= 0; }

 private:
  void maybe_kick_writeback(std::uint64_t bytes);

  std::string path_;
  std::uint64_t writeback_kick_ = 0;
  std::atomic<std::uint64_t> unkicked_{0};  // buffered bytes written since the last kick
  int fd_ = -1;
  int fd_direct_ = -1;
};

// Test hook: makes writes to paths containing `needle` fail with `err` (empty needle disables).
void set_write_fault(const std::string& needle, int err);

}  // namespace dcpds
