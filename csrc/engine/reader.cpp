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
#include "read_io.hpp"

namespace dcpds {
namespace {

using read_io::kAlign;
using read_io::Piece;
using read_io::pread_full;
using read_io::range_text;

constexpr std::size_t kCrcBlock = 256u << 10; // checksum (and copy) granularity: stays in cache
constexpr std::size_t kBufferedRead = 1u << 20;

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
  read_io::check_spans(paths, spans, names);
  read_io::OpenFiles files = read_io::open_files(paths, spans, names, options_.o_direct);

  // Split the spans into pieces; a span's pieces are consecutive.
  const std::size_t block = options_.block_bytes;
  std::vector<std::size_t> first_piece;
  const std::vector<Piece> pieces = read_io::split_pieces(spans, block, first_piece);
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
        read_io::OpenFile& f = *files[s.file];
        const std::uint64_t off = s.offset + p.span_offset;
        const std::uint64_t end = off + p.bytes;
        auto* dst = reinterpret_cast<std::uint8_t*>(s.dst) + p.span_offset;
        auto truncated = [&](long long got_to) {
          return read_io::truncated_message(names[s.name], f.path, got_to, s.offset,
                                            s.offset + s.bytes);
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
            fail(read_io::read_failed_message(names[s.name], f.path, off, end,
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
              fail(read_io::read_failed_message(names[s.name], f.path, off, end,
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
  for (const ReadSpan& s : spans) stats.bytes += s.bytes;
  stats.verified_bytes = read_io::verify_crcs(paths, spans, names, pieces, first_piece, crcs);
  stats.direct_bytes = direct_bytes.load();
  stats.pieces = pieces.size();
  stats.threads = std::max(nthreads, 1);
  return stats;
}

}  // namespace dcpds
