#include "cuda_runtime.hpp"

#include <dlfcn.h>

#include "error.hpp"

namespace dcpds {
namespace {

constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventBlockingSync = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kHostRegisterPortable = 1;
// cudaMemcpyBatchAsync: first runtime version that has it, and the major version that dropped
// its failIdx parameter.
constexpr int kBatchMinVersion = 12080;
constexpr int kBatchNoFailIndexVersion = 13000;
// cudaMemcpySrcAccessOrderStream: the source is read in stream order, after the ready event the
// stream waited for (what the save call's snapshot needs).
constexpr int kSrcAccessOrderStream = 1;
// Errors with which a runtime refuses the batch call as a whole: the driver is older than the
// runtime's entry point, or the call (or our attribute struct) is not accepted. Copies are then
// issued one by one; a copy that is really invalid fails there, naming its tensor.
constexpr int kErrorInvalidValue = 1;
constexpr int kErrorCallRequiresNewerDriver = 36;
constexpr int kErrorNotSupported = 801;
// cudaMemcpyAttributes is 24 bytes in CUDA 12.8 and 13 (srcAccessOrder, srcLocHint, dstLocHint,
// flags); it is passed as zeroed words whose first one is the access order, with room to spare
// should a later runtime read a longer struct.
constexpr std::size_t kAttrWords = 16;

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

CudaRuntime::CudaRuntime(const std::string& library_path, bool batch) {
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
  resolve_batch(batch);
}

void CudaRuntime::resolve_batch(bool batch) {
  auto* get_version = reinterpret_cast<int (*)(int*)>(::dlsym(handle_, "cudaRuntimeGetVersion"));
  if (get_version != nullptr && get_version(&version_) != 0) {
    get_last_error_();
    version_ = 0;
  }
  batch_fn_ = ::dlsym(handle_, "cudaMemcpyBatchAsync");
  if (!batch) {
    batch_reason_ = "turned off (DCPDS_NO_CUDA_BATCH)";
  } else if (batch_fn_ == nullptr) {
    batch_reason_ = "the runtime has no cudaMemcpyBatchAsync";
  } else if (version_ < kBatchMinVersion) {
    batch_reason_ = "runtime version " + std::to_string(version_) + " is older than 12.8";
  } else {
    batch_abi_ = version_ >= kBatchNoFailIndexVersion ? BatchAbi::kCuda13 : BatchAbi::kCuda12;
  }
}

std::string CudaRuntime::batch_unavailable_reason() const {
  if (batch_abi_ == BatchAbi::kNone) return batch_reason_;
  if (batch_off_.load()) return "cudaMemcpyBatchAsync was refused by the runtime";
  return "";
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

void CudaRuntime::memcpy_h2d_async(void* dst, const void* src, std::size_t bytes, Stream s) const {
  check(memcpy_async_(dst, src, bytes, kMemcpyHostToDevice, s), "cudaMemcpyAsync (host to device)");
}

bool CudaRuntime::memcpy_d2h_batch(void* const* dsts, void* const* srcs,
                                   const std::size_t* sizes, std::size_t count, Stream s,
                                   std::size_t* fail_index) const {
  return memcpy_batch(dsts, srcs, sizes, count, s, fail_index,
                      "cudaMemcpyBatchAsync (device to host)");
}

bool CudaRuntime::memcpy_h2d_batch(void* const* dsts, void* const* srcs,
                                   const std::size_t* sizes, std::size_t count, Stream s,
                                   std::size_t* fail_index) const {
  return memcpy_batch(dsts, srcs, sizes, count, s, fail_index,
                      "cudaMemcpyBatchAsync (host to device)");
}

bool CudaRuntime::memcpy_batch(void* const* dsts, void* const* srcs, const std::size_t* sizes,
                               std::size_t count, Stream s, std::size_t* fail_index,
                               const char* what) const {
  *fail_index = kNoIndex;
  DCPDS_CHECK(batch_available(), "cudaMemcpyBatchAsync is not available");
  if (count == 0) return true;
  int attrs[kAttrWords] = {};
  attrs[0] = kSrcAccessOrderStream;
  std::size_t attr_index = 0;
  // The runtime's prototype takes non-const arrays; it does not write them.
  auto** d = const_cast<void**>(dsts);
  auto** src = const_cast<void**>(srcs);
  auto* n = const_cast<std::size_t*>(sizes);
  int status;
  if (batch_abi_ == BatchAbi::kCuda12) {
    std::size_t fail = kNoIndex;
    status = reinterpret_cast<BatchFn12>(batch_fn_)(d, src, n, count, attrs, &attr_index, 1,
                                                    &fail, s);
    if (status != 0 && fail < count) *fail_index = fail;
  } else {
    status = reinterpret_cast<BatchFn13>(batch_fn_)(d, src, n, count, attrs, &attr_index, 1, s);
  }
  if (status == kErrorNotSupported || status == kErrorCallRequiresNewerDriver ||
      status == kErrorInvalidValue) {
    get_last_error_();  // see the header: not left for torch's next kernel launch
    batch_off_.store(true);
    *fail_index = kNoIndex;
    return false;
  }
  check(status, what);
  return true;
}

}  // namespace dcpds
