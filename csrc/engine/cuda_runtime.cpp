#include "cuda_runtime.hpp"

#include <dlfcn.h>

#include "error.hpp"

namespace dcpds {
namespace {

constexpr int kMemcpyDeviceToHost = 2;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventBlockingSync = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kHostRegisterPortable = 1;

void* open_runtime(const std::string& path, std::string& used) {
  if (!path.empty()) {
    used = path;
    return ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  static const char* const kNames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                       "libcudart.so"};
  for (int pass = 0; pass < 2; ++pass) {
    for (const char* name : kNames) {
      void* h = ::dlopen(name, RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (h != nullptr) {
        used = name;
        return h;
      }
    }
  }
  return nullptr;
}

template <typename F>
void resolve(void* handle, const char* name, F& fn, const std::string& path) {
  fn = reinterpret_cast<F>(::dlsym(handle, name));
  DCPDS_CHECK(fn != nullptr, std::string("CUDA runtime ") + path + " has no symbol " + name);
}

}  // namespace

CudaRuntime::CudaRuntime(const std::string& library_path) {
  handle_ = open_runtime(library_path, path_);
  if (handle_ == nullptr) {
    const char* err = ::dlerror();
    DCPDS_CHECK(false, "cannot load the CUDA runtime " +
                           (library_path.empty() ? std::string("(libcudart.so*)") : library_path) +
                           ": " + (err ? err : "not found"));
  }
  resolve(handle_, "cudaSetDevice", set_device_, path_);
  resolve(handle_, "cudaHostRegister", host_register_, path_);
  resolve(handle_, "cudaHostUnregister", host_unregister_, path_);
  resolve(handle_, "cudaStreamCreateWithFlags", stream_create_, path_);
  resolve(handle_, "cudaStreamDestroy", stream_destroy_, path_);
  resolve(handle_, "cudaEventCreateWithFlags", event_create_, path_);
  resolve(handle_, "cudaEventDestroy", event_destroy_, path_);
  resolve(handle_, "cudaStreamWaitEvent", stream_wait_event_, path_);
  resolve(handle_, "cudaEventRecord", event_record_, path_);
  resolve(handle_, "cudaEventSynchronize", event_synchronize_, path_);
  resolve(handle_, "cudaStreamSynchronize", stream_synchronize_, path_);
  resolve(handle_, "cudaGetLastError", get_last_error_, path_);
  resolve(handle_, "cudaMemcpyAsync", memcpy_async_, path_);
  resolve(handle_, "cudaGetErrorString", error_string_, path_);
}

CudaRuntime::~CudaRuntime() {
  if (handle_ != nullptr) ::dlclose(handle_);
}

void CudaRuntime::check(int status, const char* what) const {
  if (status == 0) return;
  get_last_error_();  // clear this thread's last error: see the header
  const char* msg = error_string_ ? error_string_(status) : "unknown error";
  DCPDS_CHECK(false, std::string(what) + " failed: " + (msg ? msg : "?") + " (cudaError " +
                         std::to_string(status) + ")");
}

void CudaRuntime::set_device(int device) const { check(set_device_(device), "cudaSetDevice"); }

void CudaRuntime::host_register(void* ptr, std::size_t bytes) const {
  check(host_register_(ptr, bytes, kHostRegisterPortable), "cudaHostRegister of the host cache");
}

void CudaRuntime::host_unregister(void* ptr) const noexcept {
  if (host_unregister_(ptr) != 0) get_last_error_();
}

CudaRuntime::Stream CudaRuntime::create_stream() const {
  Stream s = nullptr;
  check(stream_create_(&s, kStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

void CudaRuntime::destroy_stream(Stream s) const noexcept {
  if (stream_destroy_(s) != 0) get_last_error_();
}

void CudaRuntime::synchronize_stream(Stream s) const {
  check(stream_synchronize_(s), "cudaStreamSynchronize");
}

bool CudaRuntime::try_synchronize_stream(Stream s) const noexcept {
  if (stream_synchronize_(s) == 0) return true;
  get_last_error_();
  return false;
}

CudaRuntime::Event CudaRuntime::create_event() const {
  Event e = nullptr;
  check(event_create_(&e, kEventBlockingSync | kEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}

void CudaRuntime::destroy_event(Event e) const noexcept {
  if (event_destroy_(e) != 0) get_last_error_();
}

void CudaRuntime::stream_wait_event(Stream s, Event e) const {
  check(stream_wait_event_(s, e, 0), "cudaStreamWaitEvent");
}

void CudaRuntime::record_event(Event e, Stream s) const {
  check(event_record_(e, s), "cudaEventRecord");
}

void CudaRuntime::synchronize_event(Event e) const {
  check(event_synchronize_(e), "cudaEventSynchronize");
}

void CudaRuntime::memcpy_d2h_async(void* dst, const void* src, std::size_t bytes, Stream s) const {
  check(memcpy_async_(dst, src, bytes, kMemcpyDeviceToHost, s), "cudaMemcpyAsync (device to host)");
}

}  // namespace dcpds
