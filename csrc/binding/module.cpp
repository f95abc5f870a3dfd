// The thin pybind11 binding of the engine: dcp_datastates._core.
//
// Rules: every call that can block (waits, allocation, file opens, close) releases the GIL; the
// engine's own threads never touch Python; arguments are plain values (addresses, sizes, paths).
// Every EngineError becomes dcp_datastates._core.EngineError (a RuntimeError).
#include <cstring>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/types.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "../engine/crc32c.hpp"
#include "../engine/device_reader.hpp"
#include "../engine/engine.hpp"
#include "../engine/error.hpp"
#include "../engine/guarded_copy.hpp"
#include "../engine/posix_file.hpp"
#include "../engine/reader.hpp"
#include "../engine/ring_allocator.hpp"

namespace py = pybind11;
using dcpds::Engine;
using dcpds::EngineOptions;
using dcpds::RingAllocator;

namespace {

// Owns the Engine so that Python can close it deterministically (close() joins the threads with
// the GIL released; the destructor does the same if close() was never called).
// Fork: the handle remembers the process that created the engine. In a forked child, get() raises
// EngineError naming that process, and close()/the destructor leak the engine instead of
// destroying it: its threads exist only in the parent, so joining them (or waiting on the
// condition variables they were waiting on at the fork) would hang or crash the child.
class EngineHandle {
 public:
  explicit EngineHandle(const EngineOptions& o) : owner_pid_(::getpid()) {
    py::gil_scoped_release nogil;
    engine_ = std::make_unique<Engine>(o);
  }
  ~EngineHandle() {
    if (!engine_) return;
    if (foreign()) {
      (void)engine_.release();  // leaked on purpose: see the class comment
      return;
    }
    py::gil_scoped_release nogil;
    engine_.reset();
  }
  Engine& get() {
    if (foreign())
      throw dcpds::EngineError("this engine belongs to process " + std::to_string(owner_pid_) +
                               "; a forked child (process " + std::to_string(::getpid()) +
                               ") cannot use it: create a new writer in the child");
    if (!engine_) throw dcpds::EngineError("the engine is closed");
    return *engine_;
  }
  void close() {
    if (!engine_) return;
    if (foreign()) {
      (void)engine_.release();
      return;
    }
    py::gil_scoped_release nogil;
    engine_.reset();
  }
  bool closed() const { return !engine_; }
  bool foreign() const { return ::getpid() != owner_pid_; }
  pid_t owner_pid() const { return owner_pid_; }

 private:
  const pid_t owner_pid_;
  std::unique_ptr<Engine> engine_;
};

py::dict stats_to_dict(const dcpds::JobStats& s) {
  py::dict d;
  d["created_s"] = s.created_s;
  d["captured_s"] = s.captured_s;
  d["done_s"] = s.done_s;
  d["bytes_total"] = s.bytes_total;
  d["bytes_copied"] = s.bytes_copied;
  d["bytes_written"] = s.bytes_written;
  d["copy_busy_s"] = s.copy_busy_s;
  d["flush_busy_s"] = s.flush_busy_s;
  d["flush_writes"] = s.flush_writes;
  d["failed"] = s.failed;
  d["error"] = s.error;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native host-cache engine of dcp_datastates (see csrc/engine/engine.hpp).";
  py::register_exception<dcpds::EngineError>(m, "EngineError", PyExc_RuntimeError);

  m.def(
      "crc32c",
      [](py::buffer b, std::uint32_t crc) {
        py::buffer_info info = b.request();
        const auto bytes = static_cast<std::size_t>(info.size * info.itemsize);
        const void* ptr = info.ptr;
        py::gil_scoped_release nogil;
        return dcpds::crc32c(crc, ptr, bytes);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC-32C of a buffer (extends `crc`). Releases the GIL.");
  m.attr("DIRECT_ALIGN") = dcpds::PosixFile::kDirectAlign;
  m.attr("DIRECT_MIN_BYTES") = dcpds::PosixFile::kDirectMinBytes;
  m.def(
      "copy_path_counts",
      [] {
        py::dict d;
        d["guarded"] = dcpds::copies_by_path(dcpds::CopyPath::kGuarded);
        d["kernel"] = dcpds::copies_by_path(dcpds::CopyPath::kKernel);
        d["plain"] = dcpds::copies_by_path(dcpds::CopyPath::kPlain);
        return d;
      },
      "Background copies of lazily captured host tensors made by each means since the process "
      "started: guarded memcpy, process_vm_readv, plain memcpy (guarded_copy.hpp).");
  m.def("crc32c_address",
        [](std::uintptr_t address, std::size_t bytes, std::uint32_t crc) {
          py::gil_scoped_release nogil;
          return dcpds::crc32c(crc, reinterpret_cast<const void*>(address), bytes);
        },
        py::arg("address"), py::arg("bytes"), py::arg("crc") = 0);
  py::class_<dcpds::DeviceStaging>(m, "DeviceStaging")
      .def(py::init<const std::string&, int, std::size_t, std::size_t, bool>(),
           py::arg("cuda_runtime"), py::arg("device"), py::arg("slots"), py::arg("slot_bytes"),
           py::arg("batch_copies") = true,
           "Page-locked staging for reads into device memory: slots x slot_bytes of host memory "
           "registered with the CUDA runtime at cuda_runtime (csrc/engine/device_reader.hpp).")
      .def_property_readonly("device", &dcpds::DeviceStaging::device)
      .def_property_readonly("slots", &dcpds::DeviceStaging::slots)
      .def_property_readonly("slot_bytes", &dcpds::DeviceStaging::slot_bytes)
      .def_property_readonly("pinned", &dcpds::DeviceStaging::pinned)
      .def_property_readonly("pin_error", &dcpds::DeviceStaging::pin_error)
      .def_property_readonly("batch_error", [](const dcpds::DeviceStaging& st) {
        return st.runtime().batch_unavailable_reason();
      });

  m.def(
      "read_spans",
      [](const std::vector<std::string>& paths, const std::vector<std::uint32_t>& files,
         const std::vector<std::uint64_t>& offsets, const std::vector<std::uint64_t>& lengths,
         const std::vector<std::uintptr_t>& dsts, const std::vector<std::int64_t>& crcs,
         const std::vector<std::string>& names, const std::vector<std::uint32_t>& name_of,
         int threads, bool o_direct, std::size_t block_bytes,
         const dcpds::DeviceStaging* staging) {
        const std::size_t n = files.size();
        if (offsets.size() != n || lengths.size() != n || dsts.size() != n || crcs.size() != n ||
            name_of.size() != n)
          throw dcpds::EngineError("read_spans: the span lists differ in length");
        std::vector<dcpds::ReadSpan> spans(n);
        for (std::size_t i = 0; i < n; ++i)
          spans[i] = dcpds::ReadSpan{files[i], offsets[i], lengths[i], dsts[i], crcs[i], name_of[i]};
        dcpds::ReaderOptions o;
        o.threads = threads;
        o.o_direct = o_direct;
        o.block_bytes = block_bytes;
        dcpds::ReadStats st;
        {
          py::gil_scoped_release nogil;
          if (staging != nullptr)
            st = dcpds::DeviceReader(*staging, o).read(paths, spans, names);
          else
            st = dcpds::ParallelReader(o).read(paths, spans, names);
        }
        py::dict d;
        d["bytes"] = st.bytes;
        d["direct_bytes"] = st.direct_bytes;
        d["verified_bytes"] = st.verified_bytes;
        d["pieces"] = st.pieces;
        d["threads"] = st.threads;
        d["preads"] = st.preads;
        d["copy_calls"] = st.copy_calls;
        d["batch_calls"] = st.batch_calls;
        d["batch_copies"] = st.batch_copies;
        return d;
      },
      py::arg("paths"), py::arg("files"), py::arg("offsets"), py::arg("lengths"), py::arg("dsts"),
      py::arg("crcs"), py::arg("names"), py::arg("name_of"), py::arg("threads") = 4,
      py::arg("o_direct") = true, py::arg("block_bytes") = 8u << 20,
      py::arg("staging") = nullptr,
      "Reads span i = (paths[files[i]], offsets[i], lengths[i]) to address dsts[i] with parallel "
      "preads (O_DIRECT where possible), verifying CRC-32C crcs[i] (-1: none) in the same pass; "
      "errors name names[name_of[i]] and the path (csrc/engine/reader.hpp). With a staging "
      "(DeviceStaging) the dsts are device addresses on its device, reached through it "
      "(csrc/engine/device_reader.hpp). Releases the GIL.");
  m.def("set_write_fault", &dcpds::set_write_fault, py::arg("path_substring"), py::arg("errno"),
        "Test hook: writes to paths containing the substring fail with errno (\"\" disables).");

  py::class_<RingAllocator>(m, "RingAllocator")
      .def(py::init<std::size_t>(), py::arg("capacity_bytes"))
      .def("try_allocate", &RingAllocator::try_allocate, py::arg("bytes"), py::arg("align") = 64)
      .def(
          "allocate",
          [](RingAllocator& r, std::size_t bytes, std::size_t align) {
            py::gil_scoped_release nogil;
            return r.allocate(bytes, align);
          },
          py::arg("bytes"), py::arg("align") = 64)
      .def("take_ticket", &RingAllocator::take_ticket)
      .def(
          "allocate_with_ticket",
          [](RingAllocator& r, std::uint64_t ticket, std::size_t bytes, std::size_t align) {
            py::gil_scoped_release nogil;
            return r.allocate_with_ticket(ticket, bytes, align);
          },
          py::arg("ticket"), py::arg("bytes"), py::arg("align") = 64)
      .def("try_allocate_with_ticket", &RingAllocator::try_allocate_with_ticket,
           py::arg("ticket"), py::arg("bytes"), py::arg("align") = 64)
      .def("release", &RingAllocator::release, py::arg("offset"),
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &RingAllocator::shutdown)
      .def_property_readonly("capacity", &RingAllocator::capacity)
      .def_property_readonly("used_bytes", &RingAllocator::used_bytes)
      .def_property_readonly("live_blocks", &RingAllocator::live_blocks);

  py::class_<EngineHandle>(m, "Engine")
      .def(py::init([](std::size_t cache_bytes, std::size_t chunk_bytes, int copy_threads,
                       int flush_threads, bool o_direct, bool prefault, bool checksums,
                       bool durable, int flush_nice, bool idle_priority, bool flush_idle) {
             EngineOptions o;
             o.cache_bytes = cache_bytes;
             o.chunk_bytes = chunk_bytes;
             o.copy_threads = copy_threads;
             o.flush_threads = flush_threads;
             o.o_direct = o_direct;
             o.prefault = prefault;
             o.checksums = checksums;
             o.durable = durable;
             o.flush_nice = flush_nice;
             o.idle_priority = idle_priority;
             o.flush_idle = flush_idle;
             return std::make_unique<EngineHandle>(o);
           }),
           py::arg("cache_bytes"), py::arg("chunk_bytes") = 64u << 20, py::arg("copy_threads") = 1,
           py::arg("flush_threads") = 2, py::arg("o_direct") = false, py::arg("prefault") = true,
           py::arg("checksums") = true, py::arg("durable") = true, py::arg("flush_nice") = 5,
           py::arg("idle_priority") = false, py::arg("flush_idle") = false)
      .def("close", &EngineHandle::close)
      .def_property_readonly("closed", &EngineHandle::closed)
      .def_property_readonly("owner_pid", &EngineHandle::owner_pid,
                             "The process that created the engine (a forked child cannot use it).")
      .def_property_readonly("cache_bytes", [](EngineHandle& h) { return h.get().cache_bytes(); })
      .def_property_readonly("chunk_bytes", [](EngineHandle& h) { return h.get().chunk_bytes(); })
      .def_property_readonly("cache_address", [](EngineHandle& h) {
        return reinterpret_cast<std::uintptr_t>(h.get().cache_data());
      })
      .def("cache_view",
           [](EngineHandle& h) {
             Engine& e = h.get();
             return py::memoryview::from_memory(e.cache_data(),
                                                static_cast<py::ssize_t>(e.cache_bytes()), false);
           },
           "A writable memoryview of the whole host cache; invalid after close().")
      .def("enable_cuda",
           [](EngineHandle& h, const std::string& path, bool batch_copies) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             e.enable_cuda(path, batch_copies);
           },
           py::arg("runtime_path") = "", py::arg("batch_copies") = true)
      .def_property_readonly("cuda_enabled", [](EngineHandle& h) { return h.get().cuda_enabled(); })
      .def_property_readonly("cache_pinned", [](EngineHandle& h) { return h.get().cache_pinned(); })
      .def_property_readonly("pin_error", [](EngineHandle& h) { return h.get().pin_error(); },
                             "Why enable_cuda() left the cache pageable (\"\" if pinned).")
      .def_property_readonly("cuda_batch_error",
                             [](EngineHandle& h) { return h.get().cuda_batch_error(); },
                             "Why device copies are not batched (\"\" if they are).")
      .def("create_job", [](EngineHandle& h, const std::string& label) {
        return h.get().create_job(label);
      })
      .def("add_entry",
           [](EngineHandle& h, std::uint64_t job, const std::string& name, std::uintptr_t src,
              std::size_t bytes, int device, std::uintptr_t ready_event, bool direct) {
             return h.get().add_entry(job, name, src, bytes, device, ready_event, direct);
           },
           py::arg("job"), py::arg("name"), py::arg("src"), py::arg("bytes"),
           py::arg("device") = -1, py::arg("ready_event") = 0, py::arg("direct") = false)
      .def("add_entries",
           [](EngineHandle& h, std::uint64_t job, const std::vector<std::string>& names,
              const std::vector<std::uintptr_t>& srcs, const std::vector<std::size_t>& bytes,
              const std::vector<int>& devices, const std::vector<std::uintptr_t>& ready_events,
              const std::vector<std::uint8_t>& direct) {
             return h.get().add_entries(job, names, srcs, bytes, devices, ready_events, direct);
           },
           py::arg("job"), py::arg("names"), py::arg("srcs"), py::arg("bytes"),
           py::arg("devices"), py::arg("ready_events"), py::arg("direct"),
           "add_entry for a batch (one lock); returns the first new entry's index.")
      .def("capture_now_many",
           [](EngineHandle& h, std::uint64_t job, const std::vector<std::uint32_t>& entries) {
             Engine& e = h.get();
             std::vector<std::uint8_t> taken;
             {
               py::gil_scoped_release nogil;
               taken = e.capture_now_many(job, entries);
             }
             return py::bytes(reinterpret_cast<const char*>(taken.data()), taken.size());
           },
           py::arg("job"), py::arg("entries"),
           "capture_now(wait=False) for each entry (GIL released); bytes: 1 taken, 0 no room.")
      .def("start_copies", [](EngineHandle& h, std::uint64_t job) { h.get().start_copies(job); })
      .def("reserve",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, bool wait) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.reserve(job, entry, wait);
           },
           py::arg("job"), py::arg("entry"), py::arg("wait") = false,
           "Reserves cache space for a host entry the caller copies itself; [] if no room "
           "(wait=False). The caller must call land() afterwards (GIL released while waiting).")
      .def("capture_now",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, bool wait) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.capture_now(job, entry, wait);
           },
           py::arg("job"), py::arg("entry"), py::arg("wait") = false,
           "Copies a contiguous host entry into the cache now (GIL released); False if no room "
           "and not wait.")
      .def("land",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, bool ok,
              const std::string& error, double busy_s) {
             h.get().land(job, entry, ok, error, busy_s);
           },
           py::arg("job"), py::arg("entry"), py::arg("ok") = true, py::arg("error") = "",
           py::arg("busy_s") = 0.0)
      .def("retarget",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, std::uintptr_t src,
              bool direct) { h.get().retarget(job, entry, src, direct); })
      .def("open_file",
           [](EngineHandle& h, std::uint64_t job, const std::string& path,
              const std::string& anon_dir) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.open_file(job, path, anon_dir);
           },
           py::arg("job"), py::arg("path"), py::arg("anon_dir") = "",
           "Creates the data file `path`, or (anon_dir given) an unnamed file in anon_dir that "
           "the caller links under `path` through dup_fd().")
      .def("link_file", [](EngineHandle& h, std::uint64_t job, std::int32_t file) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             e.link_file(job, file);
           },
           "Names an unnamed data file of the job (opened with anon_dir) at its path.")
      .def("dup_fd", [](EngineHandle& h, std::uint64_t job, std::int32_t file) {
             return h.get().dup_fd(job, file);
           },
           "A new descriptor (O_CLOEXEC) of an open data file of the job; the caller closes it.")
      .def("place",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, std::int32_t file,
              std::uint64_t payload_offset, const py::bytes& header, const py::bytes& trailer) {
             h.get().place(job, entry, file, payload_offset, std::string(header),
                           std::string(trailer));
           })
      .def("place_external", [](EngineHandle& h, std::uint64_t job,
                                std::uint32_t entry) { h.get().place_external(job, entry); })
      .def("skip", [](EngineHandle& h, std::uint64_t job, std::uint32_t entry) {
        h.get().skip(job, entry);
      })
      .def("write_bytes",
           [](EngineHandle& h, std::uint64_t job, std::int32_t file, std::uint64_t offset,
              const py::bytes& data, const std::string& name) {
             h.get().write_bytes(job, file, offset, std::string(data), name);
           },
           py::arg("job"), py::arg("file"), py::arg("offset"), py::arg("data"), py::arg("name") = "")
      .def("seal", [](EngineHandle& h, std::uint64_t job) { h.get().seal(job); })
      .def("chunk_count", [](EngineHandle& h, std::uint64_t job, std::uint32_t entry) {
        return h.get().chunk_count(job, entry);
      })
      .def("wait_chunk",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, std::uint32_t chunk) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.wait_chunk(job, entry, chunk);
           })
      .def("release_chunk",
           [](EngineHandle& h, std::uint64_t job, std::uint32_t entry, std::uint32_t chunk) {
             h.get().release_chunk(job, entry, chunk);
           })
      .def("wait_captured",
           [](EngineHandle& h, std::uint64_t job, double timeout_s) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.wait_captured(job, timeout_s);
           },
           py::arg("job"), py::arg("timeout_s") = -1.0)
      .def("help_until_captured",
           [](EngineHandle& h, std::uint64_t job, double timeout_s) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.help_until_captured(job, timeout_s);
           },
           py::arg("job"), py::arg("timeout_s") = -1.0)
      .def("wait_done",
           [](EngineHandle& h, std::uint64_t job, double timeout_s) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             return e.wait_done(job, timeout_s);
           },
           py::arg("job"), py::arg("timeout_s") = -1.0)
      .def("is_captured", [](EngineHandle& h, std::uint64_t job) { return h.get().is_captured(job); })
      .def("is_done", [](EngineHandle& h, std::uint64_t job) { return h.get().is_done(job); })
      .def("abort", [](EngineHandle& h, std::uint64_t job, const std::string& reason) {
        h.get().abort(job, reason);
      })
      .def("forget",
           [](EngineHandle& h, std::uint64_t job) {
             Engine& e = h.get();
             py::gil_scoped_release nogil;
             e.forget(job);
           })
      .def("chunk_records",
           [](EngineHandle& h, std::uint64_t job) {
             py::list out;
             for (const auto& r : h.get().chunk_records(job)) {
               out.append(py::make_tuple(r.entry, r.chunk, r.file, r.file_offset, r.entry_offset,
                                         r.bytes, r.crc32c));
             }
             return out;
           },
           "(entry, chunk, file, file_offset, entry_offset, bytes, crc32c) per written chunk.")
      .def("stats", [](EngineHandle& h, std::uint64_t job) { return stats_to_dict(h.get().stats(job)); })
      .def("counters",
           [](EngineHandle& h) {
             const auto c = h.get().counters();
             py::dict d;
             d["cache_bytes"] = c.cache_bytes;
             d["cache_used_bytes"] = c.cache_used_bytes;
             d["live_blocks"] = c.live_blocks;
             d["jobs"] = c.jobs;
             d["open_files"] = c.open_files;
             d["pending_copies"] = c.pending_copies;
             d["pending_flushes"] = c.pending_flushes;
             d["helped_copies"] = c.helped_copies;
             d["boosts"] = c.boosts;
             d["boost_refused"] = c.boost_refused;
             d["boost_available"] = c.boost_available;
             d["cuda_copy_calls"] = c.cuda_copy_calls;
             d["cuda_batch_calls"] = c.cuda_batch_calls;
             d["cuda_batch_copies"] = c.cuda_batch_copies;
             d["cuda_batch"] = c.cuda_batch;
             return d;
           })
      .def("pause_copies", [](EngineHandle& h, bool p) { h.get().pause_copies(p); },
           "Test hook: holds the copy threads before their next chunk.")
      .def("set_delays",
           [](EngineHandle& h, int copy_us, int flush_us, std::uint64_t seed) {
             h.get().set_delays(copy_us, flush_us, seed);
           },
           py::arg("copy_delay_us_max"), py::arg("flush_delay_us_max"), py::arg("seed") = 0,
           "Test hook: random sleeps before each copy and flush, to shake out races.");
}
