#include "device_reader.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>
#include <utility>

#include "crc32c.hpp"
#include "error.hpp"
#include "read_io.hpp"

namespace dcpds {
namespace {

using read_io::Piece;

constexpr std::size_t kPread = 1u << 20;  // largest pread (its CRC is taken while in cache)
constexpr int kSlotsPerThread = 2;

// What one read() shares among its threads.
struct Shared {
  Shared(const std::vector<ReadSpan>& s, const std::vector<std::string>& n,
         const read_io::OpenFiles& f, const std::vector<Piece>& pc)
      : spans(s), names(n), files(f), pieces(pc), crcs(pc.size(), 0) {}

  const std::vector<ReadSpan>& spans;
  const std::vector<std::string>& names;
  const read_io::OpenFiles& files;
  const std::vector<Piece>& pieces;
  std::vector<std::size_t> group_start;  // group g: pieces [group_start[g], group_start[g+1])
  std::vector<std::uint32_t> crcs;       // per piece
  std::atomic<std::size_t> next_group{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> preads{0}, copy_calls{0}, batch_calls{0}, batch_copies{0};
  std::atomic<std::uint64_t> direct_bytes{0};
  std::mutex err_mu;
  std::string error;

  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (error.empty()) error = msg;
    stop.store(true);
  }
  const std::string& name_of(std::size_t piece) const {
    return names[spans[pieces[piece].span].name];
  }
};

// One reader thread: two slots, one stream, an event per slot.
class Worker {
 public:
  Worker(const DeviceStaging& staging, Shared& sh, std::size_t index)
      : st_(staging), rt_(staging.runtime()), sh_(sh) {
    for (int k = 0; k < kSlotsPerThread; ++k)
      slots_[k].base = staging.slot(index * kSlotsPerThread + static_cast<std::size_t>(k));
  }

  void run() {
    try {
      rt_.set_device(st_.device());
      stream_ = rt_.create_stream();
      for (Slot& s : slots_) s.event = rt_.create_event();
    } catch (const std::exception& e) {
      sh_.fail("cannot set up a copy stream on device " + std::to_string(st_.device()) + ": " +
               e.what());
      teardown();
      return;
    }
    int turn = 0;
    try {
      while (!sh_.stop.load()) {
        const std::size_t g = sh_.next_group.fetch_add(1);
        if (g + 1 >= sh_.group_start.size()) break;
        Slot& slot = slots_[turn];
        turn = (turn + 1) % kSlotsPerThread;
        if (!wait_slot(slot)) break;
        const std::size_t a = sh_.group_start[g], b = sh_.group_start[g + 1];
        if (!fill(slot, a, b)) break;
        if (!copy(slot, a, b)) break;
      }
    } catch (const std::exception& e) {
      sh_.fail(e.what());
    }
    teardown();
  }

 private:
  struct Slot {
    std::uint8_t* base = nullptr;
    CudaRuntime::Event event = nullptr;
    bool in_flight = false;
    std::size_t first = 0, count = 0;  // the pieces its copies carry (for error messages)
  };

  std::string copy_failed(std::size_t piece, const std::string& why) const {
    return "'" + sh_.name_of(piece) + "': copy to device " + std::to_string(st_.device()) +
           " failed: " + why;
  }

  // Waits until no copy reads the slot any more; false (error recorded) if that failed.
  bool wait_slot(Slot& slot) {
    if (!slot.in_flight) return true;
    slot.in_flight = false;
    try {
      rt_.synchronize_event(slot.event);
    } catch (const std::exception& e) {
      std::string why = e.what();
      if (slot.count > 1)
        why += " (the same staging slot held " + std::to_string(slot.count - 1) + " more pieces)";
      sh_.fail(copy_failed(slot.first, why));
      return false;
    }
    return true;
  }

  // Reads pieces [a, b) packed into the slot, one pread per run adjacent in one file (at most
  // kPread each), and takes each piece's CRC right after the pread that brought its bytes.
  bool fill(Slot& slot, std::size_t a, std::size_t b) {
    std::uint64_t pos = 0;  // slot position of piece k
    std::size_t k = a;
    while (k < b) {
      const ReadSpan& s0 = sh_.spans[sh_.pieces[k].span];
      const std::uint64_t off = s0.offset + sh_.pieces[k].span_offset;
      std::uint64_t len = sh_.pieces[k].bytes;
      std::size_t j = k + 1;
      while (j < b) {
        const ReadSpan& sj = sh_.spans[sh_.pieces[j].span];
        if (sj.file != s0.file || sj.offset + sh_.pieces[j].span_offset != off + len) break;
        len += sh_.pieces[j].bytes;
        ++j;
      }
      if (!read_run(slot.base + pos, s0.file, off, len, k, j)) return false;
      pos += len;
      k = j;
    }
    return true;
  }

  // Reads run [off, off + len) of `file` into dst in preads of at most kPread: through
  // O_DIRECT where the file takes it and the run starts aligned in the file and in the slot
  // (the last pread then reads up to the next 4 KiB boundary: into slot space that later
  // pieces overwrite, or that no piece uses, never past the slot); the CRC of each piece is
  // taken right after the pread that brought its bytes.
  bool read_run(std::uint8_t* dst, std::uint32_t file, std::uint64_t off, std::uint64_t len,
                std::size_t k, std::size_t j) {
    read_io::OpenFile& f = *sh_.files[file];
    const bool aligned = off % read_io::kAlign == 0 &&
                         reinterpret_cast<std::uintptr_t>(dst) % read_io::kAlign == 0;
    std::size_t c = k;         // the piece holding run byte r
    std::uint64_t c_start = 0; // its first byte in run coordinates
    for (std::uint64_t r = 0; r < len;) {
      if (sh_.stop.load()) return false;
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kPread, len - r));
      long long got = -EINVAL;
      if (aligned && f.direct_ok.load(std::memory_order_relaxed)) {
        const std::size_t window = (n + read_io::kAlign - 1) / read_io::kAlign * read_io::kAlign;
        got = read_io::pread_full(f.fd_direct, dst + r, window, off + r, /*direct=*/true);
        if (got == -EINVAL) f.direct_ok.store(false);  // refused here: the page cache
        else if (got >= static_cast<long long>(n)) sh_.direct_bytes.fetch_add(n);
      }
      if (got == -EINVAL)
        got = read_io::pread_full(f.fd, dst + r, n, off + r, /*direct=*/false);
      sh_.preads.fetch_add(1, std::memory_order_relaxed);
      if (got < static_cast<long long>(n)) {
        const std::uint64_t at = r + static_cast<std::uint64_t>(std::max<long long>(got, 0));
        while (c + 1 < j && c_start + sh_.pieces[c].bytes <= at) c_start += sh_.pieces[c++].bytes;
        const ReadSpan& s = sh_.spans[sh_.pieces[c].span];
        if (got < 0) {
          sh_.fail(read_io::read_failed_message(sh_.names[s.name], f.path, s.offset,
                                                s.offset + s.bytes, static_cast<int>(-got)));
        } else {
          sh_.fail(read_io::truncated_message(sh_.names[s.name], f.path,
                                              static_cast<long long>(off + at), s.offset,
                                              s.offset + s.bytes));
        }
        return false;
      }
      // CRC of bytes [r, r + n), piece by piece.
      for (std::uint64_t p = r; p < r + n;) {
        while (c_start + sh_.pieces[c].bytes <= p) c_start += sh_.pieces[c++].bytes;
        const std::uint64_t e = std::min<std::uint64_t>(r + n, c_start + sh_.pieces[c].bytes);
        if (sh_.spans[sh_.pieces[c].span].crc >= 0)
          sh_.crcs[c] = crc32c(sh_.crcs[c], dst + p, static_cast<std::size_t>(e - p));
        p = e;
      }
      r += n;
    }
    return true;
  }

  // Queues the copies of pieces [a, b) from the slot, then records the slot's event.
  bool copy(Slot& slot, std::size_t a, std::size_t b) {
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    owner_.clear();
    std::uint64_t pos = 0;
    for (std::size_t k = a; k < b; ++k) {
      const Piece& p = sh_.pieces[k];
      void* dst = reinterpret_cast<void*>(sh_.spans[p.span].dst + p.span_offset);
      void* src = slot.base + pos;
      pos += p.bytes;
      if (!dsts_.empty() && static_cast<std::uint8_t*>(dsts_.back()) + sizes_.back() == dst &&
          static_cast<std::uint8_t*>(srcs_.back()) + sizes_.back() == src) {
        sizes_.back() += p.bytes;
        continue;
      }
      dsts_.push_back(dst);
      srcs_.push_back(src);
      sizes_.push_back(static_cast<std::size_t>(p.bytes));
      owner_.push_back(k);
    }
    slot.first = a;
    slot.count = b - a;
    if (!queue_copies()) return false;
    try {
      rt_.record_event(slot.event, stream_);
    } catch (const std::exception& e) {
      rt_.try_synchronize_stream(stream_);
      sh_.fail(copy_failed(a, e.what()));
      return false;
    }
    slot.in_flight = true;
    return true;
  }

  bool queue_copies() {
    const std::size_t n = dsts_.size();
    if (n >= 2 && st_.pinned() && rt_.batch_available()) {
      std::size_t fail_index = CudaRuntime::kNoIndex;
      try {
        if (rt_.memcpy_h2d_batch(dsts_.data(), srcs_.data(), sizes_.data(), n, stream_,
                                 &fail_index)) {
          sh_.batch_calls.fetch_add(1, std::memory_order_relaxed);
          sh_.batch_copies.fetch_add(n, std::memory_order_relaxed);
          return true;
        }
      } catch (const std::exception& e) {
        rt_.try_synchronize_stream(stream_);  // some copies may have been queued
        sh_.fail(copy_failed(owner_[fail_index < n ? fail_index : 0], e.what()));
        return false;
      }
      // Refused as a whole (batching now off): the same copies, one by one.
    }
    for (std::size_t i = 0; i < n; ++i) {
      try {
        rt_.memcpy_h2d_async(dsts_[i], srcs_[i], sizes_[i], stream_);
      } catch (const std::exception& e) {
        rt_.try_synchronize_stream(stream_);
        sh_.fail(copy_failed(owner_[i], e.what()));
        return false;
      }
      sh_.copy_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
  }

  // Waits for every copy still reading a slot, then destroys the stream and events.
  void teardown() noexcept {
    for (Slot& s : slots_) {
      if (s.in_flight) wait_slot(s);
    }
    if (stream_ != nullptr && !rt_.try_synchronize_stream(stream_))
      sh_.fail("copy to device " + std::to_string(st_.device()) + " failed (stream error)");
    for (Slot& s : slots_) {
      if (s.event != nullptr) rt_.destroy_event(s.event);
      s.event = nullptr;
    }
    if (stream_ != nullptr) rt_.destroy_stream(stream_);
    stream_ = nullptr;
  }

  const DeviceStaging& st_;
  const CudaRuntime& rt_;
  Shared& sh_;
  CudaRuntime::Stream stream_ = nullptr;
  Slot slots_[kSlotsPerThread];
  std::vector<void*> dsts_, srcs_;
  std::vector<std::size_t> sizes_, owner_;
};

}  // namespace

DeviceStaging::DeviceStaging(const std::string& runtime_path, int device, std::size_t slots,
                             std::size_t slot_bytes, bool batch)
    : runtime_(std::make_unique<CudaRuntime>(runtime_path, batch)),
      device_(device),
      slots_(std::max<std::size_t>(slots, kSlotsPerThread) / kSlotsPerThread * kSlotsPerThread),
      slot_bytes_((std::max<std::size_t>(slot_bytes, read_io::kAlign) + read_io::kAlign - 1) /
                  read_io::kAlign * read_io::kAlign) {
  DCPDS_CHECK(device >= 0, "device must be a device index, got " + std::to_string(device));
  void* p = nullptr;
  const std::size_t bytes = slots_ * slot_bytes_;
  if (::posix_memalign(&p, read_io::kAlign, bytes) != 0 || p == nullptr)
    DCPDS_CHECK(false, "cannot allocate " + std::to_string(bytes) + " bytes of read staging");
  base_ = static_cast<std::uint8_t*>(p);
  try {
    runtime_->host_register(base_, bytes);
    pinned_ = true;
  } catch (const std::exception& e) {
    pin_error_ = e.what();
  }
}

DeviceStaging::~DeviceStaging() {
  std::lock_guard<std::mutex> lock(mu_);
  if (pinned_) runtime_->host_unregister(base_);
  std::free(base_);
}

DeviceReader::DeviceReader(const DeviceStaging& staging, const ReaderOptions& options)
    : staging_(staging), options_(options) {
  DCPDS_CHECK(options_.threads > 0, "reader threads must be positive");
  options_.block_bytes = std::min(std::max<std::size_t>(options_.block_bytes, read_io::kAlign),
                                  staging.slot_bytes());
}

ReadStats DeviceReader::read(const std::vector<std::string>& paths,
                             const std::vector<ReadSpan>& spans,
                             const std::vector<std::string>& names) const {
  read_io::check_spans(paths, spans, names);
  std::lock_guard<std::mutex> lock(staging_.mutex());
  const read_io::OpenFiles files = read_io::open_files(paths, spans, names, options_.o_direct);
  std::vector<std::size_t> first_piece;
  const std::vector<Piece> pieces = read_io::split_pieces(spans, options_.block_bytes, first_piece);
  Shared sh(spans, names, files, pieces);
  // Groups: consecutive pieces filling a slot.
  std::uint64_t used = 0;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (sh.group_start.empty() || used + pieces[k].bytes > staging_.slot_bytes()) {
      sh.group_start.push_back(k);
      used = 0;
    }
    used += pieces[k].bytes;
  }
  sh.group_start.push_back(pieces.size());
  const std::size_t groups = sh.group_start.size() - 1;
  const std::size_t nthreads = std::min({static_cast<std::size_t>(options_.threads),
                                         staging_.slots() / kSlotsPerThread, groups});
  std::vector<std::unique_ptr<Worker>> workers;
  for (std::size_t i = 0; i < nthreads; ++i)
    workers.push_back(std::make_unique<Worker>(staging_, sh, i));
  std::vector<std::thread> threads;
  try {
    for (std::size_t i = 0; i < nthreads; ++i)
      threads.emplace_back([&w = *workers[i]] { w.run(); });
  } catch (const std::system_error& e) {
    sh.fail(std::string("cannot start a reader thread: ") + e.what());
  }
  for (auto& t : threads) t.join();
  if (!sh.error.empty()) DCPDS_CHECK(false, sh.error);

  ReadStats stats;
  for (const ReadSpan& s : spans) stats.bytes += s.bytes;
  stats.verified_bytes = read_io::verify_crcs(paths, spans, names, pieces, first_piece, sh.crcs);
  stats.pieces = pieces.size();
  stats.threads = static_cast<int>(threads.size());
  stats.preads = sh.preads.load();
  stats.direct_bytes = sh.direct_bytes.load();
  stats.copy_calls = sh.copy_calls.load();
  stats.batch_calls = sh.batch_calls.load();
  stats.batch_copies = sh.batch_copies.load();
  return stats;
}

}  // namespace dcpds
