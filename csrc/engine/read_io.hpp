// Pieces shared by the restore data paths (reader.cpp into host memory, device_reader.cpp into
// device memory through pinned staging): open files, full preads, the cutting of spans into
// pieces and the final checksum comparison. Internal to the engine; no state of its own.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reader.hpp"

namespace dcpds::read_io {

constexpr std::size_t kAlign = 4096;  // O_DIRECT alignment of offsets, sizes, buffers

// A piece of a span: read by one thread in one go (cut at block boundaries of the file).
struct Piece {
  std::uint32_t span;
  std::uint64_t span_offset;  // where the piece starts inside its span
  std::uint64_t bytes;
};

// One file of a read: a buffered descriptor, and an O_DIRECT one while the file system takes it.
struct OpenFile {
  std::string path;
  int fd = -1;
  int fd_direct = -1;
  std::atomic<bool> direct_ok{false};
  OpenFile() = default;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  ~OpenFile();
};
using OpenFiles = std::vector<std::unique_ptr<OpenFile>>;

// Checks the spans against `paths` and `names`; throws EngineError naming the first bad one.
void check_spans(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                 const std::vector<std::string>& names);
// Opens each file some span reads (O_DIRECT too when `o_direct`); throws naming the span's item.
OpenFiles open_files(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                     const std::vector<std::string>& names, bool o_direct);
// Cuts the spans at multiples of `block` in the file; first[i] is span i's first piece
// (first[spans.size()] == pieces.size()). A span's pieces are consecutive.
std::vector<Piece> split_pieces(const std::vector<ReadSpan>& spans, std::size_t block,
                                std::vector<std::size_t>& first);
// Combines each span's piece CRCs, in order, and compares them with the expected values; throws
// the checksum mismatch of the first span that differs. Returns the bytes verified.
std::uint64_t verify_crcs(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                          const std::vector<std::string>& names, const std::vector<Piece>& pieces,
                          const std::vector<std::size_t>& first,
                          const std::vector<std::uint32_t>& crcs);

// Reads up to `bytes` at `offset` (retrying EINTR and short reads). Returns the bytes read (fewer
// only at end of file) or -errno. `direct`: an O_DIRECT descriptor (a read ending off an aligned
// boundary has met the end of the file).
long long pread_full(int fd, std::uint8_t* dst, std::size_t bytes, std::uint64_t offset,
                     bool direct);

std::string range_text(std::uint64_t a, std::uint64_t b);  // "bytes [a, b)"
// "'<name>': read of <path> (bytes [a, b)) failed: <strerror(err)>"
std::string read_failed_message(const std::string& name, const std::string& path,
                                std::uint64_t a, std::uint64_t b, int err);
// "'<name>': <path> ends at byte <at>, inside its data (bytes [a, b)): the file is truncated"
std::string truncated_message(const std::string& name, const std::string& path, long long at,
                              std::uint64_t a, std::uint64_t b);

}  // namespace dcpds::read_io
