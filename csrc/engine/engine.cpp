#include "engine.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstring>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "crc32c.hpp"
#include "error.hpp"
#include "guarded_copy.hpp"

namespace dcpds {
namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::size_t clamp_chunk(const EngineOptions& o) {
  DCPDS_CHECK(o.cache_bytes > 0, "host cache size must be positive");
  std::size_t c = o.chunk_bytes == 0 ? (64u << 20) : o.chunk_bytes;
  c = std::min(c, o.cache_bytes);
  // Keep chunks page multiples so that every chunk of a page-aligned payload stays page-aligned.
  if (c >= PosixFile::kDirectAlign) c = c / PosixFile::kDirectAlign * PosixFile::kDirectAlign;
  return c;
}

// Names the calling worker thread ("dcpds-copy0", "dcpds-flush1": what top -H, py-spy and
// /proc/<pid>/task/*/comm show) and sets its priority.
void set_thread_identity(const EngineOptions& o, bool flush, int index) {
  const std::string name = std::string(flush ? "dcpds-flush" : "dcpds-copy") + std::to_string(index);
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());  // best effort
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  if (flush ? o.flush_idle : o.idle_priority) {
    sched_param param{};
    param.sched_priority = 0;
    if (::sched_setscheduler(tid, SCHED_IDLE, &param) == 0) return;  // best effort
  }
  if (flush && o.flush_nice > 0) ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), o.flush_nice);
}

// One copy thread's stream and event on `device`: both or neither, so that a failure to create
// the second leaks nothing.
std::pair<CudaRuntime::Stream, CudaRuntime::Event> create_copy_resources(const CudaRuntime& cuda,
                                                                         int device) {
  cuda.set_device(device);
  CudaRuntime::Stream stream = cuda.create_stream();
  try {
    return {stream, cuda.create_event()};
  } catch (...) {
    cuda.destroy_stream(stream);
    throw;
  }
}

}  // namespace

Engine::Engine(const EngineOptions& options)
    : owner_pid_(::getpid()),
      options_(options),
      chunk_bytes_(clamp_chunk(options)),
      align_(options.o_direct ? PosixFile::kDirectAlign : 64),
      cuda_(nullptr),
      cache_(options.cache_bytes, options.prefault),
      ring_(options.cache_bytes) {
  DCPDS_CHECK(options.copy_threads >= 1, "copy_threads must be at least 1");
  DCPDS_CHECK(options.flush_threads >= 1, "flush_threads must be at least 1");
  install_copy_guard();  // fast, fault-safe copies of lazily captured sources
  try {
    for (int i = 0; i < options.copy_threads; ++i) threads_.emplace_back([this, i] { copy_loop(i); });
    for (int i = 0; i < options.flush_threads; ++i)
      threads_.emplace_back([this, i] { flush_loop(i); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    ring_.shutdown();
    for (auto& t : threads_) t.join();
    throw;
  }
}

Engine::~Engine() {
  if (!is_owner()) {
    abandon_in_child();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& kv : jobs_) fail_locked(*kv.second, "the engine was closed before this save finished");
  }
  work_cv_.notify_all();
  state_cv_.notify_all();
  ring_.shutdown();
  for (auto& t : threads_) t.join();
}

// ------------------------------------------------------------------------------------------------
// Fork safety

bool Engine::is_owner() const { return ::getpid() == owner_pid_; }

void Engine::check_owner() const {
  if (!is_owner())
    throw EngineError("this engine belongs to process " + std::to_string(owner_pid_) +
                      "; a forked child (process " + std::to_string(::getpid()) +
                      ") cannot use it: create a new writer in the child");
}

void Engine::abandon_in_child() noexcept {
  // In a forked child only the forking thread exists: the worker threads, and any lock or
  // condition-variable waiter they had at the fork, are copies of the parent's. Joining them,
  // destroying a condition variable that lists their waits (glibc waits for those waiters), or
  // unregistering pinned memory through CUDA would hang or crash. Everything that could do so is
  // leaked (the child's copy of the memory is freed when it exits); the members destroyed after
  // this are fresh, empty objects.
  new std::vector<std::thread>(std::move(threads_));
  new std::map<std::uint64_t, std::unique_ptr<Job>>(std::move(jobs_));
  new HostCache(std::move(cache_));
  (void)cuda_.release();
  const std::size_t capacity = ring_.capacity();
  new (&ring_) RingAllocator(capacity);
  new (&work_cv_) std::condition_variable();
  new (&state_cv_) std::condition_variable();
  new (&mu_) std::mutex();
}

// ------------------------------------------------------------------------------------------------
// Bookkeeping helpers (all with mu_ held)

Engine::Job& Engine::job_locked(std::uint64_t id) {
  auto it = jobs_.find(id);
  DCPDS_CHECK(it != jobs_.end(), "unknown save job " + std::to_string(id));
  return *it->second;
}

void Engine::check_failed_locked(const Job& job) const {
  if (job.failed.load()) throw EngineError(job.error);
}

void Engine::fail_locked(Job& job, const std::string& message) {
  if (job.failed.load() || job.done) return;
  job.error = message;
  job.stats.error = message;
  job.stats.failed = true;
  job.failed.store(true);
  // Drop every chunk no worker holds: pending copies and landed chunks.
  for (auto& e : job.entries) drop_chunks_locked(job, e);
  // Queued raw writes and finalize tasks see the flag and count themselves out.
  maybe_finalize_locked(job);
  ring_.notify_waiters();
  state_cv_.notify_all();
}

void Engine::resolve_copy_locked(Job& job, Chunk& chunk) {
  (void)chunk;
  if (job.uncaptured > 0 && --job.uncaptured == 0 && job.started && !job.captured) {
    job.captured = true;
    job.stats.captured_s = now_s();
  }
}

std::uint8_t* Engine::chunk_data(const Entry& e, const Chunk& c) const {
  if (e.direct) return reinterpret_cast<std::uint8_t*>(e.src) + c.entry_offset;
  return cache_.data() + c.cache_offset;
}

void Engine::finish_chunk_locked(Job& job, Entry& entry, Chunk& chunk, ChunkState to) {
  if (!entry.direct) ring_.release(chunk.cache_offset);
  chunk.state = to;
  --job.outstanding;
}

void Engine::drop_chunks_locked(Job& job, Entry& e) {
  // Chunks a worker holds (copying, flushing) are dropped by that worker when it is done.
  for (auto& c : e.chunks) {
    if (c.state == ChunkState::kPending && e.queued) {
      resolve_copy_locked(job, c);
      c.state = ChunkState::kSkipped;
      --job.outstanding;
    } else if (c.state == ChunkState::kLanded) {
      finish_chunk_locked(job, e, c, ChunkState::kSkipped);
    }
  }
}

void Engine::maybe_finalize_locked(Job& job) {
  if (job.done || job.outstanding != 0 || job.uncaptured != 0) return;
  if (job.failed.load()) {
    if (job.finalizing) return;  // the finalize task in the queue will complete the job
    for (auto& f : job.files) f->close();
    job.done = true;
    job.stats.done_s = now_s();
    state_cv_.notify_all();
    return;
  }
  if (!job.sealed || job.finalizing) return;
  job.finalizing = true;
  enqueue_flush_locked(FlushTask{FlushKind::kFinalize, job.id});
}

void Engine::enqueue_flush_locked(const FlushTask& t) {
  flush_queue_.push_back(t);
  work_cv_.notify_all();
}

// ------------------------------------------------------------------------------------------------
// Stage 1: register

std::uint64_t Engine::create_job(const std::string& label) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  DCPDS_CHECK(!stop_, "the engine is closed");
  const std::uint64_t id = next_job_++;
  auto job = std::make_unique<Job>();
  job->id = id;
  job->label = label;
  job->stats.created_s = now_s();
  jobs_.emplace(id, std::move(job));
  return id;
}

std::uint32_t Engine::add_entry(std::uint64_t job_id, const std::string& name, std::uintptr_t src,
                                std::size_t bytes, int device, std::uintptr_t ready_event,
                                bool direct) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(!job.sealed, "cannot add entry '" + name + "' to a sealed save");
  check_entry_locked(name, src, bytes, device, direct);
  return add_entry_locked(job, name, src, bytes, device, ready_event, direct);
}

std::uint32_t Engine::add_entries(std::uint64_t job_id, const std::vector<std::string>& names,
                                  const std::vector<std::uintptr_t>& srcs,
                                  const std::vector<std::size_t>& bytes,
                                  const std::vector<int>& devices,
                                  const std::vector<std::uintptr_t>& ready_events,
                                  const std::vector<std::uint8_t>& direct) {
  check_owner();
  const std::size_t n = names.size();
  DCPDS_CHECK(srcs.size() == n && bytes.size() == n && devices.size() == n &&
                  ready_events.size() == n && direct.size() == n,
              "add_entries: the argument lists differ in length");
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(!job.sealed, "cannot add entries to a sealed save");
  for (std::size_t i = 0; i < n; ++i)
    check_entry_locked(names[i], srcs[i], bytes[i], devices[i], direct[i] != 0);
  const auto first = static_cast<std::uint32_t>(job.entries.size());
  job.entries.reserve(job.entries.size() + n);
  for (std::size_t i = 0; i < n; ++i)
    add_entry_locked(job, names[i], srcs[i], bytes[i], devices[i], ready_events[i],
                     direct[i] != 0);
  return first;
}

void Engine::check_entry_locked(const std::string& name, std::uintptr_t src, std::size_t bytes,
                                int device, bool direct) const {
  DCPDS_CHECK(bytes == 0 || src != 0, "entry '" + name + "' has a null source address");
  DCPDS_CHECK(device < 0 || cuda_ != nullptr,
              "entry '" + name + "' is on a CUDA device but CUDA is not enabled on this engine");
  DCPDS_CHECK(!direct || device < 0, "entry '" + name + "': only host memory can be flushed directly");
}

std::uint32_t Engine::add_entry_locked(Job& job, const std::string& name, std::uintptr_t src,
                                       std::size_t bytes, int device, std::uintptr_t ready_event,
                                       bool direct) {
  Entry e;
  e.name = name;
  e.src = src;
  e.bytes = bytes;
  e.device = device;
  e.ready_event = ready_event;
  e.direct = direct;
  for (std::size_t off = 0; off < bytes; off += chunk_bytes_) {
    Chunk c;
    c.entry_offset = off;
    c.bytes = std::min(chunk_bytes_, bytes - off);
    e.chunks.push_back(c);
  }
  job.entries.push_back(std::move(e));
  job.stats.bytes_total += bytes;
  return static_cast<std::uint32_t>(job.entries.size() - 1);
}

void Engine::start_copies(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  for (std::uint32_t ei = 0; ei < job.entries.size(); ++ei) {
    Entry& e = job.entries[ei];
    if (e.queued) continue;
    e.queued = true;
    for (std::uint32_t ci = 0; ci < e.chunks.size(); ++ci) {
      if (e.placement == Placement::kSkip) {
        e.chunks[ci].state = ChunkState::kSkipped;
        continue;
      }
      ++job.outstanding;
      if (e.direct) {
        // Nothing to copy: the chunk is "landed" where it is.
        e.chunks[ci].state = ChunkState::kLanded;
        job.stats.bytes_copied += e.chunks[ci].bytes;
        if (e.placement == Placement::kFile) {
          e.chunks[ci].state = ChunkState::kFlushing;
          enqueue_flush_locked(FlushTask{FlushKind::kChunk, job_id, ei, ci});
        }
        continue;
      }
      copy_queue_.push_back(CopyTask{job_id, ei, ci});
      ++job.uncaptured;
    }
  }
  job.started = true;
  if (job.uncaptured == 0 && !job.captured) {
    job.captured = true;
    job.stats.captured_s = now_s();
  }
  maybe_finalize_locked(job);
  work_cv_.notify_all();
  state_cv_.notify_all();
}

std::vector<std::size_t> Engine::reserve(std::uint64_t job_id, std::uint32_t entry, bool wait) {
  check_owner();
  std::vector<std::size_t> sizes;
  Job* job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = &job_locked(job_id);
    check_failed_locked(*job);
    DCPDS_CHECK(entry < job->entries.size(), "unknown entry " + std::to_string(entry));
    const Entry& e = job->entries[entry];
    DCPDS_CHECK(!e.queued && e.device < 0 && !e.direct,
                "entry '" + e.name + "' cannot be captured by the caller");
    for (const auto& c : e.chunks) sizes.push_back(c.bytes);
  }
  std::vector<std::size_t> offsets;
  auto undo = [&] {
    for (std::size_t o : offsets) ring_.release(o);
    offsets.clear();
  };
  std::atomic<bool>& failed = job->failed;
  for (std::size_t bytes : sizes) {
    std::optional<std::size_t> off;
    if (wait) {
      std::uint64_t ticket;
      {
        std::lock_guard<std::mutex> lock(mu_);  // tickets in the same order as the copy threads'
        ticket = ring_.take_ticket();
      }
      off = ring_.allocate_with_ticket(ticket, bytes, cache_align(bytes),
                                        [&] { return failed.load(); });
      if (!off) {
        undo();
        std::lock_guard<std::mutex> lock(mu_);
        check_failed_locked(*job);
        DCPDS_CHECK(false, "the engine was closed while a save waited for host cache space");
      }
    } else {
      off = ring_.try_allocate(bytes, cache_align(bytes));
      if (!off) {
        undo();
        return {};
      }
    }
    offsets.push_back(*off);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (job->failed.load()) {
    undo();
    check_failed_locked(*job);
  }
  Entry& e = job->entries[entry];
  e.queued = true;
  for (std::size_t i = 0; i < e.chunks.size(); ++i) {
    Chunk& c = e.chunks[i];
    c.cache_offset = offsets[i];
    c.state = ChunkState::kCopying;  // held by the caller until land()
    ++job->uncaptured;
    ++job->outstanding;
  }
  return offsets;
}

void Engine::land(std::uint64_t job_id, std::uint32_t entry, bool ok, const std::string& error,
                  double busy_s) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  job.stats.copy_busy_s += busy_s;
  land_locked(job, entry, ok, error);
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

void Engine::land_locked(Job& job, std::uint32_t entry, bool ok, const std::string& error) {
  Entry& e = job.entries[entry];
  for (std::size_t i = 0; i < e.chunks.size(); ++i) {
    Chunk& c = e.chunks[i];
    if (c.state != ChunkState::kCopying) continue;
    resolve_copy_locked(job, c);
    c.state = ChunkState::kLanded;
    if (!ok || job.failed.load() || e.placement == Placement::kSkip) {
      finish_chunk_locked(job, e, c, ChunkState::kSkipped);
    } else {
      job.stats.bytes_copied += c.bytes;
      if (e.placement == Placement::kFile) {
        c.state = ChunkState::kFlushing;
        enqueue_flush_locked(
            FlushTask{FlushKind::kChunk, job.id, entry, static_cast<std::uint32_t>(i)});
      }
    }
  }
  if (!ok) fail_locked(job, "copy of '" + e.name + "' failed: " + error);
}

bool Engine::capture_now(std::uint64_t job_id, std::uint32_t entry, bool wait) {
  check_owner();
  std::vector<std::pair<const std::uint8_t*, std::size_t>> spans;  // (source, bytes) per chunk
  {
    std::lock_guard<std::mutex> lock(mu_);
    Job& job = job_locked(job_id);
    DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
    const Entry& e = job.entries[entry];
    for (const auto& c : e.chunks)
      spans.emplace_back(reinterpret_cast<const std::uint8_t*>(e.src) + c.entry_offset, c.bytes);
  }
  const std::vector<std::size_t> offsets = reserve(job_id, entry, wait);
  if (offsets.size() != spans.size()) return false;  // no room (nothing reserved)
  const double t0 = now_s();
  for (std::size_t i = 0; i < spans.size(); ++i)
    std::memcpy(cache_.data() + offsets[i], spans[i].first, spans[i].second);
  land(job_id, entry, true, "", now_s() - t0);
  return true;
}

std::vector<std::uint8_t> Engine::capture_now_many(std::uint64_t job_id,
                                                   const std::vector<std::uint32_t>& entries) {
  check_owner();
  std::vector<std::uint8_t> taken(entries.size(), 0);
  // Reserve first (each entry that fits now), then copy everything, then land: the copies of a
  // large at-call snapshot are split over up to copy_threads threads (the caller is one of them;
  // it is blocked anyway), since one thread's memcpy does not reach the memory bandwidth. The
  // engine lock is taken three times for the whole batch, not per entry (20,000 tiny tensors).
  struct Span {
    std::uint8_t* dst;
    const std::uint8_t* src;
    std::size_t bytes;
  };
  std::vector<Span> spans;
  std::vector<std::uint32_t> reserved;  // entry ids, in order
  std::vector<std::size_t> first;       // per entry of `entries`: its first chunk in `chunks`
  std::vector<std::pair<const std::uint8_t*, std::size_t>> chunks;  // (source, bytes)
  Job* job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = &job_locked(job_id);
    check_failed_locked(*job);
    first.reserve(entries.size() + 1);
    for (std::uint32_t id : entries) {
      DCPDS_CHECK(id < job->entries.size(), "unknown entry " + std::to_string(id));
      const Entry& e = job->entries[id];
      DCPDS_CHECK(!e.queued && e.device < 0 && !e.direct,
                  "entry '" + e.name + "' cannot be captured by the caller");
      first.push_back(chunks.size());
      for (const auto& c : e.chunks)
        chunks.emplace_back(reinterpret_cast<const std::uint8_t*>(e.src) + c.entry_offset,
                            c.bytes);
    }
    first.push_back(chunks.size());
  }
  // Cache space, entry by entry (the ring has its own lock): an entry that does not fit whole
  // now takes nothing and is left out.
  std::vector<std::size_t> offsets(chunks.size());
  std::vector<std::uint32_t> taken_idx;  // indices into `entries`
  std::size_t total = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::size_t k = first[i];
    for (; k < first[i + 1]; ++k) {
      const std::size_t bytes = chunks[k].second;
      const auto off = ring_.try_allocate(bytes, cache_align(bytes));
      if (!off) break;
      offsets[k] = *off;
    }
    if (k != first[i + 1]) {  // no room now: undo this entry's part
      for (std::size_t j = first[i]; j < k; ++j) ring_.release(offsets[j]);
      continue;
    }
    taken_idx.push_back(static_cast<std::uint32_t>(i));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job->failed.load()) {  // failed meanwhile: give the space back, report
      for (std::uint32_t i : taken_idx)
        for (std::size_t k = first[i]; k < first[i + 1]; ++k) ring_.release(offsets[k]);
      check_failed_locked(*job);
    }
    for (std::uint32_t i : taken_idx) {
      Entry& e = job->entries[entries[i]];
      e.queued = true;
      for (std::size_t c = 0; c < e.chunks.size(); ++c) {
        Chunk& ch = e.chunks[c];
        const std::size_t k = first[i] + c;
        ch.cache_offset = offsets[k];
        ch.state = ChunkState::kCopying;  // held by the caller until landed below
        ++job->uncaptured;
        ++job->outstanding;
        spans.push_back(Span{cache_.data() + offsets[k], chunks[k].first, chunks[k].second});
        total += chunks[k].second;
      }
      reserved.push_back(entries[i]);
      taken[i] = 1;
    }
  }
  const double t0 = now_s();
  constexpr std::size_t kMinPerThread = 32u << 20;  // below this a thread costs more than it saves
  const std::size_t nthreads = std::max<std::size_t>(
      1, std::min<std::size_t>(static_cast<std::size_t>(std::max(1, options_.copy_threads)),
                               total / kMinPerThread));
  // Thread t copies bytes [t * total / n, (t + 1) * total / n) of the concatenated spans.
  auto copy_part = [&](std::size_t t) {
    const std::size_t begin = total * t / nthreads, end = total * (t + 1) / nthreads;
    std::size_t pos = 0;
    for (const Span& s : spans) {
      const std::size_t lo = std::max(begin, pos), hi = std::min(end, pos + s.bytes);
      if (lo < hi) std::memcpy(s.dst + (lo - pos), s.src + (lo - pos), hi - lo);
      pos += s.bytes;
      if (pos >= end) break;
    }
  };
  std::vector<std::thread> helpers;
  try {
    for (std::size_t t = 1; t < nthreads; ++t) helpers.emplace_back(copy_part, t);
  } catch (const std::system_error&) {
    // No thread to be had: the caller copies those parts itself below.
  }
  copy_part(0);
  for (std::size_t t = helpers.size() + 1; t < nthreads; ++t) copy_part(t);
  for (auto& h : helpers) h.join();
  const double busy = now_s() - t0;
  std::lock_guard<std::mutex> lock(mu_);
  job->stats.copy_busy_s += busy;
  for (std::uint32_t id : reserved) land_locked(*job, id, true, "");
  maybe_finalize_locked(*job);
  state_cv_.notify_all();
  return taken;
}

void Engine::retarget(std::uint64_t job_id, std::uint32_t entry, std::uintptr_t src, bool direct) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  Entry& e = job.entries[entry];
  DCPDS_CHECK(!e.queued && e.device < 0, "entry '" + e.name + "' has already started");
  DCPDS_CHECK(e.bytes == 0 || src != 0, "entry '" + e.name + "' retargeted to a null address");
  e.src = src;
  e.direct = direct;
}

// ------------------------------------------------------------------------------------------------
// Stage 2: capture (copy threads)

void Engine::maybe_delay(bool copy) {
  int max_us;
  std::uint64_t r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_us = copy ? copy_delay_us_ : flush_delay_us_;
    if (max_us <= 0) return;
    r = rng_();
  }
  std::this_thread::sleep_for(std::chrono::microseconds(r % static_cast<std::uint64_t>(max_us)));
}

void Engine::do_copy(const Entry& e, const Chunk& c, std::uint8_t* dst, std::uint32_t* crc,
                     bool* crc_valid) {
  // Copy (and checksum block by block while each block is in the CPU cache, so the flush need
  // not read the chunk again). The source may have been freed since the save call: that is an
  // error of this copy, not a crash (guarded_copy.hpp).
  const auto* src = reinterpret_cast<const std::uint8_t*>(e.src) + c.entry_offset;
  std::uint32_t sum = 0;
  CopyPath path;
  DCPDS_CHECK(checked_copy(dst, src, c.bytes, options_.checksums ? &sum : nullptr, &path),
              "the memory of '" + e.name +
                  "' is no longer readable: its storage was freed or resized after the save "
                  "call, before its copy into the host cache");
  *crc = sum;
  *crc_valid = options_.checksums;
}

bool Engine::pop_copy_locked(CopyTask& task, Job*& job, std::size_t& bytes,
                             std::uint64_t& ticket, int only_device, const Job* only_job) {
  while (!copy_queue_.empty()) {
    const CopyTask front = copy_queue_.front();
    auto it = jobs_.find(front.job);
    if (it != jobs_.end() && only_device != kAnyDevice &&
        it->second->entries[front.entry].device != only_device)
      return false;  // another device's copy (for the helper: left to the copy threads)
    if (only_job != nullptr && (it == jobs_.end() || it->second.get() != only_job)) return false;
    copy_queue_.pop_front();
    if (it == jobs_.end()) continue;
    Chunk& c = it->second->entries[front.entry].chunks[front.chunk];
    if (c.state != ChunkState::kPending) continue;  // skipped or failed meanwhile
    c.state = ChunkState::kCopying;
    task = front;
    job = it->second.get();
    bytes = c.bytes;
    // Tickets are taken in queue order under mu_, so cache space is granted in queue order.
    ticket = ring_.take_ticket();
    return true;
  }
  return false;
}

void Engine::copy_loop(int index) {
  {
    // Registered before the thread lowers its priority: a barrier that boosts from now on sees it
    // (and raises it again if the boost is already on).
    std::lock_guard<std::mutex> lock(boost_mu_);
    copy_tids_.push_back(static_cast<pid_t>(::syscall(SYS_gettid)));
    set_thread_identity(options_, /*flush=*/false, index);
    sched_param param{};
    if (index == 0 && options_.idle_priority &&
        ::sched_getscheduler(copy_tids_.back()) == SCHED_IDLE) {
      // Whether a barrier may raise the copy threads (leaving SCHED_IDLE needs CAP_SYS_NICE or
      // a large enough RLIMIT_NICE): tried once, on this thread, and undone at once.
      boost_available_ = ::sched_setscheduler(copy_tids_.back(), SCHED_OTHER, &param) == 0;
      if (boost_available_) ::sched_setscheduler(copy_tids_.back(), SCHED_IDLE, &param);
    }
    if (boosted_) ::sched_setscheduler(copy_tids_.back(), SCHED_OTHER, &param);  // best effort
  }
  // Per-thread CUDA resources, created on first use, one stream/event per device.
  CudaResources cuda_res;
  int current_device = -1;
  for (;;) {
    CopyTask task{};
    std::uint64_t ticket = 0;
    Job* job = nullptr;
    std::size_t bytes = 0;
    int device = kHostDevice;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || (!paused_ && !copy_queue_.empty()); });
      if (stop_) break;
      if (!pop_copy_locked(task, job, bytes, ticket, kAnyDevice)) continue;
      device = job->entries[task.entry].device;
    }
    if (device >= 0)
      run_cuda_copies(task, job, bytes, ticket, device, cuda_res, current_device);
    else
      run_copy(task, job, bytes, ticket);
  }
  for (auto& kv : cuda_res) {
    cuda_->destroy_event(kv.second.second);
    cuda_->destroy_stream(kv.second.first);
  }
}

void Engine::run_copy(const CopyTask& task, Job* job, std::size_t bytes, std::uint64_t ticket) {
  std::atomic<bool>& failed = job->failed;
  auto off = ring_.allocate_with_ticket(ticket, bytes, cache_align(bytes),
                                        [&] { return failed.load(); });
  std::string error;
  std::uint32_t crc = 0;
  bool crc_valid = false;
  const double t0 = now_s();
  if (off) {
    try {
      std::unique_lock<std::mutex> lock(mu_);
      const Entry e = [&] {  // a copy without the chunk vector would do; entries are small
        const Entry& src = job->entries[task.entry];
        Entry copy;
        copy.name = src.name;
        copy.src = src.src;
        return copy;
      }();
      const Chunk c = job->entries[task.entry].chunks[task.chunk];
      lock.unlock();
      maybe_delay(true);
      do_copy(e, c, cache_.data() + *off, &crc, &crc_valid);
    } catch (const std::exception& ex) {
      error = std::string("copy of '") + job->entries[task.entry].name + "' failed: " + ex.what();
    }
  }
  const double t1 = now_s();
  std::lock_guard<std::mutex> lock(mu_);
  land_copy_locked(task, *job, off, crc, crc_valid, error, t1 - t0);
  state_cv_.notify_all();
}

void Engine::land_copy_locked(const CopyTask& task, Job& job,
                              const std::optional<std::size_t>& off, std::uint32_t crc,
                              bool crc_valid, const std::string& error, double busy_s) {
  Entry& e = job.entries[task.entry];
  Chunk& c = e.chunks[task.chunk];
  job.stats.copy_busy_s += busy_s;
  resolve_copy_locked(job, c);
  if (!off) {
    c.state = ChunkState::kSkipped;  // cancelled: the job failed or the engine stopped
    --job.outstanding;
  } else {
    c.cache_offset = *off;
    c.crc = crc;
    c.crc_valid = crc_valid && error.empty();
    c.state = ChunkState::kLanded;
    if (!error.empty()) fail_locked(job, error);
    if (job.failed.load() || e.placement == Placement::kSkip) {
      if (c.state == ChunkState::kLanded) finish_chunk_locked(job, e, c, ChunkState::kSkipped);
    } else {
      job.stats.bytes_copied += c.bytes;
      if (e.placement == Placement::kFile) {
        c.state = ChunkState::kFlushing;
        enqueue_flush_locked(FlushTask{FlushKind::kChunk, job.id, task.entry, task.chunk});
      }
    }
  }
  maybe_finalize_locked(job);
}

Engine::IssueFailure Engine::issue_staged(const StagedCopies& staged,
                                          CudaRuntime::Stream stream) {
  const std::size_t n = staged.dsts.size();
  if (n >= 2 && cuda_->batch_available()) {
    std::size_t fail = CudaRuntime::kNoIndex;
    try {
      ++cuda_batch_calls_;
      if (cuda_->memcpy_d2h_batch(staged.dsts.data(), staged.srcs.data(), staged.sizes.data(), n,
                                  stream, &fail)) {
        cuda_batch_copies_ += n;
        return {};
      }
      // Refused as a whole (nothing queued; batching is now off): one by one below. Re-issuing
      // would be safe even had some been queued: each copy writes the same bytes to one place.
    } catch (const std::exception& ex) {
      // Some copies of the batch may be queued: none of its cache space may be released before
      // they are done.
      cuda_->try_synchronize_stream(stream);
      return {0, fail < n ? fail : 0, ex.what()};
    }
  }
  for (std::size_t k = 0; k < n; ++k) {
    try {
      ++cuda_copy_calls_;
      cuda_->memcpy_d2h_async(staged.dsts[k], staged.srcs[k], staged.sizes[k], stream);
    } catch (const std::exception& ex) {
      return {k, k, ex.what()};
    }
  }
  return {};
}

void Engine::run_cuda_copies(CopyTask task, Job* job, std::size_t bytes, std::uint64_t ticket,
                             int device, CudaResources& cuda_res, int& current_device) {
  // A copy issued on this thread's stream and not yet waited for.
  struct Issued {
    CopyTask task;
    Job* job;
    std::optional<std::size_t> off;
    std::string error;
  };
  std::vector<Issued> batch;
  StagedCopies staged;
  std::size_t batch_bytes = 0;
  CudaRuntime::Stream stream = nullptr;
  CudaRuntime::Event done = nullptr;
  // The ready event this stream last waited for. Every copy of this call is of one job on one
  // device, and a job's events stay alive and are recorded once: a stream that waited for one
  // needs no second wait (what is queued on it later runs after that point anyway).
  std::uintptr_t waited = 0;
  double t0 = now_s();

  // Hands the staged copies to the runtime. A failure fails the copy the runtime named (the
  // first of a batch call that named none) and every staged copy after the first not surely
  // issued, each with that copy's error: none of them is landed as copied.
  auto submit = [&] {
    if (staged.dsts.empty()) return;
    const IssueFailure f = issue_staged(staged, stream);
    if (f.from != IssueFailure::kAllIssued) {
      Issued& named = batch[staged.index[f.named]];
      std::string error;
      {
        std::lock_guard<std::mutex> lock(mu_);
        error = "copy of '" + named.job->entries[named.task.entry].name + "' failed: " + f.error;
      }
      named.error = error;
      for (std::size_t k = f.from; k < staged.index.size(); ++k)
        if (batch[staged.index[k]].error.empty()) batch[staged.index[k]].error = error;
    }
    staged.clear();
  };

  // Waits for every copy of the batch (one event after the last), then lands them all. A failed
  // wait fails every chunk of the batch; the stream is drained first, so no copy can still land
  // in cache space that is released.
  auto complete = [&] {
    submit();
    std::string wait_error;
    const bool issued = std::any_of(batch.begin(), batch.end(), [](const Issued& i) {
      return i.off && i.error.empty();
    });
    if (issued) {
      try {
        cuda_->record_event(done, stream);
        cuda_->synchronize_event(done);
      } catch (const std::exception& ex) {
        cuda_->try_synchronize_stream(stream);
        wait_error = ex.what();
      }
    }
    const double t1 = now_s();
    const double busy = (t1 - t0) / static_cast<double>(batch.empty() ? 1 : batch.size());
    std::lock_guard<std::mutex> lock(mu_);
    // The failed copy first: the job's error names it, not a copy staged before it.
    std::stable_partition(batch.begin(), batch.end(),
                          [](const Issued& i) { return !i.error.empty(); });
    for (const Issued& i : batch) {
      std::string error = i.error;
      if (error.empty() && i.off && !wait_error.empty())
        error = "copy of '" + i.job->entries[i.task.entry].name + "' failed: " + wait_error;
      land_copy_locked(i.task, *i.job, i.off, 0, false, error, busy);
    }
    state_cv_.notify_all();
    batch.clear();
    batch_bytes = 0;
    t0 = t1;
  };

  for (;;) {
    // Cache space, in ticket order: waited for only while no copy of this thread is unlanded.
    std::atomic<bool>& failed = job->failed;
    std::optional<std::size_t> off;
    if (!batch.empty()) off = ring_.try_allocate_with_ticket(ticket, bytes, cache_align(bytes));
    if (!off) {
      if (!batch.empty()) complete();
      off = ring_.allocate_with_ticket(ticket, bytes, cache_align(bytes),
                                       [&] { return failed.load(); });
    }
    Issued cur{task, job, off, {}};
    if (off) {
      try {
        std::unique_lock<std::mutex> lock(mu_);
        const Entry& src = job->entries[task.entry];
        const std::string name = src.name;  // entries may grow (and move) once unlocked
        const auto* from = reinterpret_cast<const std::uint8_t*>(src.src) +
                           src.chunks[task.chunk].entry_offset;
        const std::uintptr_t ready = src.ready_event;
        const std::size_t n = src.chunks[task.chunk].bytes;
        lock.unlock();
        try {
          if (stream == nullptr) {
            auto rit = cuda_res.find(device);
            if (rit == cuda_res.end()) {
              current_device = -1;  // unknown until create_copy_resources' set_device succeeds
              rit = cuda_res.emplace(device, create_copy_resources(*cuda_, device)).first;
              current_device = device;
            }
            stream = rit->second.first;
            done = rit->second.second;
          }
          if (current_device != device) {
            cuda_->set_device(device);
            current_device = device;
          }
          maybe_delay(true);
          // Ordered after the producer's work: the event was recorded on the compute stream at
          // the save call, so the bytes copied are the ones of that moment. Copies staged
          // before are issued first: they must not wait for a later event.
          if (ready != 0 && ready != waited) {
            submit();
            cuda_->stream_wait_event(stream, reinterpret_cast<CudaRuntime::Event>(ready));
            waited = ready;
          }
          staged.index.push_back(batch.size());
          staged.dsts.push_back(cache_.data() + *off);
          staged.srcs.push_back(const_cast<std::uint8_t*>(from));
          staged.sizes.push_back(n);
          batch_bytes += n;
        } catch (const std::exception& ex) {
          cur.error = "copy of '" + name + "' failed: " + ex.what();
        }
      } catch (const std::exception& ex) {
        cur.error = std::string("copy failed: ") + ex.what();
      }
    }
    const bool stop_here = !off || !cur.error.empty();
    batch.push_back(std::move(cur));
    if (stop_here || batch.size() >= kMaxCudaBatch ||
        (batch.size() >= kMaxCudaLargeBatch && batch_bytes >= kCudaBatchBytes))
      break;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_ || paused_ || !pop_copy_locked(task, job, bytes, ticket, device, job)) break;
    }
  }
  complete();
}

// ------------------------------------------------------------------------------------------------
// Stage 3: place

std::int32_t Engine::open_file(std::uint64_t job_id, const std::string& path,
                               const std::string& anon_dir) {
  check_owner();
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_failed_locked(job_locked(job_id));
  }
  // may throw, naming the path
  auto file = std::make_unique<PosixFile>(path, options_.o_direct, anon_dir,
                                         options_.durable ? kWritebackKickBytes : 0);
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  job.files.push_back(std::move(file));
  return static_cast<std::int32_t>(job.files.size() - 1);
}

int Engine::dup_fd(std::uint64_t job_id, std::int32_t file) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(file >= 0 && static_cast<std::size_t>(file) < job.files.size(),
              "unknown file " + std::to_string(file));
  return job.files[static_cast<std::size_t>(file)]->dup_fd();
}

void Engine::link_file(std::uint64_t job_id, std::int32_t file) {
  check_owner();
  PosixFile* f = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Job& job = job_locked(job_id);
    check_failed_locked(job);
    DCPDS_CHECK(file >= 0 && static_cast<std::size_t>(file) < job.files.size(),
                "unknown file " + std::to_string(file));
    f = job.files[static_cast<std::size_t>(file)].get();
  }
  f->link();  // outside the lock (a system call); the file is closed only after seal()
}

void Engine::place(std::uint64_t job_id, std::uint32_t entry, std::int32_t file,
                   std::uint64_t payload_offset, const std::string& header,
                   const std::string& trailer) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  DCPDS_CHECK(file >= 0 && static_cast<std::size_t>(file) < job.files.size(),
              "unknown file " + std::to_string(file));
  Entry& e = job.entries[entry];
  DCPDS_CHECK(e.placement == Placement::kNone, "entry '" + e.name + "' is placed twice");
  DCPDS_CHECK(header.size() <= payload_offset, "header of '" + e.name + "' overlaps the file start");
  e.placement = Placement::kFile;
  e.file = file;
  e.payload_offset = payload_offset;
  auto intern = [&job](const std::string& bytes) {
    auto it = job.interned.find(bytes);
    if (it == job.interned.end())
      it = job.interned.emplace(bytes, std::make_shared<const std::string>(bytes)).first;
    return it->second;
  };
  e.header = intern(header);
  e.trailer = intern(trailer);
  if (e.chunks.empty()) {
    // A zero-size payload: only the header and trailer are written.
    job.raws.push_back(
        RawWrite{file, payload_offset - header.size(), header + trailer, e.name});
    ++job.outstanding;
    enqueue_flush_locked(FlushTask{FlushKind::kRaw, job_id, 0,
                                   static_cast<std::uint32_t>(job.raws.size() - 1)});
    return;
  }
  for (std::uint32_t ci = 0; ci < e.chunks.size(); ++ci) {
    if (e.chunks[ci].state == ChunkState::kLanded) {
      e.chunks[ci].state = ChunkState::kFlushing;
      enqueue_flush_locked(FlushTask{FlushKind::kChunk, job_id, entry, ci});
    }
  }
}

void Engine::place_external(std::uint64_t job_id, std::uint32_t entry) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  Entry& e = job.entries[entry];
  DCPDS_CHECK(e.placement == Placement::kNone, "entry '" + e.name + "' is placed twice");
  e.placement = Placement::kExternal;
}

void Engine::skip(std::uint64_t job_id, std::uint32_t entry) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  Entry& e = job.entries[entry];
  if (e.placement == Placement::kSkip) return;
  DCPDS_CHECK(e.placement == Placement::kNone, "entry '" + e.name + "' is already placed");
  e.placement = Placement::kSkip;
  drop_chunks_locked(job, e);
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

void Engine::write_bytes(std::uint64_t job_id, std::int32_t file, std::uint64_t offset,
                         const std::string& data, const std::string& name) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  DCPDS_CHECK(!job.sealed, "cannot write to a sealed save");
  DCPDS_CHECK(file >= 0 && static_cast<std::size_t>(file) < job.files.size(),
              "unknown file " + std::to_string(file));
  job.raws.push_back(RawWrite{file, offset, data, name});
  ++job.outstanding;
  enqueue_flush_locked(
      FlushTask{FlushKind::kRaw, job_id, 0, static_cast<std::uint32_t>(job.raws.size() - 1)});
}

void Engine::seal(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  check_failed_locked(job);
  if (job.sealed) return;
  for (const Entry& e : job.entries) {
    // Placed in a file but never started: sealing would skip it and leave a hole in the file
    // that the manifest describes as written. A caller bug; refuse before changing anything.
    DCPDS_CHECK(e.queued || e.placement != Placement::kFile,
                "entry '" + e.name + "' was placed in a file but its copy was never started "
                "(start_copies) before seal");
  }
  for (std::uint32_t ei = 0; ei < job.entries.size(); ++ei) {
    Entry& e = job.entries[ei];
    if (!e.queued) {
      e.queued = true;  // never started: nothing to copy
      e.placement = Placement::kSkip;
      for (auto& c : e.chunks) c.state = ChunkState::kSkipped;
    } else if (e.placement == Placement::kNone) {
      e.placement = Placement::kSkip;
      drop_chunks_locked(job, e);
    }
  }
  job.sealed = true;
  // A job with nothing left to copy is captured once sealed: also one that never had an entry
  // queued (a dcp.save whose plan has no tensor item on this rank), which start_copies never saw.
  job.started = true;  // nothing more will be queued
  if (job.uncaptured == 0 && !job.captured) {
    job.captured = true;
    job.stats.captured_s = now_s();
  }
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

// ------------------------------------------------------------------------------------------------
// External consumers

std::uint32_t Engine::chunk_count(std::uint64_t job_id, std::uint32_t entry) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size(), "unknown entry " + std::to_string(entry));
  return static_cast<std::uint32_t>(job.entries[entry].chunks.size());
}

std::pair<std::size_t, std::size_t> Engine::wait_chunk(std::uint64_t job_id, std::uint32_t entry,
                                                       std::uint32_t chunk) {
  check_owner();
  std::unique_lock<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size() && chunk < job.entries[entry].chunks.size(),
              "unknown chunk");
  DCPDS_CHECK(job.entries[entry].placement == Placement::kExternal,
              "entry '" + job.entries[entry].name + "' is not placed for an external consumer");
  state_cv_.wait(lock, [&] {
    const auto s = job.entries[entry].chunks[chunk].state;
    return job.failed.load() || s == ChunkState::kLanded || s == ChunkState::kDone ||
           s == ChunkState::kSkipped;
  });
  check_failed_locked(job);
  const Chunk& c = job.entries[entry].chunks[chunk];
  DCPDS_CHECK(c.state == ChunkState::kLanded, "chunk of '" + job.entries[entry].name +
                                                  "' was already released");
  return {reinterpret_cast<std::size_t>(chunk_data(job.entries[entry], c)), c.bytes};
}

void Engine::release_chunk(std::uint64_t job_id, std::uint32_t entry, std::uint32_t chunk) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  DCPDS_CHECK(entry < job.entries.size() && chunk < job.entries[entry].chunks.size(),
              "unknown chunk");
  Entry& e = job.entries[entry];
  Chunk& c = e.chunks[chunk];
  if (c.state != ChunkState::kLanded) return;  // already dropped by a failure
  job.stats.bytes_written += c.bytes;
  finish_chunk_locked(job, e, c, ChunkState::kDone);
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

// ------------------------------------------------------------------------------------------------
// Stages 4 and 5: flush and finalize (flush threads)

void Engine::do_flush_chunk(Job& job, std::uint32_t entry, std::uint32_t chunk) {
  PosixFile* file;
  std::uint8_t* data;
  std::size_t bytes;
  std::uint64_t offset;
  std::shared_ptr<const std::string> header, trailer;
  std::string name;
  std::uint32_t crc = 0;
  bool have_crc = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = job.entries[entry];
    Chunk& c = e.chunks[chunk];
    crc = c.crc;
    have_crc = c.crc_valid;
    if (job.failed.load()) {
      finish_chunk_locked(job, e, c, ChunkState::kSkipped);
      maybe_finalize_locked(job);
      return;
    }
    file = job.files[e.file].get();
    data = chunk_data(e, c);
    bytes = c.bytes;
    offset = e.payload_offset + c.entry_offset;
    if (chunk == 0) header = e.header;
    if (chunk + 1 == e.chunks.size()) trailer = e.trailer;
    name = e.name;
  }
  std::string error;
  const double t0 = now_s();
  try {
    maybe_delay(false);
    if (options_.checksums && !have_crc) crc = crc32c(0, data, bytes);
    // No function-local static here (nor anywhere on an engine thread): the first use of one
    // with a destructor registers it under glibc's atexit lock, and a fork() by the Python
    // thread at that moment leaves the child (a DataLoader worker) deadlocked on that lock.
    const std::size_t head_n = header ? header->size() : 0;
    const std::size_t tail_n = trailer ? trailer->size() : 0;
    // iovec wants non-const pointers; pwritev only reads them.
    auto* head_p = head_n ? const_cast<char*>(header->data()) : nullptr;
    auto* tail_p = tail_n ? const_cast<char*>(trailer->data()) : nullptr;
    if (file->direct_enabled() && bytes >= PosixFile::kDirectMinBytes) {
      if (head_n) file->write_at(offset - head_n, {iovec{head_p, head_n}});
      file->write_payload_at(offset, data, bytes);
      if (tail_n) file->write_at(offset + bytes, {iovec{tail_p, tail_n}});
    } else {  // buffered anyway (small payload, or no O_DIRECT): one pwritev
      file->write_at(offset - head_n, {iovec{head_p, head_n}, iovec{data, bytes},
                                       iovec{tail_p, tail_n}});
    }
  } catch (const std::exception& ex) {
    error = "flush of '" + name + "' failed: " + ex.what();
  }
  const double t1 = now_s();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = job.entries[entry];
  Chunk& c = e.chunks[chunk];
  c.crc = crc;
  job.stats.flush_busy_s += t1 - t0;
  ++job.stats.flush_writes;
  if (error.empty()) job.stats.bytes_written += bytes;
  finish_chunk_locked(job, e, c, error.empty() ? ChunkState::kDone : ChunkState::kSkipped);
  if (!error.empty()) fail_locked(job, error);
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

std::vector<std::uint32_t> Engine::take_run_locked(Job& job, std::uint32_t lead) {
  std::vector<std::uint32_t> run{lead};
  const Entry& first = job.entries[lead];
  std::uint64_t end = item_end(first);
  std::size_t total = first.bytes;
  const std::size_t window = std::min(flush_queue_.size(), kCombineScan);
  std::vector<bool> taken(window, false);
  std::size_t n_taken = 0;
  for (std::size_t i = 0; i < window; ++i) {
    if (total >= kCombineBytes || run.size() >= kCombineItems) break;
    const FlushTask& t = flush_queue_[i];
    if (t.kind != FlushKind::kChunk || t.job != job.id || t.chunk != 0) continue;
    const Entry& e = job.entries[t.entry];
    if (!combinable(e) || e.file != first.file) continue;
    // Only the item that starts where the run ends: nothing lies between them, so the run never
    // writes a byte that is not its own (a gap may hold bytes written by someone else). Items
    // come roughly in file order; one found later than its successor in the queue simply
    // starts a run of its own.
    if (item_start(e) != end) continue;
    taken[i] = true;
    ++n_taken;
    run.push_back(t.entry);
    end = item_end(e);
    total += e.bytes;
  }
  if (n_taken > 0) {  // the taken tasks leave the queue (one pass over the window)
    std::size_t w = 0;
    for (std::size_t i = 0; i < window; ++i)
      if (!taken[i]) flush_queue_[w++] = flush_queue_[i];
    flush_queue_.erase(flush_queue_.begin() + static_cast<std::ptrdiff_t>(w),
                       flush_queue_.begin() + static_cast<std::ptrdiff_t>(window));
  }
  return run;
}

void Engine::do_flush_run(Job& job, std::uint32_t lead) {
  struct Piece {
    std::uint32_t entry;
    std::uint8_t* data;
    std::size_t bytes;
    std::uint64_t start;  // file offset of its header
    std::shared_ptr<const std::string> header, trailer;
    std::uint32_t crc;
    bool have_crc;
  };
  std::vector<Piece> pieces;
  PosixFile* file = nullptr;
  std::string name;
  maybe_delay(false);  // test hook: before the run is taken (what queued meanwhile joins it)
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::vector<std::uint32_t> run = take_run_locked(job, lead);
    if (job.failed.load()) {
      for (std::uint32_t ei : run)
        finish_chunk_locked(job, job.entries[ei], job.entries[ei].chunks[0], ChunkState::kSkipped);
      maybe_finalize_locked(job);
      state_cv_.notify_all();
      return;
    }
    pieces.reserve(run.size());
    for (std::uint32_t ei : run) {
      Entry& e = job.entries[ei];
      const Chunk& c = e.chunks[0];
      pieces.push_back(Piece{ei, chunk_data(e, c), c.bytes, item_start(e), e.header, e.trailer,
                             c.crc, c.crc_valid});
    }
    file = job.files[job.entries[lead].file].get();
    name = job.entries[lead].name;
  }
  std::string error;
  const double t0 = now_s();
  try {
    std::vector<iovec> iov;
    iov.reserve(pieces.size() * 3);
    for (Piece& p : pieces) {  // back to back in the file (take_run_locked)
      if (options_.checksums && !p.have_crc) p.crc = crc32c(0, p.data, p.bytes);
      // iovec wants non-const pointers; pwritev only reads them.
      if (p.header) iov.push_back(iovec{const_cast<char*>(p.header->data()), p.header->size()});
      iov.push_back(iovec{p.data, p.bytes});
      if (p.trailer) iov.push_back(iovec{const_cast<char*>(p.trailer->data()), p.trailer->size()});
    }
    file->write_at(pieces.front().start, iov);
  } catch (const std::exception& ex) {
    error = "flush of '" + name + "'" +
            (pieces.size() > 1 ? " (and " + std::to_string(pieces.size() - 1) +
                                     " more items written with it)"
                               : std::string()) +
            " failed: " + ex.what();
  }
  const double t1 = now_s();
  std::lock_guard<std::mutex> lock(mu_);
  job.stats.flush_busy_s += t1 - t0;
  ++job.stats.flush_writes;
  for (const Piece& p : pieces) {
    Entry& e = job.entries[p.entry];
    Chunk& c = e.chunks[0];
    c.crc = p.crc;
    if (error.empty()) job.stats.bytes_written += p.bytes;
    finish_chunk_locked(job, e, c, error.empty() ? ChunkState::kDone : ChunkState::kSkipped);
  }
  if (!error.empty()) fail_locked(job, error);
  maybe_finalize_locked(job);
  state_cv_.notify_all();
}

void Engine::do_finalize(Job& job) {
  std::vector<PosixFile*> files;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& f : job.files) files.push_back(f.get());
  }
  std::string error;
  try {
    for (PosixFile* f : files) {
      if (options_.durable) f->sync();
      f->close();
    }
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error.empty()) fail_locked(job, error);
  for (auto& f : job.files) f->close();
  job.finalizing = false;
  job.done = true;
  job.stats.done_s = now_s();
  state_cv_.notify_all();
}

void Engine::flush_loop(int index) {
  set_thread_identity(options_, /*flush=*/true, index);  // this thread only; best effort
  for (;;) {
    FlushTask task{};
    Job* job = nullptr;
    bool run = false;  // a kChunk task that leads a combined write (do_flush_run)
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !flush_queue_.empty(); });
      if (stop_ && flush_queue_.empty()) break;
      task = flush_queue_.front();
      flush_queue_.pop_front();
      auto it = jobs_.find(task.job);
      if (it == jobs_.end()) continue;
      job = it->second.get();
      run = task.kind == FlushKind::kChunk && task.chunk == 0 &&
            combinable(job->entries[task.entry]);
    }
    switch (task.kind) {
      case FlushKind::kChunk:
        if (run) {
          do_flush_run(*job, task.entry);
        } else {
          do_flush_chunk(*job, task.entry, task.chunk);
        }
        break;
      case FlushKind::kFinalize:
        do_finalize(*job);
        break;
      case FlushKind::kRaw: {
        PosixFile* file;
        std::uint64_t offset;
        std::string bytes, name;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (job->failed.load()) {
            --job->outstanding;
            maybe_finalize_locked(*job);
            break;
          }
          const RawWrite& w = job->raws[task.chunk];
          file = job->files[w.file].get();
          offset = w.offset;
          bytes = w.data;
          name = w.name;
        }
        std::string error;
        try {
          file->write_at(offset, {iovec{bytes.data(), bytes.size()}});
        } catch (const std::exception& ex) {
          error = name.empty() ? std::string(ex.what())
                               : "flush of '" + name + "' failed: " + ex.what();
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (error.empty()) job->stats.bytes_written += bytes.size();
        ++job->stats.flush_writes;
        --job->outstanding;
        if (!error.empty()) fail_locked(*job, error);
        maybe_finalize_locked(*job);
        state_cv_.notify_all();
        break;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Waiting and results

bool Engine::wait_job(std::uint64_t job_id, double timeout_s, bool until_done) {
  check_owner();
  std::unique_lock<std::mutex> lock(mu_);
  Job& job = job_locked(job_id);
  // A failed job counts as captured only once no copy of it is in flight, so that the caller may
  // free its sources and ready events as soon as this returns, whatever the outcome.
  auto ready = [&] {
    return until_done ? job.done : (job.captured || (job.failed.load() && job.uncaptured == 0));
  };
  if (timeout_s < 0) {
    state_cv_.wait(lock, ready);
  } else if (!state_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
    return false;
  }
  check_failed_locked(job);
  return true;
}

void Engine::boost_copy_threads(bool up) {
  if (!options_.idle_priority) return;
  std::lock_guard<std::mutex> lock(boost_mu_);
  if (up ? boost_depth_++ > 0 : --boost_depth_ > 0) return;
  if (up) {
    ++boosts_;
    bool refused = false;
    sched_param param{};
    for (pid_t tid : copy_tids_)
      if (::sched_setscheduler(tid, SCHED_OTHER, &param) != 0) refused = true;
    boosted_ = !refused;
    if (refused) {
      ++boost_refused_;
      for (pid_t tid : copy_tids_) ::sched_setscheduler(tid, SCHED_IDLE, &param);
    }
  } else if (boosted_) {
    sched_param param{};
    for (pid_t tid : copy_tids_) ::sched_setscheduler(tid, SCHED_IDLE, &param);  // always allowed
    boosted_ = false;
  }
}

bool Engine::help_until_captured(std::uint64_t job_id, double timeout_s) {
  check_owner();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Job& waited = job_locked(job_id);
    if (waited.captured || (waited.failed.load() && waited.uncaptured == 0)) {
      check_failed_locked(waited);
      return true;
    }
  }
  boost_copy_threads(true);
  struct Unboost {
    Engine* e;
    ~Unboost() { e->boost_copy_threads(false); }
  } unboost{this};
  using clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0;
  const auto deadline =
      forever ? clock::time_point::max()
              : clock::now() + std::chrono::duration_cast<clock::duration>(
                                   std::chrono::duration<double>(timeout_s));
  for (;;) {
    CopyTask task{};
    Job* job = nullptr;
    std::size_t bytes = 0;
    std::uint64_t ticket = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      Job& waited = job_locked(job_id);
      if (waited.captured || (waited.failed.load() && waited.uncaptured == 0)) {
        check_failed_locked(waited);
        return true;
      }
      if (stop_ || paused_ || !pop_copy_locked(task, job, bytes, ticket, kHostDevice)) {
        // Nothing this thread can take (copies in flight elsewhere, CUDA copies, paused):
        // wait for a landing, looking again at the queue now and then.
        const auto now = clock::now();
        if (!forever && now >= deadline) return false;
        const auto slice = std::chrono::milliseconds(20);
        state_cv_.wait_for(lock, forever ? clock::duration(slice)
                                         : std::min<clock::duration>(slice, deadline - now));
        continue;
      }
      ++helped_copies_;
    }
    run_copy(task, job, bytes, ticket);  // host copies only
  }
}

bool Engine::wait_captured(std::uint64_t job_id, double timeout_s) {
  return wait_job(job_id, timeout_s, false);
}

bool Engine::wait_done(std::uint64_t job_id, double timeout_s) {
  return wait_job(job_id, timeout_s, true);
}

bool Engine::is_captured(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  const Job& job = job_locked(job_id);
  return job.captured || (job.failed.load() && job.uncaptured == 0);
}

bool Engine::is_done(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  return job_locked(job_id).done;
}

void Engine::abort(std::uint64_t job_id, const std::string& reason) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  fail_locked(*it->second, reason);
}

void Engine::forget(std::uint64_t job_id) {
  check_owner();
  std::unique_lock<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  Job& job = *it->second;
  if (!job.done) fail_locked(job, "the save was abandoned");
  // Wait until no worker holds a chunk of this job, then drop it.
  state_cv_.wait(lock, [&] { return job.done; });
  jobs_.erase(job_id);
}

std::vector<ChunkRecord> Engine::chunk_records(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  const Job& job = job_locked(job_id);
  std::vector<ChunkRecord> out;
  for (std::uint32_t ei = 0; ei < job.entries.size(); ++ei) {
    const Entry& e = job.entries[ei];
    if (e.placement != Placement::kFile) continue;
    for (std::uint32_t ci = 0; ci < e.chunks.size(); ++ci) {
      const Chunk& c = e.chunks[ci];
      if (c.state != ChunkState::kDone) continue;
      out.push_back(ChunkRecord{ei, ci, e.file, e.payload_offset + c.entry_offset, c.entry_offset,
                                c.bytes, c.crc});
    }
  }
  return out;
}

JobStats Engine::stats(std::uint64_t job_id) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  return job_locked(job_id).stats;
}

EngineCounters Engine::counters() {
  check_owner();
  std::unique_lock<std::mutex> lock(mu_);
  std::size_t files = 0;
  for (auto& kv : jobs_)
    for (auto& f : kv.second->files) files += f->is_open() ? 1 : 0;
  EngineCounters c{cache_.size(), ring_.used_bytes(), ring_.live_blocks(), jobs_.size(),
                   files, copy_queue_.size(), flush_queue_.size(), helped_copies_, 0, 0, false};
  c.cuda_batch = cuda_ != nullptr && cuda_->batch_available();
  lock.unlock();
  std::lock_guard<std::mutex> boost_lock(boost_mu_);
  c.boosts = boosts_;
  c.boost_refused = boost_refused_;
  c.boost_available = boost_available_;
  c.cuda_copy_calls = cuda_copy_calls_.load();
  c.cuda_batch_calls = cuda_batch_calls_.load();
  c.cuda_batch_copies = cuda_batch_copies_.load();
  return c;
}

void Engine::enable_cuda(const std::string& runtime_path, bool batch_copies) {
  check_owner();
  // cuda_mu_ serializes enable_cuda() calls; mu_ is not held while the runtime loads and the
  // cache is registered (seconds for a large cache), so copies and flushes go on meanwhile.
  std::lock_guard<std::mutex> cuda_lock(cuda_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cuda_ != nullptr) return;
  }
  // throws if it cannot be loaded
  auto rt = std::make_unique<CudaRuntime>(runtime_path, batch_copies);
  std::string pin_error;
  try {
    cache_.pin(*rt);
  } catch (const std::exception& ex) {
    // Not fatal: copies into pageable memory are correct, only slower and synchronous.
    pin_error = ex.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  pin_error_ = pin_error;
  cuda_ = std::move(rt);
}

std::string Engine::pin_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return pin_error_;
}

std::string Engine::cuda_batch_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return cuda_ == nullptr ? "CUDA is not enabled" : cuda_->batch_unavailable_reason();
}

void Engine::pause_copies(bool paused) {
  check_owner();
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = paused;
  }
  work_cv_.notify_all();
}

void Engine::set_delays(int copy_delay_us_max, int flush_delay_us_max, std::uint64_t seed) {
  check_owner();
  std::lock_guard<std::mutex> lock(mu_);
  copy_delay_us_ = copy_delay_us_max;
  flush_delay_us_ = flush_delay_us_max;
  rng_.seed(seed);
}

}  // namespace dcpds
