#include "reader.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "crc32c.hpp"
#include "error.hpp"

namespace dcpds {
namespace {

constexpr std::size_t kAlign = 4096;          // O_DIRECT alignment of offsets, sizes, buffers
constexpr std::size_t kCrcBlock = 256u << 10; // checksum (and copy) granularity: stays in cache
constexpr std::size_t kBufferedRead = 1u << 20;

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
  ~OpenFile() {
    if (fd >= 0) ::close(fd);
    if (fd_direct >= 0) ::close(fd_direct);
  }
};

struct FreeDeleter {
  void operator()(std::uint8_t* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::uint8_t, FreeDeleter>;

AlignedBuffer aligned_buffer(std::size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, kAlign, bytes) != 0 || p == nullptr)
    DCPDS_CHECK(false, "cannot allocate a read buffer of " + std::to_string(bytes) + " bytes");
  return AlignedBuffer(static_cast<std::uint8_t*>(p));
}

std::string range_text(std::uint64_t a, std::uint64_t b) {
  return "bytes [" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Reads up to `bytes` at `offset` (retrying EINTR and short reads). Returns the bytes read (fewer
// only at end of file) or -errno.
long long pread_full(int fd, std::uint8_t* dst, std::size_t bytes, std::uint64_t offset,
                     bool direct) {
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t r = ::pread(fd, dst + got, bytes - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<long long>(errno);
    }
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
    // An O_DIRECT read that stops short of an aligned boundary has met the end of the file.
    if (direct && got % kAlign != 0) break;
  }
  return static_cast<long long>(got);
}

}  // namespace

ParallelReader::ParallelReader(const ReaderOptions& options) : options_(options) {
  DCPDS_CHECK(options_.threads > 0, "reader threads must be positive");
  std::size_t b = std::max<std::size_t>(options_.block_bytes, kAlign);
  options_.block_bytes = (b + kAlign - 1) / kAlign * kAlign;
}

ReadStats ParallelReader::read(const std::vector<std::string>& paths,
                               const std::vector<ReadSpan>& spans,
                               const std::vector<std::string>& names) const {
  ReadStats stats;
  for (const ReadSpan& s : spans) {
    DCPDS_CHECK(s.file < paths.size(), "read span names file " + std::to_string(s.file) +
                                           " of " + std::to_string(paths.size()));
    DCPDS_CHECK(s.name < names.size(), "read span names an unknown item");
    DCPDS_CHECK(s.bytes == 0 || s.dst != 0, "'" + names[s.name] + "': null destination");
  }

  // Open the files that are read.
  std::vector<std::unique_ptr<OpenFile>> files(paths.size());
  for (const ReadSpan& s : spans) {
    if (files[s.file]) continue;
    auto f = std::make_unique<OpenFile>();
    f->path = paths[s.file];
    f->fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd < 0)
      DCPDS_CHECK(false, errno_message("'" + names[s.name] + "': cannot open " + f->path, errno));
#ifdef O_DIRECT
    if (options_.o_direct) {
      f->fd_direct = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      f->direct_ok.store(f->fd_direct >= 0);
    }
#endif
    files[s.file] = std::move(f);
  }

  // Split the spans into pieces; a span's pieces are consecutive.
  const std::size_t block = options_.block_bytes;
  std::vector<Piece> pieces;
  std::vector<std::size_t> first_piece(spans.size() + 1, 0);
  for (std::uint32_t i = 0; i < spans.size(); ++i) {
    first_piece[i] = pieces.size();
    const ReadSpan& s = spans[i];
    std::uint64_t pos = 0;
    while (pos < s.bytes) {
      // Cut at block boundaries of the file, so that aligned spans give aligned pieces.
      const std::uint64_t file_pos = s.offset + pos;
      const std::uint64_t next = (file_pos / block + 1) * block;
      const std::uint64_t n = std::min<std::uint64_t>(next - file_pos, s.bytes - pos);
      pieces.push_back(Piece{i, pos, n});
      pos += n;
    }
  }
  first_piece[spans.size()] = pieces.size();
  std::vector<std::uint32_t> crcs(pieces.size(), 0);

  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> direct_bytes{0};
  std::mutex err_mu;
  std::string error;
  auto fail = [&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (error.empty()) error = msg;
    stop.store(true);
  };

  auto worker = [&] {
    AlignedBuffer bounce;
    try {
      for (;;) {
        if (stop.load()) return;
        const std::size_t pi = next.fetch_add(1);
        if (pi >= pieces.size()) return;
        const Piece& p = pieces[pi];
        const ReadSpan& s = spans[p.span];
        OpenFile& f = *files[s.file];
        const std::uint64_t off = s.offset + p.span_offset;
        const std::uint64_t end = off + p.bytes;
        auto* dst = reinterpret_cast<std::uint8_t*>(s.dst) + p.span_offset;
        auto truncated = [&](long long got_to) {
          return "'" + names[s.name] + "': " + f.path + " ends at byte " + std::to_string(got_to) +
                 ", inside its data (" + range_text(s.offset, s.offset + s.bytes) +
                 "): the file is truncated";
        };
        std::uint32_t crc = 0;
        bool done = false;
        if (f.direct_ok.load(std::memory_order_relaxed)) {
          const std::uint64_t a0 = off / kAlign * kAlign;
          const std::uint64_t a1 = (end + kAlign - 1) / kAlign * kAlign;
          const bool in_place =
              a0 == off && a1 == end && reinterpret_cast<std::uintptr_t>(dst) % kAlign == 0;
          if (!in_place && !bounce) bounce = aligned_buffer(block + 2 * kAlign);
          std::uint8_t* buf = in_place ? dst : bounce.get();
          const long long got = pread_full(f.fd_direct, buf, a1 - a0, a0, /*direct=*/true);
          if (got == -EINVAL) {
            f.direct_ok.store(false);  // this file system refuses O_DIRECT here: page cache
          } else if (got < 0) {
            fail(errno_message("'" + names[s.name] + "': read of " + f.path + " (" +
                                   range_text(off, end) + ") failed",
                               static_cast<int>(-got)));
            return;
          } else if (static_cast<std::uint64_t>(got) < end - a0) {
            fail(truncated(static_cast<long long>(a0) + got));
            return;
          } else {
            const std::uint8_t* src = buf + (off - a0);
            for (std::uint64_t pos = 0; pos < p.bytes; pos += kCrcBlock) {
              const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kCrcBlock, p.bytes - pos));
              if (s.crc >= 0) crc = crc32c(crc, src + pos, n);
              if (!in_place) std::memcpy(dst + pos, src + pos, n);
            }
            direct_bytes.fetch_add(p.bytes);
            done = true;
          }
        }
        if (!done) {
          for (std::uint64_t pos = 0; pos < p.bytes; pos += kBufferedRead) {
            const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBufferedRead, p.bytes - pos));
            const long long got = pread_full(f.fd, dst + pos, n, off + pos, /*direct=*/false);
            if (got < 0) {
              fail(errno_message("'" + names[s.name] + "': read of " + f.path + " (" +
                                     range_text(off, end) + ") failed",
                                 static_cast<int>(-got)));
              return;
            }
            if (static_cast<std::size_t>(got) < n) {
              fail(truncated(static_cast<long long>(off + pos) + got));
              return;
            }
            if (s.crc >= 0) crc = crc32c(crc, dst + pos, n);
          }
        }
        crcs[pi] = crc;
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
  };

  const int nthreads = static_cast<int>(
      std::min<std::size_t>(static_cast<std::size_t>(options_.threads), pieces.size()));
  if (nthreads <= 1) {
    worker();
  } else {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(nthreads));
    try {
      for (int i = 0; i < nthreads; ++i) threads.emplace_back(worker);
    } catch (const std::system_error& e) {
      fail(std::string("cannot start a reader thread: ") + e.what());
    }
    for (auto& t : threads) t.join();
  }
  if (!error.empty()) DCPDS_CHECK(false, error);

  // Checksums: combine each span's pieces, in order, and compare.
  for (std::uint32_t i = 0; i < spans.size(); ++i) {
    const ReadSpan& s = spans[i];
    stats.bytes += s.bytes;
    if (s.crc < 0) continue;
    std::uint32_t crc = 0;
    for (std::size_t pi = first_piece[i]; pi < first_piece[i + 1]; ++pi)
      crc = pi == first_piece[i] ? crcs[pi] : crc32c_combine(crc, crcs[pi], pieces[pi].bytes);
    const auto expected = static_cast<std::uint32_t>(s.crc);
    if (crc != expected) {
      DCPDS_CHECK(false, "checksum mismatch in '" + names[s.name] + "' (" + paths[s.file] + ", " +
                             range_text(s.offset, s.offset + s.bytes) + "): the manifest records " +
                             hex32(expected) + ", the file holds " + hex32(crc) +
                             ": the checkpoint is damaged");
    }
    stats.verified_bytes += s.bytes;
  }
  stats.direct_bytes = direct_bytes.load();
  stats.pieces = pieces.size();
  stats.threads = std::max(nthreads, 1);
  return stats;
}

}  // namespace dcpds
