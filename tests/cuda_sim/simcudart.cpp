// simcudart: a stand-in for libcudart with CUDA's stream and event semantics on host memory.
//
// It implements exactly the runtime entry points that csrc/engine/cuda_runtime.cpp resolves, so
// that the engine's CUDA path (Engine::enable_cuda(path) dlopen()s whatever library it is given)
// runs on a machine without a GPU. "Device memory" is host memory: a cudaMemcpyAsync is a memcpy
// executed when its turn on the stream comes.
//
// Semantics modelled (those the engine relies on):
//   - a stream is an ordered queue served by its own thread; cudaStreamDestroy returns at once and
//     the stream's queued work still runs (as in CUDA);
//   - cudaEventRecord enqueues a marker; the event completes when the work queued before it on
//     that stream is done. cudaEventSynchronize / cudaStreamWaitEvent wait for the record most
//     recent at the time of the call; an event never recorded counts as complete;
//   - cudaMemcpyAsync copies when its turn comes; into memory that is not registered (pageable,
//     device to host) or out of it (host to device) it returns only once the copy is done (CUDA
//     returns once the pageable side is no longer needed); a batch copy is pinned when either
//     end is registered;
//   - cudaHostRegister / cudaHostUnregister keep the registered ranges (overlaps are refused);
//   - handles are validated: an unknown or destroyed stream or event is
//     cudaErrorInvalidResourceHandle, and counted;
//   - a failing call sets the calling thread's last error (cudaGetLastError reads and clears it);
//   - an execution failure (a copy that faults on the "device") is sticky, as a real device fault
//     is: every later call returns that error until simcuda_reset().
//
// Test controls (extern "C", called through ctypes), all thread-safe:
//   simcuda_reset()                                   rules, latencies, sticky error, gates cleared
//   simcuda_fail(name, nth, error, times)             the nth call of `name` from now (1-based)
//                                                     fails with `error`, `times` calls in a row
//                                                     (times < 0: every call from then on)
//   simcuda_fail_exec(nth, error)                     the nth memcpy to *execute* from now copies
//                                                     half its bytes and raises a sticky `error`
//   simcuda_set_latency(name, us)                     each call of `name` first sleeps `us`
//   simcuda_set_copy_us(us)                           each memcpy takes `us` on its stream
//   simcuda_count(name)                               counters, see count_locked()
//   simcuda_enqueue_host_write(stream, dst, src, n, delay_us)   the "compute stream" plays a kernel
//   simcuda_enqueue_gate(stream, gate) / simcuda_open_gate(gate) a kernel that runs until opened
//   simcuda_last_error_peek()                         the calling thread's last error, not cleared
//   simcuda_quiesce(timeout_ms)                       waits until every stream's queue is drained
//   simcuda_set_runtime_version(v)                    what cudaRuntimeGetVersion reports (default
//                                                     12040: too old for the batch call; set 12080
//                                                     for the CUDA 12 build, 13000 for the CUDA 13
//                                                     one: the caller picks the prototype by it)
//   simcuda_set_fail_index(i)                         the failIdx an injected batch failure reports
//                                                     (< 0: SIZE_MAX, "no particular copy")
//   counters "batch_copies", "batch_largest"          copies queued by batch calls, largest batch
//   counter "stale_errors"                            calls made while the calling thread's last
//                                                     error was still set (not sticky)
//
// cudaMemcpyBatchAsync is exported with CUDA 12.8's prototype (failIdx before the stream); with
// -DSIMCUDART_CUDA13, with CUDA 13's (no failIdx); with -DSIMCUDART_NO_BATCH, not at all (a
// runtime before 12.8). One build per prototype: a single symbol guessing its caller's argument
// count would read an argument never passed.
//
// Build: c++ -std=c++17 -shared -fPIC -O2 -pthread -Wl,-z,nodelete simcudart.cpp -o libsimcudart.so
// (done by tests/test_cuda_sim.py). nodelete keeps the code mapped after dlclose(), because the
// threads of destroyed streams may still be draining their queues.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

// cudaError_t values, as in the real runtime.
constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kMemoryAllocation = 2;
constexpr int kInvalidDevice = 101;
constexpr int kInvalidMemcpyDirection = 21;
constexpr int kInvalidResourceHandle = 400;
constexpr int kIllegalAddress = 700;
constexpr int kHostMemoryAlreadyRegistered = 712;
constexpr int kHostMemoryNotRegistered = 713;
constexpr int kLaunchFailure = 719;

struct Event {
  std::uint64_t recorded = 0;   // generation of the latest record
  std::uint64_t completed = 0;  // generation of the latest record that completed
  unsigned flags = 0;
};

struct Stream {
  std::deque<std::function<void()>> queue;
  bool busy = false;
  bool destroyed = false;
  unsigned flags = 0;
  int device = 0;
};

struct FailRule {
  std::uint64_t from_call;  // absolute call number of the first failing call
  std::int64_t times;       // < 0: forever
  int error;
};

std::mutex g_mu;
std::condition_variable g_cv;
std::map<void*, std::shared_ptr<Stream>> g_streams;  // live (not destroyed) streams
std::map<void*, std::shared_ptr<Event>> g_events;    // live events
std::map<std::uintptr_t, std::size_t> g_registered;  // base -> bytes
std::map<std::uint64_t, std::pair<std::uintptr_t, std::size_t>> g_pending_copies;  // queued memcpys
std::uint64_t g_next_copy = 1;
std::map<std::string, std::uint64_t> g_calls;       // calls started per entry point
std::map<std::string, FailRule> g_fail;
std::map<std::string, int> g_latency_us;
std::map<int, bool> g_gates;  // gate id -> open
int g_copy_us = 0;
std::uint64_t g_exec_count = 0;       // memcpys executed so far
std::uint64_t g_exec_fail_at = 0;     // 0: none
int g_exec_fail_error = 0;
int g_sticky = 0;
int g_device_count = 2;
std::uint64_t g_copies = 0, g_pageable_copies = 0, g_bad_handles = 0, g_violations = 0;
std::uint64_t g_threads_alive = 0;
std::shared_ptr<Stream> g_default_stream;  // the legacy stream 0, created on first use
constexpr int kDefaultRuntimeVersion = 12040;  // before cudaMemcpyBatchAsync
int g_runtime_version = kDefaultRuntimeVersion;  // what cudaRuntimeGetVersion reports
std::size_t g_fail_index = ~std::size_t{0};      // failIdx of an injected batch failure
std::uint64_t g_batch_copies = 0, g_batch_largest = 0;
// Calls made by a thread whose last error was still set (no cudaGetLastError since its failing
// call, no sticky error): torch would report that error as its own next kernel's.
std::uint64_t g_stale_errors = 0;

thread_local int t_last_error = 0;
thread_local int t_device = 0;

int set_error(int e) {
  if (e != kSuccess) t_last_error = e;
  return e;
}

void stream_thread(std::shared_ptr<Stream> s) {
  std::unique_lock<std::mutex> lock(g_mu);
  for (;;) {
    g_cv.wait(lock, [&] { return !s->queue.empty() || s->destroyed; });
    if (s->queue.empty()) break;  // destroyed and drained
    std::function<void()> op = std::move(s->queue.front());
    s->queue.pop_front();
    s->busy = true;
    lock.unlock();
    op();
    lock.lock();
    s->busy = false;
    g_cv.notify_all();
  }
  --g_threads_alive;
  g_cv.notify_all();
}

std::shared_ptr<Stream> new_stream_locked(unsigned flags) {
  auto s = std::make_shared<Stream>();
  s->flags = flags;
  s->device = t_device;
  ++g_threads_alive;
  std::thread(stream_thread, s).detach();
  return s;
}

// Looks a stream handle up (nullptr = the legacy default stream). Null result: invalid handle.
std::shared_ptr<Stream> stream_locked(void* handle) {
  if (handle == nullptr) {
    if (!g_default_stream) g_default_stream = new_stream_locked(0);
    return g_default_stream;
  }
  auto it = g_streams.find(handle);
  if (it == g_streams.end()) {
    ++g_bad_handles;
    return nullptr;
  }
  return it->second;
}

std::shared_ptr<Event> event_locked(void* handle) {
  auto it = g_events.find(handle);
  if (it == g_events.end()) {
    ++g_bad_handles;
    return nullptr;
  }
  return it->second;
}

void enqueue_locked(const std::shared_ptr<Stream>& s, std::function<void()> op) {
  s->queue.push_back(std::move(op));
  g_cv.notify_all();
}

// Every entry point starts here: counts the call, sleeps the configured latency, then applies an
// injected failure or the sticky error. Returns the error to return (kSuccess: go on).
// Teardown calls (`sticky` false) still work after a device fault, so that a process can release
// what it holds.
int enter(const char* name, bool sticky = true) {
  int latency = 0;
  int fail = kSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const std::uint64_t n = ++g_calls[name];
    auto lit = g_latency_us.find(name);
    if (lit != g_latency_us.end()) latency = lit->second;
    auto fit = g_fail.find(name);
    if (fit != g_fail.end()) {
      const FailRule& r = fit->second;
      if (n >= r.from_call && (r.times < 0 || n < r.from_call + static_cast<std::uint64_t>(r.times)))
        fail = r.error;
    }
  }
  if (latency > 0) std::this_thread::sleep_for(std::chrono::microseconds(latency));
  std::lock_guard<std::mutex> lock(g_mu);
  if (t_last_error != kSuccess && g_sticky == kSuccess) ++g_stale_errors;
  if (fail != kSuccess) return set_error(fail);
  if (sticky && g_sticky != kSuccess) return set_error(g_sticky);
  return kSuccess;
}

bool registered_locked(std::uintptr_t p, std::size_t n) {
  auto it = g_registered.upper_bound(p);
  if (it == g_registered.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second;
}

std::uint64_t count_locked(const std::string& name) {
  if (name == "streams") return g_streams.size();
  if (name == "events") return g_events.size();
  if (name == "registrations") return g_registered.size();
  if (name == "inflight_copies") return g_pending_copies.size();
  if (name == "copies") return g_copies;
  if (name == "batch_copies") return g_batch_copies;
  if (name == "batch_largest") return g_batch_largest;
  if (name == "stale_errors") return g_stale_errors;
  if (name == "pageable_copies") return g_pageable_copies;
  if (name == "bad_handles") return g_bad_handles;
  if (name == "violations") return g_violations;
  if (name == "threads") return g_threads_alive;
  if (name == "sticky") return static_cast<std::uint64_t>(g_sticky);
  if (name.rfind("calls:", 0) == 0) {
    auto it = g_calls.find(name.substr(6));
    return it == g_calls.end() ? 0 : it->second;
  }
  return ~std::uint64_t{0};
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------- runtime entry points

const char* cudaGetErrorString(int error) {
  switch (error) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kMemoryAllocation: return "out of memory";
    case kInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case kInvalidDevice: return "invalid device ordinal";
    case kInvalidResourceHandle: return "invalid resource handle";
    case kIllegalAddress: return "an illegal memory access was encountered";
    case kHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case kHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case kLaunchFailure: return "unspecified launch failure";
    default: return "unrecognized error code";
  }
}

int cudaGetLastError() {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_calls["cudaGetLastError"];
  const int e = t_last_error;
  t_last_error = g_sticky;  // a sticky error is never cleared
  return e != kSuccess ? e : g_sticky;
}

int cudaSetDevice(int device) {
  if (int e = enter("cudaSetDevice")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (device < 0 || device >= g_device_count) return set_error(kInvalidDevice);
  t_device = device;
  return kSuccess;
}

int cudaHostRegister(void* ptr, std::size_t bytes, unsigned flags) {
  if (int e = enter("cudaHostRegister")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (ptr == nullptr || bytes == 0 || (flags & ~0xFu) != 0) return set_error(kInvalidValue);
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  for (const auto& kv : g_registered)
    if (p < kv.first + kv.second && kv.first < p + bytes)
      return set_error(kHostMemoryAlreadyRegistered);
  g_registered.emplace(p, bytes);
  return kSuccess;
}

int cudaHostUnregister(void* ptr) {
  if (int e = enter("cudaHostUnregister", false)) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_registered.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_registered.end()) return set_error(kHostMemoryNotRegistered);
  // A copy still queued into this range would land in memory its owner is about to free.
  for (const auto& kv : g_pending_copies)
    if (kv.second.first < it->first + it->second && it->first < kv.second.first + kv.second.second)
      ++g_violations;
  g_registered.erase(it);
  return kSuccess;
}

int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  if (int e = enter("cudaStreamCreateWithFlags")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (stream == nullptr || flags > 1) return set_error(kInvalidValue);
  auto s = new_stream_locked(flags);
  g_streams.emplace(s.get(), s);
  *stream = s.get();
  return kSuccess;
}

int cudaStreamDestroy(void* stream) {
  if (int e = enter("cudaStreamDestroy", false)) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams.find(stream);
  if (it == g_streams.end()) {
    ++g_bad_handles;
    return set_error(kInvalidResourceHandle);
  }
  it->second->destroyed = true;  // its thread drains the queue, then exits
  g_streams.erase(it);
  g_cv.notify_all();
  return kSuccess;
}

int cudaStreamSynchronize(void* stream) {
  if (int e = enter("cudaStreamSynchronize")) return e;
  std::unique_lock<std::mutex> lock(g_mu);
  auto s = stream_locked(stream);
  if (!s) return set_error(kInvalidResourceHandle);
  g_cv.wait(lock, [&] { return (s->queue.empty() && !s->busy) || g_sticky != kSuccess; });
  return set_error(g_sticky);
}

int cudaEventCreateWithFlags(void** event, unsigned flags) {
  if (int e = enter("cudaEventCreateWithFlags")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (event == nullptr || (flags & ~0x7u) != 0) return set_error(kInvalidValue);
  if ((flags & 0x4u) != 0 && (flags & 0x2u) == 0) return set_error(kInvalidValue);
  auto ev = std::make_shared<Event>();
  ev->flags = flags;
  g_events.emplace(ev.get(), ev);
  *event = ev.get();
  return kSuccess;
}

int cudaEventDestroy(void* event) {
  if (int e = enter("cudaEventDestroy", false)) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_events.find(event);
  if (it == g_events.end()) {
    ++g_bad_handles;
    return set_error(kInvalidResourceHandle);
  }
  g_events.erase(it);  // pending records and waits keep the object alive, as in CUDA
  return kSuccess;
}

int cudaEventRecord(void* event, void* stream) {
  if (int e = enter("cudaEventRecord")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto ev = event_locked(event);
  auto s = stream_locked(stream);
  if (!ev || !s) return set_error(kInvalidResourceHandle);
  const std::uint64_t gen = ++ev->recorded;
  enqueue_locked(s, [ev, gen] {
    std::lock_guard<std::mutex> l(g_mu);
    ev->completed = std::max(ev->completed, gen);
    g_cv.notify_all();
  });
  return kSuccess;
}

int cudaEventSynchronize(void* event) {
  if (int e = enter("cudaEventSynchronize")) return e;
  std::unique_lock<std::mutex> lock(g_mu);
  auto ev = event_locked(event);
  if (!ev) return set_error(kInvalidResourceHandle);
  const std::uint64_t target = ev->recorded;
  g_cv.wait(lock, [&] { return ev->completed >= target || g_sticky != kSuccess; });
  return set_error(g_sticky);
}

int cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  if (int e = enter("cudaStreamWaitEvent")) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto ev = event_locked(event);
  auto s = stream_locked(stream);
  if (!ev || !s) return set_error(kInvalidResourceHandle);
  if (flags > 1) return set_error(kInvalidValue);
  const std::uint64_t target = ev->recorded;
  if (ev->completed >= target) return kSuccess;  // never recorded, or already complete
  enqueue_locked(s, [ev, target] {
    std::unique_lock<std::mutex> l(g_mu);
    g_cv.wait(l, [&] { return ev->completed >= target || g_sticky != kSuccess; });
  });
  return kSuccess;
}

}  // extern "C"

namespace {

// Queues one copy on `s` (under g_mu); returns the flag the stream sets once it has run.
std::shared_ptr<bool> enqueue_copy_locked(const std::shared_ptr<Stream>& s, void* dst,
                                          const void* src, std::size_t bytes, bool pageable) {
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const std::uint64_t id = g_next_copy++;
  g_pending_copies.emplace(id, std::make_pair(d, bytes));
  auto done = std::make_shared<bool>(false);
  enqueue_locked(s, [=] {
    int copy_us;
    bool fail = false;
    int fail_error = 0;
    {
      std::lock_guard<std::mutex> l(g_mu);
      copy_us = g_copy_us;
      if (g_sticky == kSuccess) {
        ++g_exec_count;
        fail = g_exec_fail_at != 0 && g_exec_count == g_exec_fail_at;
        fail_error = g_exec_fail_error;
      }
    }
    if (copy_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(copy_us));
    std::lock_guard<std::mutex> l(g_mu);
    if (g_sticky == kSuccess) {
      std::memcpy(dst, src, fail ? bytes / 2 : bytes);
      if (fail) {
        g_sticky = fail_error;
      } else {
        ++g_copies;
        if (pageable) ++g_pageable_copies;
      }
    }
    g_pending_copies.erase(id);
    *done = true;
    g_cv.notify_all();
  });
  return done;
}

}  // namespace

extern "C" {

int cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, int kind, void* stream) {
  if (int e = enter("cudaMemcpyAsync")) return e;
  std::unique_lock<std::mutex> lock(g_mu);
  auto s = stream_locked(stream);
  if (!s) return set_error(kInvalidResourceHandle);
  if (kind < 0 || kind > 4) return set_error(kInvalidMemcpyDirection);
  if (bytes == 0) return kSuccess;
  if (dst == nullptr || src == nullptr) return set_error(kInvalidValue);
  // The host side of the copy: the destination device to host, the source host to device.
  const void* host = kind == 1 ? src : dst;
  const bool pageable = !registered_locked(reinterpret_cast<std::uintptr_t>(host), bytes);
  auto done = enqueue_copy_locked(s, dst, src, bytes, pageable);
  // Device to host into pageable memory, host to device from it: the call returns once the copy
  // is done (CUDA returns once a pageable source is consumed; done is a safe model of that).
  if (pageable && (kind == 2 || kind == 1)) {
    g_cv.wait(lock, [&] { return *done; });
    return set_error(g_sticky);
  }
  return kSuccess;
}

int cudaRuntimeGetVersion(int* version) {
  if (int e = enter("cudaRuntimeGetVersion", false)) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (version == nullptr) return set_error(kInvalidValue);
  *version = g_runtime_version;
  return kSuccess;
}

#ifndef SIMCUDART_NO_BATCH
}  // extern "C"

namespace {

// cudaMemcpyBatchAsync's semantics, for both prototypes. Each attribute struct's first int is
// the source access order (1..3 valid). The whole batch is validated before any copy is queued;
// an injected failure (simcuda_fail) reports simcuda_set_fail_index()'s index through failIdx
// (CUDA 12 only) and queues nothing.
int memcpy_batch(void** dsts, void** srcs, std::size_t* sizes, std::size_t count, void* attrs,
                 std::size_t* attrs_idxs, std::size_t num_attrs, std::size_t* fail_idx,
                 void* stream) {
  std::size_t fail_index;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    fail_index = g_fail_index;
  }
  auto fail = [&](int error, std::size_t index) {
    if (fail_idx != nullptr) *fail_idx = index;
    return set_error(error);
  };
  if (int e = enter("cudaMemcpyBatchAsync")) return fail(e, fail_index);
  std::unique_lock<std::mutex> lock(g_mu);
  auto s = stream_locked(stream);
  if (!s) return fail(kInvalidResourceHandle, ~std::size_t{0});
  if (count == 0 || dsts == nullptr || srcs == nullptr || sizes == nullptr || attrs == nullptr ||
      attrs_idxs == nullptr || num_attrs == 0 || num_attrs > count || attrs_idxs[0] != 0)
    return fail(kInvalidValue, ~std::size_t{0});
  const int order = *static_cast<const int*>(attrs);
  if (num_attrs != 1 || order < 1 || order > 3) return fail(kInvalidValue, 0);
  bool pageable = false;
  for (std::size_t i = 0; i < count; ++i) {
    if (sizes[i] != 0 && (dsts[i] == nullptr || srcs[i] == nullptr)) return fail(kInvalidValue, i);
    // Either end registered: a pinned copy (device memory is never registered here).
    pageable = pageable ||
               (!registered_locked(reinterpret_cast<std::uintptr_t>(dsts[i]), sizes[i]) &&
                !registered_locked(reinterpret_cast<std::uintptr_t>(srcs[i]), sizes[i]));
  }
  std::vector<std::shared_ptr<bool>> done;
  for (std::size_t i = 0; i < count; ++i)
    if (sizes[i] != 0) done.push_back(enqueue_copy_locked(s, dsts[i], srcs[i], sizes[i], pageable));
  g_batch_copies += count;
  g_batch_largest = std::max<std::uint64_t>(g_batch_largest, count);
  if (pageable) {  // as cudaMemcpyAsync: into pageable memory the call returns once done
    g_cv.wait(lock, [&] {
      return std::all_of(done.begin(), done.end(), [](const auto& d) { return *d; });
    });
    return set_error(g_sticky);
  }
  return kSuccess;
}

}  // namespace

extern "C" {

#ifdef SIMCUDART_CUDA13
// CUDA 13's prototype: no failIdx.
int cudaMemcpyBatchAsync(void** dsts, void** srcs, std::size_t* sizes, std::size_t count,
                         void* attrs, std::size_t* attrs_idxs, std::size_t num_attrs,
                         void* stream) {
  return memcpy_batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, nullptr, stream);
}
#else
// CUDA 12.8's prototype.
int cudaMemcpyBatchAsync(void** dsts, void** srcs, std::size_t* sizes, std::size_t count,
                         void* attrs, std::size_t* attrs_idxs, std::size_t num_attrs,
                         std::size_t* fail_idx, void* stream) {
  return memcpy_batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream);
}
#endif
#endif


// ---------------------------------------------------------------- test controls

void simcuda_reset() {
  std::unique_lock<std::mutex> lock(g_mu);
  g_fail.clear();
  g_latency_us.clear();
  for (auto& kv : g_gates) kv.second = true;
  g_cv.notify_all();
  g_sticky = kSuccess;
  g_copy_us = 0;
  g_exec_fail_at = 0;
  g_device_count = 2;
  g_cv.wait_for(lock, std::chrono::seconds(10), [] {
    for (const auto& kv : g_streams)
      if (!kv.second->queue.empty() || kv.second->busy) return false;
    return g_pending_copies.empty();
  });
  g_gates.clear();
  g_copies = g_pageable_copies = g_bad_handles = g_violations = 0;
  g_batch_copies = g_batch_largest = g_stale_errors = 0;
  g_runtime_version = kDefaultRuntimeVersion;
  g_fail_index = ~std::size_t{0};
  t_last_error = kSuccess;
}

void simcuda_set_runtime_version(int version) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_runtime_version = version;
}

void simcuda_set_fail_index(long long index) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_index = index < 0 ? ~std::size_t{0} : static_cast<std::size_t>(index);
}

void simcuda_fail(const char* name, int nth, int error, int times) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::uint64_t done = g_calls[name];
  g_fail[name] = FailRule{done + static_cast<std::uint64_t>(nth < 1 ? 1 : nth), times, error};
}

void simcuda_fail_exec(int nth, int error) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_exec_fail_at = g_exec_count + static_cast<std::uint64_t>(nth < 1 ? 1 : nth);
  g_exec_fail_error = error;
}

void simcuda_set_latency(const char* name, int us) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_latency_us[name] = us;
}

void simcuda_set_copy_us(int us) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_copy_us = us;
}

void simcuda_set_device_count(int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_device_count = n;
}

unsigned long long simcuda_count(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  return count_locked(name);
}

int simcuda_enqueue_host_write(void* stream, void* dst, const void* src, std::size_t bytes,
                               int delay_us) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_locked(stream);
  if (!s) return kInvalidResourceHandle;
  enqueue_locked(s, [=] {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::memcpy(dst, src, bytes);
  });
  return kSuccess;
}

int simcuda_enqueue_gate(void* stream, int gate) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_locked(stream);
  if (!s) return kInvalidResourceHandle;
  g_gates[gate] = false;
  enqueue_locked(s, [gate] {
    std::unique_lock<std::mutex> l(g_mu);
    g_cv.wait(l, [&] {
      auto it = g_gates.find(gate);
      return it == g_gates.end() || it->second;
    });
  });
  return kSuccess;
}

void simcuda_open_gate(int gate) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_gates[gate] = true;
  g_cv.notify_all();
}

int simcuda_last_error_peek() { return t_last_error; }

int simcuda_quiesce(int timeout_ms) {
  std::unique_lock<std::mutex> lock(g_mu);
  return g_cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [] {
    for (const auto& kv : g_streams)
      if (!kv.second->queue.empty() || kv.second->busy) return false;
    return g_pending_copies.empty() && g_threads_alive == (g_default_stream ? 1u : 0u) + g_streams.size();
  }) ? 1 : 0;
}

}  // extern "C"
