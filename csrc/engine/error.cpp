#include "error.hpp"

#include <cstring>

namespace dcpds {

void throw_error(const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  throw EngineError(what + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

std::string errno_message(const std::string& what, int err) {
  char buf[256];
  // GNU strerror_r returns a char* that may or may not point into buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return what + ": " + s + " (errno " + std::to_string(err) + ")";
}

}  // namespace dcpds
