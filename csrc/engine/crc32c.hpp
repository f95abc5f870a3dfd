// CRC-32C (Castagnoli), the checksum recorded per chunk in the checkpoint manifest.
// Uses the SSE4.2 crc32 instruction when the CPU has it (three interleaved chains on large
// buffers), a table-driven loop otherwise; both give the same value. Thread-safe, no allocation.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcpds {

// Extends `crc` (0 for a fresh checksum) over [data, data + bytes).
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t bytes);

// The CRC of A followed by B, from crc(A), crc(B) and B's length.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t bytes_b);

}  // namespace dcpds
