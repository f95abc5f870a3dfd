// Engine: the native data path of a DataStatesWriter. It owns the host cache, the copy threads
// (source memory -> host cache) and the flush threads (host cache -> files), and knows nothing
// of Python, torch or DCP: it moves bytes between addresses and file offsets it is given.
//
// Stages of one save ("job"), each named where it happens in engine.cpp:
//   1. register  - the caller adds entries (source address, size, device) and starts their copies;
//   2. capture   - copy threads split entries into chunks of at most chunk_bytes, reserve cache
//                  space for each (FIFO, blocking while the cache is full = backpressure) and copy;
//                  a job is *captured* once no chunk is still to be copied: from then on the
//                  engine never reads the sources again;
//   3. place     - the caller tells where each entry goes (file + payload offset, plus header and
//                  trailer bytes written around it), that it is consumed by the caller (external),
//                  or that it is not needed (skip). Placement may come before or after capture;
//   4. flush     - flush threads checksum each landed, placed chunk (CRC-32C), write it, and
//                  release its cache space;
//   5. finalize  - after seal() and once everything is written, data files are fdatasync'ed and
//                  closed; the job is *done*.
//
// Threads: copy_threads + flush_threads native threads, started in the constructor and joined in
// the destructor. They never call back into the caller; the caller waits (wait_captured /
// wait_done). Flush threads run at a lower OS priority so that copies (which the training loop may
// be waiting for) win the CPU.
// Thread-safety: every public method may be called from any thread.
// Lifetimes: a source address must stay valid until the job is captured; a job's bookkeeping is
// kept until forget(). Header/trailer/bytes are copied into the engine.
// Fork: an Engine belongs to the process that created it. In a forked child every public method
// throws EngineError naming the owner pid, without touching a lock; the destructor, run in a child,
// joins nothing and waits on nothing: it leaks the threads' handles, the jobs and the cache
// (abandon_in_child), because the worker threads and their waits exist only in the parent.
// Failures: the first error of a job (an I/O error naming the path, a CUDA error, an abort) is
// latched on the job; its remaining work is dropped, its cache space returned, and wait_captured /
// wait_done throw EngineError with that message. Other jobs are unaffected.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_runtime.hpp"
#include "host_cache.hpp"
#include "posix_file.hpp"
#include "ring_allocator.hpp"

namespace dcpds {

struct EngineOptions {
  std::size_t cache_bytes = 0;
  std::size_t chunk_bytes = 64u << 20;   // largest single copy/write; clamped to cache_bytes
  int copy_threads = 1;
  int flush_threads = 2;
  bool o_direct = false;                 // payloads through O_DIRECT where aligned
  bool prefault = true;                  // touch the cache pages at construction
  bool checksums = true;                 // CRC-32C per chunk
  bool durable = true;                   // fdatasync data files before a job is done
  int flush_nice = 5;                    // added niceness of flush threads (when not idle)
  bool idle_priority = false;            // run copy threads under SCHED_IDLE: they get only CPU
                                         // time no other thread of the machine wants
  bool flush_idle = false;               // flush threads under SCHED_IDLE too (they mostly wait
                                         // for the disk: with O_DIRECT and checksums taken during
                                         // the copy, a flush costs little CPU)
};

struct ChunkRecord {
  std::uint32_t entry;
  std::uint32_t chunk;
  std::int32_t file;          // -1 for external entries
  std::uint64_t file_offset;  // where the chunk's payload bytes start in the file
  std::uint64_t entry_offset; // where the chunk starts inside the entry
  std::uint64_t bytes;
  std::uint32_t crc32c;
};

struct JobStats {
  double created_s = 0;    // steady-clock seconds
  double captured_s = -1;  // -1 while not captured
  double done_s = -1;
  std::uint64_t bytes_total = 0;
  std::uint64_t bytes_copied = 0;
  std::uint64_t bytes_written = 0;
  double copy_busy_s = 0;  // summed over copy threads
  double flush_busy_s = 0;
  // Write operations the flush issued for this job's data: a run of small items written with one
  // pwritev counts once (see Engine::kCombineBytes).
  std::uint64_t flush_writes = 0;
  bool failed = false;
  std::string error;
};

struct EngineCounters {
  std::size_t cache_bytes;
  std::size_t cache_used_bytes;
  std::size_t live_blocks;
  std::size_t jobs;
  std::size_t open_files;
  std::size_t pending_copies;
  std::size_t pending_flushes;
  std::uint64_t helped_copies;  // chunks copied by threads waiting in a barrier (since start)
  // Barriers that raised the idle-priority copy threads to normal priority while they waited
  // (boosts), and those the OS refused (boost_refused: SCHED_IDLE may be left only with
  // CAP_SYS_NICE or a sufficient RLIMIT_NICE; the barrier then copies alone).
  std::uint64_t boosts;
  std::uint64_t boost_refused;
  // The copy threads run under SCHED_IDLE and a barrier may raise them (probed once when the
  // first copy thread starts; false without idle_priority or where the OS refuses).
  bool boost_available;
  // Device-to-host copy calls since start: cudaMemcpyAsync calls (one copy each), and
  // cudaMemcpyBatchAsync calls with the copies they carried (run_cuda_copies).
  std::uint64_t cuda_copy_calls = 0;
  std::uint64_t cuda_batch_calls = 0;
  std::uint64_t cuda_batch_copies = 0;
  bool cuda_batch = false;  // CUDA is enabled and copies are batched (CudaRuntime::batch_available)
};

class Engine {
 public:
  // Buffered bytes per data file between two writeback starts (PosixFile), when durable.
  static constexpr std::uint64_t kWritebackKickBytes = 8ull << 20;

  explicit Engine(const EngineOptions& options);
  ~Engine();  // aborts unfinished jobs, joins threads, frees the cache
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // --- register
  std::uint64_t create_job(const std::string& label);
  // device < 0: host memory; else a CUDA device ordinal and `ready_event` (a cudaEvent_t recorded
  // on the producing stream, or 0) that the copy must wait for. `direct` (host memory only):
  // the source is private to the save and stays valid until the job is done, so it is flushed
  // from where it is, without a copy into the cache. Returns the entry index.
  std::uint32_t add_entry(std::uint64_t job, const std::string& name, std::uintptr_t src,
                          std::size_t bytes, int device, std::uintptr_t ready_event,
                          bool direct = false);
  // add_entry for a whole batch under one lock: entry i is (names[i], srcs[i], bytes[i],
  // devices[i], ready_events[i], direct[i] != 0); all vectors have the same length. Every entry
  // is checked before any is added (all or nothing). Returns the index of the first new entry;
  // the batch's indices are consecutive.
  std::uint32_t add_entries(std::uint64_t job, const std::vector<std::string>& names,
                            const std::vector<std::uintptr_t>& srcs,
                            const std::vector<std::size_t>& bytes, const std::vector<int>& devices,
                            const std::vector<std::uintptr_t>& ready_events,
                            const std::vector<std::uint8_t>& direct);
  void start_copies(std::uint64_t job);  // queues the copies of every entry added so far
  // Caller-side capture (the save call snapshots a host entry itself, e.g. with a parallel copy):
  // reserve() takes cache space for every chunk of a not yet started, non-direct host entry and
  // returns the chunks' cache offsets (chunk order); the caller copies the bytes there and then
  // MUST call land() exactly once for the entry (ok=false fails the job with `error`), or the
  // job can never finish. Without `wait`, reserve() returns an empty vector (nothing reserved)
  // when the cache has no room right now; with `wait` it blocks in FIFO order behind earlier
  // requests until space is released, which only ever happens through other work's flushes:
  // the caller must know that enough space will be freed without this job's own progress.
  // Throws if the job failed or the engine closed meanwhile.
  std::vector<std::size_t> reserve(std::uint64_t job, std::uint32_t entry, bool wait);
  void land(std::uint64_t job, std::uint32_t entry, bool ok, const std::string& error,
            double busy_s);
  // reserve() + a memcpy from the entry's source in the calling thread + land(): snapshots a
  // contiguous host entry at the save call. False (nothing reserved) if !wait and no room now.
  bool capture_now(std::uint64_t job, std::uint32_t entry, bool wait);
  // capture_now(job, e, wait=false) for each entry in order: one call for the many tensors a
  // save takes at the call. Reserves every entry that fits, copies them all (split over up to
  // copy_threads threads, the caller included, when there are at least 32 MiB per thread), then
  // lands them. Returns, per entry, 1 if it was copied into the cache and 0 if there was no room
  // at that moment (nothing reserved for it).
  std::vector<std::uint8_t> capture_now_many(std::uint64_t job,
                                             const std::vector<std::uint32_t>& entries);
  // Points a not yet started entry at another host source; `direct` as in add_entry.
  void retarget(std::uint64_t job, std::uint32_t entry, std::uintptr_t src, bool direct);

  // --- place
  // Creates the data file `path`; with a non-empty `anon_dir`, an unnamed file there instead
  // (PosixFile), for the caller to link under `path` through dup_fd().
  std::int32_t open_file(std::uint64_t job, const std::string& path,
                         const std::string& anon_dir = "");
  // A descriptor of an open data file of the job, owned by the caller (PosixFile::dup_fd).
  int dup_fd(std::uint64_t job, std::int32_t file);
  // Names an unnamed data file of the job (PosixFile::link).
  void link_file(std::uint64_t job, std::int32_t file);
  void place(std::uint64_t job, std::uint32_t entry, std::int32_t file,
             std::uint64_t payload_offset, const std::string& header, const std::string& trailer);
  void place_external(std::uint64_t job, std::uint32_t entry);
  void skip(std::uint64_t job, std::uint32_t entry);
  // `name` (the item written, may be empty) is named in the error if the write fails.
  void write_bytes(std::uint64_t job, std::int32_t file, std::uint64_t offset,
                   const std::string& data, const std::string& name = "");
  void seal(std::uint64_t job);  // placement complete; entries never placed are skipped

  // --- external consumers (the fsspec flush path): chunks in the order they were queued
  std::uint32_t chunk_count(std::uint64_t job, std::uint32_t entry);
  // Waits until the chunk has landed; returns {address of its bytes, bytes}.
  std::pair<std::size_t, std::size_t> wait_chunk(std::uint64_t job, std::uint32_t entry,
                                                 std::uint32_t chunk);
  void release_chunk(std::uint64_t job, std::uint32_t entry, std::uint32_t chunk);

  // --- wait; both throw the job's error. timeout_s < 0 waits forever; false on timeout.
  // wait_captured returns (or throws) only once no copy of the job is in flight, even when the
  // job failed: from then on its sources and ready events may be freed.
  bool wait_captured(std::uint64_t job, double timeout_s);
  // Same as wait_captured, but the calling thread meanwhile runs queued host copies itself (in
  // queue order, like one more copy thread at the caller's priority): a barrier that blocks
  // training anyway makes progress even when the copy threads, under SCHED_IDLE, get no CPU
  // because other processes keep every core busy. CUDA copies are left to the copy threads.
  // While any barrier waits, idle-priority copy threads run at normal priority (see boost_):
  // a chunk an idle-priority thread took before the barrier began would otherwise keep the
  // barrier waiting for as long as the machine's other work starves that thread (priority
  // inversion), and the barrier gets the copy threads' help besides its own.
  bool help_until_captured(std::uint64_t job, double timeout_s);
  bool wait_done(std::uint64_t job, double timeout_s);
  bool is_captured(std::uint64_t job);
  bool is_done(std::uint64_t job);

  void abort(std::uint64_t job, const std::string& reason);
  void forget(std::uint64_t job);  // drops a finished job's bookkeeping (aborts it if unfinished)

  std::vector<ChunkRecord> chunk_records(std::uint64_t job);
  JobStats stats(std::uint64_t job);
  EngineCounters counters();

  // --- memory
  std::uint8_t* cache_data() const { return cache_.data(); }
  std::size_t cache_bytes() const { return cache_.size(); }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  // Loads the CUDA runtime at `runtime_path` (throws EngineError if it cannot) and pins the cache.
  // A failure to pin is not an error: copies then go to pageable memory (correct, slower, each
  // one synchronous); cache_pinned() is false and pin_error() says why. `batch_copies` false:
  // never cudaMemcpyBatchAsync (see CudaRuntime). Idempotent (the first call's arguments hold).
  void enable_cuda(const std::string& runtime_path, bool batch_copies = true);
  bool cuda_enabled() const { return cuda_ != nullptr; }
  bool cache_pinned() const { return cache_.pinned(); }
  std::string pin_error();  // "" when pinned or CUDA is not enabled
  // Why copies are not batched ("" when they are; CudaRuntime::batch_unavailable_reason).
  std::string cuda_batch_error();

  // --- test hooks
  void pause_copies(bool paused);
  void set_delays(int copy_delay_us_max, int flush_delay_us_max, std::uint64_t seed);

 private:
  enum class ChunkState { kPending, kCopying, kLanded, kFlushing, kDone, kSkipped };
  enum class Placement { kNone, kFile, kExternal, kSkip };

  struct Chunk {
    std::size_t entry_offset = 0;
    std::size_t bytes = 0;
    ChunkState state = ChunkState::kPending;
    std::size_t cache_offset = 0;
    std::uint64_t ticket = 0;
    std::uint32_t crc = 0;
    bool crc_valid = false;  // crc was taken while copying (else the flush computes it)
  };
  struct Entry {
    std::string name;
    std::uintptr_t src = 0;
    std::size_t bytes = 0;
    int device = -1;
    std::uintptr_t ready_event = 0;
    bool direct = false;  // flushed from `src`, never copied into the cache
    std::vector<Chunk> chunks;
    bool queued = false;
    Placement placement = Placement::kNone;
    std::int32_t file = -1;
    std::uint64_t payload_offset = 0;
    // The archive bytes around the payload: the same few templates for thousands of entries,
    // so shared (interned per job) instead of 1.5 KB copied into each entry.
    std::shared_ptr<const std::string> header, trailer;
  };
  struct RawWrite {
    std::int32_t file;
    std::uint64_t offset;
    std::string data;
    std::string name;  // the item it belongs to (for errors)
  };
  struct Job {
    std::uint64_t id = 0;
    std::string label;
    std::vector<Entry> entries;
    std::vector<std::unique_ptr<PosixFile>> files;
    std::vector<RawWrite> raws;
    std::unordered_map<std::string, std::shared_ptr<const std::string>> interned;  // see Entry
    bool sealed = false;
    bool started = false;  // start_copies() or seal() ran: captured may be decided
    bool finalizing = false;
    bool captured = false;
    bool done = false;
    std::atomic<bool> failed{false};
    std::string error;
    std::size_t uncaptured = 0;   // chunks queued or copying
    std::size_t outstanding = 0;  // chunks not done/skipped + raw writes not written
    JobStats stats;
  };
  enum class FlushKind { kChunk, kRaw, kFinalize };
  struct FlushTask {
    FlushKind kind;
    std::uint64_t job;
    std::uint32_t entry = 0;   // kChunk
    std::uint32_t chunk = 0;   // kChunk; index into raws for kRaw
  };
  struct CopyTask {
    std::uint64_t job;
    std::uint32_t entry;
    std::uint32_t chunk;
  };

  Job& job_locked(std::uint64_t id);
  void check_entry_locked(const std::string& name, std::uintptr_t src, std::size_t bytes,
                          int device, bool direct) const;
  std::uint32_t add_entry_locked(Job& job, const std::string& name, std::uintptr_t src,
                                 std::size_t bytes, int device, std::uintptr_t ready_event,
                                 bool direct);
  void fail_locked(Job& job, const std::string& message);
  void resolve_copy_locked(Job& job, Chunk& chunk);   // a chunk leaves kPending/kCopying
  void land_locked(Job& job, std::uint32_t entry, bool ok, const std::string& error);
  void finish_chunk_locked(Job& job, Entry& entry, Chunk& chunk, ChunkState to);  // leaves cache
  std::uint8_t* chunk_data(const Entry& e, const Chunk& c) const;
  void drop_chunks_locked(Job& job, Entry& e);  // pending and landed chunks leave the job
  void maybe_finalize_locked(Job& job);
  void enqueue_flush_locked(const FlushTask& t);
  void check_failed_locked(const Job& job) const;
  bool wait_job(std::uint64_t job, double timeout_s, bool until_done);

  using CudaResources = std::map<int, std::pair<CudaRuntime::Stream, CudaRuntime::Event>>;
  void copy_loop(int index);
  // Barrier boost: the first waiter raises every copy thread from SCHED_IDLE to SCHED_OTHER, the
  // last one lowers them again (boost_mu_ only; never under mu_). A no-op without idle_priority.
  void boost_copy_threads(bool up);
  std::mutex boost_mu_;
  int boost_depth_ = 0;              // barriers waiting now (boost_mu_)
  bool boosted_ = false;             // the copy threads run at normal priority (boost_mu_)
  std::vector<pid_t> copy_tids_;     // kernel thread ids of the copy threads (boost_mu_)
  std::uint64_t boosts_ = 0, boost_refused_ = 0;  // (boost_mu_)
  bool boost_available_ = false;                   // (boost_mu_)
  std::uint64_t helped_copies_ = 0;  // under mu_
  // pop_copy_locked's filter: any task, host copies only (kHostDevice), or one CUDA device.
  static constexpr int kAnyDevice = -2;
  static constexpr int kHostDevice = -1;
  // Most CUDA chunks one copy thread issues before it waits for them (run_cuda_copies): up to
  // kMaxCudaBatch, and past kMaxCudaLargeBatch only while the batch holds under
  // kCudaBatchBytes (small tensors: fewer waits, fewer batch calls; large chunks: cache space is
  // not held unlanded for long).
  static constexpr std::size_t kMaxCudaBatch = 256;
  static constexpr std::size_t kMaxCudaLargeBatch = 32;
  static constexpr std::size_t kCudaBatchBytes = 8u << 20;
  // Copies of one batch staged for the runtime but not yet issued (run_cuda_copies).
  struct StagedCopies {
    std::vector<std::size_t> index;  // position in the batch
    std::vector<void*> dsts;
    std::vector<void*> srcs;  // read only (the runtime's prototype is not const)
    std::vector<std::size_t> sizes;
    void clear() {
      index.clear();
      dsts.clear();
      srcs.clear();
      sizes.clear();
    }
  };
  // What issue_staged() could not issue: staged copies `from`.. were not (or not surely) issued,
  // `named` is the one the error is about; from == kAllIssued on success.
  struct IssueFailure {
    static constexpr std::size_t kAllIssued = ~std::size_t{0};
    std::size_t from = kAllIssued;
    std::size_t named = 0;
    std::string error;
  };
  // Issues the staged copies on `stream`: one cudaMemcpyBatchAsync where the runtime has it (two
  // or more copies), else (or after the runtime refused the batch call) one cudaMemcpyAsync
  // each. A failed batch call fails all its copies (from = 0, named = the copy the runtime
  // named, else the first), after draining the stream: some may have been queued.
  IssueFailure issue_staged(const StagedCopies& staged, CudaRuntime::Stream stream);
  std::atomic<std::uint64_t> cuda_copy_calls_{0}, cuda_batch_calls_{0}, cuda_batch_copies_{0};
  // Pops the first copy task whose chunk is still pending (under mu_), marks it kCopying and
  // takes its cache ticket. With a device filter, stops (returns false) at a task of another
  // device (kHostDevice: at a CUDA task); with only_job, at a task of another job.
  bool pop_copy_locked(CopyTask& task, Job*& job, std::size_t& bytes, std::uint64_t& ticket,
                       int only_device, const Job* only_job = nullptr);
  // Runs one popped host task: reserves cache space (in ticket order), copies, lands the chunk.
  void run_copy(const CopyTask& task, Job* job, std::size_t bytes, std::uint64_t ticket);
  // Runs a popped CUDA task and the tasks of its job and device queued right behind it: issues up
  // to kMaxCudaBatch copies on this thread's stream (staged, then handed to the runtime at once by
  // issue_staged: before the stream waits for another ready event, and before the wait), then
  // waits once for all of them (one event), instead of a wait per chunk. Cache space for a further chunk is only taken if it is
  // free at once; otherwise the issued copies are waited for and landed first, so a thread
  // never waits for space while holding cache space it has not landed. Never across jobs: a job
  // whose copies are ready must not wait for another's (held by its compute stream).
  void run_cuda_copies(CopyTask task, Job* job, std::size_t bytes, std::uint64_t ticket,
                       int device, CudaResources& cuda_res, int& current_device);
  // Lands (or fails, or skips) one chunk after its copy (under mu_).
  void land_copy_locked(const CopyTask& task, Job& job, const std::optional<std::size_t>& off,
                        std::uint32_t crc, bool crc_valid, const std::string& error,
                        double busy_s);
  void flush_loop(int index);
  // Copies one chunk of a host source into the cache; with checksums on, also returns its CRC
  // (computed block by block while the bytes are still in the CPU cache) and sets *crc_valid.
  void do_copy(const Entry& e, const Chunk& c, std::uint8_t* dst, std::uint32_t* crc,
               bool* crc_valid);
  void do_flush_chunk(Job& job, std::uint32_t entry, std::uint32_t chunk);
  // Write combining of small items: an item of one chunk under PosixFile::kDirectMinBytes (written
  // through the page cache anyway) is written together with the queued items that follow it
  // back to back in the same file (FileLayout packs such items without padding), up to
  // kCombineBytes in one pwritev: thousands of 64 KiB tensors cost a few dozen system calls,
  // not thousands. Only what is queued when a flush thread takes the lead joins its run (no
  // waiting for more). Tasks taken into a run leave the queue at once, so no other flush thread
  // sees them; each item's chunk still finishes (done, or skipped on a failure) on its own, and
  // a failed write fails the job naming the run's first item.
  static constexpr std::size_t kCombineBytes = 2u << 20;
  static constexpr std::size_t kCombineScan = 512;  // queued tasks looked at for one run
  static constexpr std::size_t kCombineItems = 256;
  bool combinable(const Entry& e) const {
    return e.chunks.size() == 1 && e.bytes < PosixFile::kDirectMinBytes &&
           e.placement == Placement::kFile && e.file >= 0;
  }
  // File extent of a placed entry: its header, payload and trailer.
  static std::uint64_t item_start(const Entry& e) {
    return e.payload_offset - (e.header ? e.header->size() : 0);
  }
  static std::uint64_t item_end(const Entry& e) {
    return e.payload_offset + e.bytes + (e.trailer ? e.trailer->size() : 0);
  }
  // Under mu_: the entries of the run `lead` starts (lead first); their tasks leave the queue.
  std::vector<std::uint32_t> take_run_locked(Job& job, std::uint32_t lead);
  void do_flush_run(Job& job, std::uint32_t lead);
  void do_finalize(Job& job);
  void maybe_delay(bool copy);
  bool is_owner() const;
  void check_owner() const;          // throws EngineError in a forked child
  void abandon_in_child() noexcept;  // the destructor's path in a forked child

  const pid_t owner_pid_;  // the process that created the engine (and its threads)
  const EngineOptions options_;
  const std::size_t chunk_bytes_;
  const std::size_t align_;
  // Cache alignment of a chunk: O_DIRECT's for chunks the flush may write direct, 64 bytes for
  // smaller ones (written through the page cache anyway): 20,000 tiny tensors then touch 1.3 MB
  // of cache instead of 80 MB.
  std::size_t cache_align(std::size_t bytes) const {
    return bytes >= PosixFile::kDirectMinBytes ? align_ : std::min<std::size_t>(align_, 64);
  }
  std::mutex cuda_mu_;                 // serializes enable_cuda()
  std::unique_ptr<CudaRuntime> cuda_;  // declared first: the pinned cache unregisters through it
  std::string pin_error_;              // why the cache is not pinned (guarded by mu_)
  HostCache cache_;
  RingAllocator ring_;

  std::mutex mu_;
  std::condition_variable work_cv_;   // copy/flush queues changed, or stop
  std::condition_variable state_cv_;  // job progress (captured, landed, done)
  std::map<std::uint64_t, std::unique_ptr<Job>> jobs_;
  std::uint64_t next_job_ = 1;
  std::deque<CopyTask> copy_queue_;
  std::deque<FlushTask> flush_queue_;
  bool stop_ = false;
  bool paused_ = false;
  int copy_delay_us_ = 0, flush_delay_us_ = 0;
  std::mt19937_64 rng_;
  std::vector<std::thread> threads_;
};

}  // namespace dcpds
