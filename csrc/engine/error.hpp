// Error type of the engine and the check macro that raises it.
//
// Contract: every failure inside the engine is reported by throwing EngineError (never abort,
// exit or print). Worker threads catch it, latch the first error of the job it belongs to, and
// the caller's thread re-raises it at the next wait. The message names what failed (path, entry)
// and where in the engine (file:line).
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>

namespace dcpds {

class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& what);

// Builds "what: strerror(errno)".
std::string errno_message(const std::string& what, int err);

}  // namespace dcpds

#define DCPDS_CHECK(cond, msg)                                   \
  do {                                                           \
    if (!(cond)) ::dcpds::throw_error(__FILE__, __LINE__, (msg)); \
  } while (0)
