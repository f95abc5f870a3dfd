// ParallelReader: the restore data path. It reads byte ranges of checkpoint files into memory the
// caller owns, with several threads issuing pread()s at once, through O_DIRECT where the file
// system allows it, and verifies each range's CRC-32C in the same pass (each block is checksummed
// while it is still in the CPU cache, right after it was read). Like the Engine it knows nothing
// of Python, torch or DCP: paths, offsets, sizes and addresses.
//
// Reads: a range is split into pieces of at most `block_bytes` (4 KiB-aligned in the file when
// the range starts aligned); threads take pieces from a shared counter, so one large range is
// read in parallel as well as many small ones. With O_DIRECT a piece is read through a 4 KiB-
// aligned window: straight into the destination when the destination, the file offset and the
// length are all 4 KiB-aligned, else into the thread's aligned bounce buffer, from which the
// wanted bytes are copied. Files (or pieces) that refuse O_DIRECT (EINVAL: tmpfs, some network
// file systems) are read through the page cache instead.
// Checksums: a piece's CRC is taken over exactly its bytes; the pieces of a range are combined
// (crc32c_combine) once all are read and compared with the expected value.
// Threads: read() starts its threads and joins them before it returns; a ParallelReader holds no
// thread or descriptor between calls, and read() may be called from several threads at once.
// Memory: `threads` bounce buffers of `block_bytes` (+8 KiB) while read() runs, nothing else.
// Lifetimes: every destination must stay valid and untouched by others until read() returns.
// Failures: the first error (a file that cannot be opened, an I/O error, a file that ends before
// a range does, a checksum mismatch) stops the remaining work and read() throws EngineError naming
// the range's name, the path and the byte range. Destinations of a failed read hold partial data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dcpds {

struct ReadSpan {
  std::uint32_t file = 0;     // index into read()'s `paths`
  std::uint64_t offset = 0;   // first byte in the file
  std::uint64_t bytes = 0;
  std::uintptr_t dst = 0;     // host address receiving the bytes
  std::int64_t crc = -1;      // expected CRC-32C of the range; -1: not verified
  std::uint32_t name = 0;     // index into read()'s `names` (for error messages)
};

struct ReaderOptions {
  int threads = 4;                      // concurrent preads (I/O depth), not CPU parallelism
  bool o_direct = true;                 // read through O_DIRECT where the file system allows it
  std::size_t block_bytes = 8u << 20;   // largest single pread; rounded up to 4 KiB
};

struct ReadStats {
  std::uint64_t bytes = 0;          // bytes delivered to destinations
  std::uint64_t direct_bytes = 0;   // of which read with O_DIRECT
  std::uint64_t verified_bytes = 0; // of which covered by a checked CRC
  std::uint64_t pieces = 0;
  int threads = 0;                  // threads actually started
  // Reads into device memory (DeviceReader) only:
  std::uint64_t preads = 0;         // pread() calls (adjacent pieces are read in one)
  std::uint64_t copy_calls = 0;     // cudaMemcpyAsync calls (host to device)
  std::uint64_t batch_calls = 0;    // cudaMemcpyBatchAsync calls
  std::uint64_t batch_copies = 0;   // copies queued by them
};

class ParallelReader {
 public:
  explicit ParallelReader(const ReaderOptions& options);
  // Reads every span; throws EngineError on the first failure (see the file comment).
  ReadStats read(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                 const std::vector<std::string>& names) const;
  const ReaderOptions& options() const { return options_; }

 private:
  ReaderOptions options_;
};

}  // namespace dcpds
