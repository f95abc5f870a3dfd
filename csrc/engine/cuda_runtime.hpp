// CudaRuntime: the few CUDA runtime entry points the engine needs, resolved at run time.
//
// The engine is built without the CUDA toolkit and never links libcudart: when a CUDA tensor is
// saved, the Python layer passes the path of the libcudart already loaded into the process (by
// torch), and this class dlopen()s it and looks up its functions. On a machine without CUDA the
// class is simply never constructed.
// Thread-safety: all methods are const and may be called from any thread (the CUDA runtime is
// thread-safe); device selection is per thread, so callers call set_device() in the thread that
// issues work.
// Errors: every failing call throws EngineError with the runtime's error string. A failing call
// also clears the calling thread's "last error" (cudaGetLastError): the runtime is the one torch
// uses, and torch reads that slot after each kernel launch, so an error of ours left there would
// surface as a spurious failure of the next kernel on the training thread. The noexcept teardown
// calls (destroy, unregister) ignore their errors the same way.
// Optional entry points: cudaRuntimeGetVersion and cudaMemcpyBatchAsync are looked up too, and
// their absence only means copies are issued one by one (memcpy_d2h_batch, memcpy_h2d_batch).
// Testing: any library exporting these entry points with CUDA's semantics can be loaded instead;
// tests/cuda_sim/simcudart.cpp is such a stand-in, used to run the engine's CUDA path on CPU.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dcpds {

class CudaRuntime {
 public:
  using Stream = void*;
  using Event = void*;

  // Loads `library_path` (empty: try the usual sonames among already loaded libraries first).
  // `batch` false: never use cudaMemcpyBatchAsync, even where the runtime has it.
  explicit CudaRuntime(const std::string& library_path, bool batch = true);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  void set_device(int device) const;
  // Page-locks [ptr, ptr+bytes) for every device (cudaHostRegisterPortable): the copy threads
  // copy from whichever device an entry lives on into the same cache.
  void host_register(void* ptr, std::size_t bytes) const;
  void host_unregister(void* ptr) const noexcept;
  Stream create_stream() const;                 // non-blocking stream on the current device
  void destroy_stream(Stream s) const noexcept;
  void synchronize_stream(Stream s) const;
  // Waits for everything queued on `s`; returns false instead of throwing. Used on failure paths,
  // before memory a queued copy writes into is handed to anyone else.
  bool try_synchronize_stream(Stream s) const noexcept;
  // Timing disabled; blocking sync, so that a copy thread waiting in synchronize_event() sleeps
  // instead of spinning a CPU core that training's data loaders could use.
  Event create_event() const;
  void destroy_event(Event e) const noexcept;
  void stream_wait_event(Stream s, Event e) const;
  void record_event(Event e, Stream s) const;
  void synchronize_event(Event e) const;
  void memcpy_d2h_async(void* dst, const void* src, std::size_t bytes, Stream s) const;
  void memcpy_h2d_async(void* dst, const void* src, std::size_t bytes, Stream s) const;

  // Batched copies (cudaMemcpyBatchAsync, CUDA 12.8+): `count` device-to-host copies queued on
  // `s` in one call, in stream order as a whole (after everything queued on `s` before; the
  // copies of one batch may run in any order among themselves, so they must not overlap).
  // Resolved at load time, optional: available only when the symbol exists, the runtime
  // reports version 12080 or later (cudaRuntimeGetVersion), and `batch` was not turned off. The
  // entry point changed between major versions (CUDA 12 reports the failing copy through a
  // `failIdx` out-parameter that CUDA 13 dropped); the version picks which one is called.
  bool batch_available() const { return batch_abi_ != BatchAbi::kNone && !batch_off_.load(); }
  // Why batch_available() is false ("" when it is true).
  std::string batch_unavailable_reason() const;
  // Queues the copies; true on success. A runtime that refuses the call as a whole
  // (cudaErrorNotSupported or cudaErrorCallRequiresNewerDriver: a driver older than the
  // runtime; cudaErrorInvalidValue: what a runtime reading the attribute struct differently
  // would return) switches batching off for this runtime, the last error is cleared, and false
  // is returned: the caller issues the same copies one by one (where a really invalid copy fails
  // on its own, naming its tensor). Any other failure
  // throws EngineError; *fail_index is then the index of the copy the runtime named, or
  // kNoIndex (CUDA 13, or an error of the batch as a whole). Whether copies before that index
  // were queued is unknown: the caller must synchronize `s` before reusing any destination.
  static constexpr std::size_t kNoIndex = ~std::size_t{0};
  // (srcs are only read; they are not const because the runtime's prototype has them so.)
  bool memcpy_d2h_batch(void* const* dsts, void* const* srcs, const std::size_t* sizes,
                        std::size_t count, Stream s, std::size_t* fail_index) const;
  // The same, host to device (the restore's staging to its targets).
  bool memcpy_h2d_batch(void* const* dsts, void* const* srcs, const std::size_t* sizes,
                        std::size_t count, Stream s, std::size_t* fail_index) const;
  int runtime_version() const { return version_; }  // 0 when the runtime cannot tell

  const std::string& library_path() const { return path_; }

 private:
  void check(int status, const char* what) const;
  bool memcpy_batch(void* const* dsts, void* const* srcs, const std::size_t* sizes,
                    std::size_t count, Stream s, std::size_t* fail_index, const char* what) const;

  std::string path_;
  void* handle_ = nullptr;
  // Function pointers, typed loosely (the runtime's enums are ints, handles are pointers).
  int (*set_device_)(int) = nullptr;
  int (*host_register_)(void*, std::size_t, unsigned) = nullptr;
  int (*host_unregister_)(void*) = nullptr;
  int (*stream_create_)(Stream*, unsigned) = nullptr;
  int (*stream_destroy_)(Stream) = nullptr;
  int (*event_create_)(Event*, unsigned) = nullptr;
  int (*event_destroy_)(Event) = nullptr;
  int (*stream_wait_event_)(Stream, Event, unsigned) = nullptr;
  int (*event_record_)(Event, Stream) = nullptr;
  int (*event_synchronize_)(Event) = nullptr;
  int (*stream_synchronize_)(Stream) = nullptr;
  int (*get_last_error_)() = nullptr;
  int (*memcpy_async_)(void*, const void*, std::size_t, int, Stream) = nullptr;
  const char* (*error_string_)(int) = nullptr;

  // Batched copies (optional entry points). The attribute struct is passed as raw bytes (its
  // first member, an int, is the source access order; the rest is zero): see cuda_runtime.cpp.
  enum class BatchAbi { kNone, kCuda12, kCuda13 };
  using BatchFn12 = int (*)(void**, void**, std::size_t*, std::size_t, void*, std::size_t*,
                            std::size_t, std::size_t*, Stream);
  using BatchFn13 = int (*)(void**, void**, std::size_t*, std::size_t, void*, std::size_t*,
                            std::size_t, Stream);
  void resolve_batch(bool batch);
  BatchAbi batch_abi_ = BatchAbi::kNone;
  void* batch_fn_ = nullptr;
  int version_ = 0;
  std::string batch_reason_;                    // why batch_abi_ is kNone (set once, at load)
  mutable std::atomic<bool> batch_off_{false};  // switched off after an "unsupported" refusal
};

}  // namespace dcpds
