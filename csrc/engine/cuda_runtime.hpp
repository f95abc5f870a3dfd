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
// Testing: any library exporting these entry points with CUDA's semantics can be loaded instead;
// tests/cuda_sim/simcudart.cpp is such a stand-in, used to run the engine's CUDA path on CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dcpds {

class CudaRuntime {
 public:
  using Stream = void*;
  using Event = void*;

  // Loads `library_path` (empty: try the usual sonames among already loaded libraries first).
  explicit CudaRuntime(const std::string& library_path);
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

  const std::string& library_path() const { return path_; }

 private:
  void check(int status, const char* what) const;

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
};

}  // namespace dcpds
