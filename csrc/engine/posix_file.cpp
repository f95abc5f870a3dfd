#include "posix_file.hpp"

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <utility>

#include "error.hpp"

namespace dcpds {
namespace {

std::mutex g_fault_mu;
std::string g_fault_needle;
int g_fault_errno = 0;

void maybe_inject_fault(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_fault_mu);
  if (!g_fault_needle.empty() && path.find(g_fault_needle) != std::string::npos) {
    DCPDS_CHECK(false, errno_message("write to " + path + " failed (injected fault)", g_fault_errno));
  }
}

}  // namespace

void set_write_fault(const std::string& needle, int err) {
  std::lock_guard<std::mutex> lock(g_fault_mu);
  g_fault_needle = needle;
  g_fault_errno = err;
}

PosixFile::PosixFile(std::string path, bool o_direct, const std::string& anon_dir,
                     std::uint64_t writeback_kick)
    : path_(std::move(path)), writeback_kick_(writeback_kick) {
  if (anon_dir.empty()) {
    // O_NOFOLLOW: a symlink planted under a data file's name is refused (ELOOP), never followed.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) DCPDS_CHECK(false, errno_message("cannot create " + path_, errno));
  } else {
#ifdef O_TMPFILE
    fd_ = ::open(anon_dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);  // readable: copy_into
    if (fd_ < 0)
      DCPDS_CHECK(false, errno_message("cannot create an unnamed file in " + anon_dir + " for " +
                                           path_, errno));
#else
    DCPDS_CHECK(false, "unnamed files (O_TMPFILE) are not supported on this system");
#endif
  }
#ifdef O_DIRECT
  if (o_direct) {
    // tmpfs and some network file systems refuse O_DIRECT: fall back to buffered writes. An
    // unnamed file is reopened through /proc (a new open file description of the same inode).
    const std::string reopen =
        anon_dir.empty() ? path_ : "/proc/self/fd/" + std::to_string(fd_);
    fd_direct_ = ::open(reopen.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC |
                                            (anon_dir.empty() ? O_NOFOLLOW : 0));
  }
#else
  (void)o_direct;
#endif
}

void PosixFile::link() {
  DCPDS_CHECK(fd_ >= 0, "data file " + path_ + " is closed");
  const std::string src = "/proc/self/fd/" + std::to_string(fd_);
  if (::linkat(AT_FDCWD, src.c_str(), AT_FDCWD, path_.c_str(), AT_SYMLINK_FOLLOW) == 0) return;
  if (errno == EEXIST && ::unlink(path_.c_str()) == 0 &&
      ::linkat(AT_FDCWD, src.c_str(), AT_FDCWD, path_.c_str(), AT_SYMLINK_FOLLOW) == 0)
    return;
  DCPDS_CHECK(false, errno_message("cannot link the data file " + path_, errno));
}

int PosixFile::dup_fd() const {
  DCPDS_CHECK(fd_ >= 0, "data file " + path_ + " is closed");
  const int fd = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) DCPDS_CHECK(false, errno_message("cannot duplicate the descriptor of " + path_, errno));
  return fd;
}

PosixFile::~PosixFile() { close(); }

void PosixFile::maybe_kick_writeback(std::uint64_t bytes) {
  if (writeback_kick_ == 0) return;
  if (unkicked_.fetch_add(bytes) + bytes < writeback_kick_) return;
  unkicked_.store(0);
#ifdef SYNC_FILE_RANGE_WRITE
  // Whole file: pages already under writeback are skipped. A failure here is not an error (the
  // final fdatasync reports what matters).
  (void)::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
}

void PosixFile::write_at(std::uint64_t offset, const std::vector<iovec>& iov_in) {
  maybe_inject_fault(path_);
  std::vector<iovec> iov;
  iov.reserve(iov_in.size());
  std::uint64_t total = 0;
  for (const auto& v : iov_in)
    if (v.iov_len > 0) {
      iov.push_back(v);
      total += v.iov_len;
    }
  std::size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::pwritev(fd_, iov.data() + first, count, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      DCPDS_CHECK(false, errno_message("write of " + path_ + " at offset " +
                                           std::to_string(offset) + " failed",
                                       errno));
    }
    DCPDS_CHECK(n > 0, "write of " + path_ + " made no progress");
    offset += static_cast<std::uint64_t>(n);
    std::size_t left = static_cast<std::size_t>(n);
    while (left > 0 && first < iov.size()) {
      if (left >= iov[first].iov_len) {
        left -= iov[first].iov_len;
        ++first;
      } else {
        iov[first].iov_base = static_cast<std::uint8_t*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
        left = 0;
      }
    }
  }
  maybe_kick_writeback(total);
}

void PosixFile::write_payload_at(std::uint64_t offset, const std::uint8_t* data, std::size_t bytes) {
  if (fd_direct_ >= 0 && offset % kDirectAlign == 0 &&
      reinterpret_cast<std::uintptr_t>(data) % kDirectAlign == 0 && bytes >= kDirectMinBytes) {
    maybe_inject_fault(path_);
    const std::size_t aligned = bytes / kDirectAlign * kDirectAlign;
    std::size_t done = 0;
    while (done < aligned) {
      const ssize_t n = ::pwrite(fd_direct_, data + done, aligned - done,
                                 static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        DCPDS_CHECK(false, errno_message("O_DIRECT write of " + path_ + " at offset " +
                                             std::to_string(offset + done) + " failed",
                                         errno));
      }
      DCPDS_CHECK(n > 0, "write of " + path_ + " made no progress");
      done += static_cast<std::size_t>(n);
    }
    if (aligned == bytes) return;
    data += aligned;
    offset += aligned;
    bytes -= aligned;
  }
  write_at(offset, {iovec{const_cast<std::uint8_t*>(data), bytes}});
}

void PosixFile::sync() {
  if (fd_ >= 0 && ::fdatasync(fd_) != 0)
    DCPDS_CHECK(false, errno_message("fdatasync of " + path_ + " failed", errno));
  if (fd_direct_ >= 0 && ::fdatasync(fd_direct_) != 0)
    DCPDS_CHECK(false, errno_message("fdatasync of " + path_ + " failed", errno));
}

void PosixFile::close() {
  if (fd_direct_ >= 0) ::close(fd_direct_);
  if (fd_ >= 0) ::close(fd_);
  fd_direct_ = fd_ = -1;
}

}  // namespace dcpds
