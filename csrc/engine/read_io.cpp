#include "read_io.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "crc32c.hpp"
#include "error.hpp"

namespace dcpds::read_io {
namespace {

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

OpenFile::~OpenFile() {
  if (fd >= 0) ::close(fd);
  if (fd_direct >= 0) ::close(fd_direct);
}

void check_spans(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                 const std::vector<std::string>& names) {
  for (const ReadSpan& s : spans) {
    DCPDS_CHECK(s.file < paths.size(), "read span names file " + std::to_string(s.file) +
                                           " of " + std::to_string(paths.size()));
    DCPDS_CHECK(s.name < names.size(), "read span names an unknown item");
    DCPDS_CHECK(s.bytes == 0 || s.dst != 0, "'" + names[s.name] + "': null destination");
  }
}

OpenFiles open_files(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                     const std::vector<std::string>& names, bool o_direct) {
  OpenFiles files(paths.size());
  for (const ReadSpan& s : spans) {
    if (files[s.file]) continue;
    auto f = std::make_unique<OpenFile>();
    f->path = paths[s.file];
    f->fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd < 0)
      DCPDS_CHECK(false, errno_message("'" + names[s.name] + "': cannot open " + f->path, errno));
#ifdef O_DIRECT
    if (o_direct) {
      f->fd_direct = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      f->direct_ok.store(f->fd_direct >= 0);
    }
#else
    (void)o_direct;
#endif
    files[s.file] = std::move(f);
  }
  return files;
}

std::vector<Piece> split_pieces(const std::vector<ReadSpan>& spans, std::size_t block,
                                std::vector<std::size_t>& first) {
  std::vector<Piece> pieces;
  first.assign(spans.size() + 1, 0);
  for (std::uint32_t i = 0; i < spans.size(); ++i) {
    first[i] = pieces.size();
    const ReadSpan& s = spans[i];
    std::uint64_t pos = 0;
    while (pos < s.bytes) {
      // Cut at block boundaries of the file, so that aligned spans give aligned pieces.
      const std::uint64_t file_pos = s.offset + pos;
      const std::uint64_t next = (file_pos / block + 1) * block;
      const std::uint64_t n = std::min<std::uint64_t>(next - file_pos, s.bytes - pos);
      pieces.push_back(Piece{i, pos, n});
      pos += n;
    }
  }
  first[spans.size()] = pieces.size();
  return pieces;
}

std::uint64_t verify_crcs(const std::vector<std::string>& paths, const std::vector<ReadSpan>& spans,
                          const std::vector<std::string>& names, const std::vector<Piece>& pieces,
                          const std::vector<std::size_t>& first,
                          const std::vector<std::uint32_t>& crcs) {
  std::uint64_t verified = 0;
  for (std::uint32_t i = 0; i < spans.size(); ++i) {
    const ReadSpan& s = spans[i];
    if (s.crc < 0) continue;
    std::uint32_t crc = 0;
    for (std::size_t pi = first[i]; pi < first[i + 1]; ++pi)
      crc = pi == first[i] ? crcs[pi] : crc32c_combine(crc, crcs[pi], pieces[pi].bytes);
    const auto expected = static_cast<std::uint32_t>(s.crc);
    if (crc != expected) {
      DCPDS_CHECK(false, "checksum mismatch in '" + names[s.name] + "' (" + paths[s.file] + ", " +
                             range_text(s.offset, s.offset + s.bytes) + "): the manifest records " +
                             hex32(expected) + ", the file holds " + hex32(crc) +
                             ": the checkpoint is damaged");
    }
    verified += s.bytes;
  }
  return verified;
}

long long pread_full(int fd, std::uint8_t* dst, std::size_t bytes, std::uint64_t offset,
                     bool direct) {
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t r = ::pread(fd, dst + got, bytes - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<long long>(errno);
    }
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
    // An O_DIRECT read that stops short of an aligned boundary has met the end of the file.
    if (direct && got % kAlign != 0) break;
  }
  return static_cast<long long>(got);
}

std::string range_text(std::uint64_t a, std::uint64_t b) {
  return "bytes [" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

std::string read_failed_message(const std::string& name, const std::string& path,
                                std::uint64_t a, std::uint64_t b, int err) {
  return errno_message("'" + name + "': read of " + path + " (" + range_text(a, b) + ") failed",
                       err);
}

std::string truncated_message(const std::string& name, const std::string& path, long long at,
                              std::uint64_t a, std::uint64_t b) {
  return "'" + name + "': " + path + " ends at byte " + std::to_string(at) +
         ", inside its data (" + range_text(a, b) + "): the file is truncated";
}

}  // namespace dcpds::read_io
