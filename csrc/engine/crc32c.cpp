#include "crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace dcpds {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  Tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

std::uint32_t crc32c_portable(std::uint32_t crc, const std::uint8_t* p, std::size_t n) {
  static const Tables tables;
  const auto& t = tables.t;
  crc = ~crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^
          t[4][(v >> 24) & 0xFF] ^ t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^
          t[1][(v >> 48) & 0xFF] ^ t[0][(v >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

// Multiplication modulo the CRC polynomial in the reflected representation (bit 31 is x^0).
std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8 * bytes) modulo the polynomial: the operator that shifts a CRC over `bytes` zero bytes.
std::uint32_t x8nmodp(std::size_t bytes) {
  static const std::array<std::uint32_t, 64> x2n = [] {  // x^(2^k)
    std::array<std::uint32_t, 64> t{};
    std::uint32_t p = 1u << 30;  // x^1
    for (auto& v : t) {
      v = p;
      p = multmodp(p, p);
    }
    return t;
  }();
  std::uint32_t p = 1u << 31;  // x^0
  int k = 3;                   // 8 * bytes = bytes << 3
  while (bytes) {
    if (bytes & 1) p = multmodp(x2n[static_cast<std::size_t>(k & 63)], p);
    bytes >>= 1;
    ++k;
  }
  return p;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint64_t crc32c_sse42_raw(std::uint64_t c,
                                                                const std::uint8_t* p,
                                                                std::size_t n) {
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
  return c;
}

// Three independent crc32 chains over three thirds of the buffer keep the CPU's crc unit busy
// (one chain is bound by the instruction's latency); the thirds are then combined.
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc,
                                                            const std::uint8_t* p,
                                                            std::size_t n) {
  constexpr std::size_t kMinInterleaved = 3 * 4096;
  if (n < kMinInterleaved) return ~static_cast<std::uint32_t>(crc32c_sse42_raw(~crc, p, n));
  const std::size_t lane = n / 3 / 8 * 8;
  std::uint64_t a = ~crc, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
  const std::uint8_t* pa = p;
  const std::uint8_t* pb = p + lane;
  const std::uint8_t* pc = p + 2 * lane;
  for (std::size_t i = 0; i < lane; i += 8) {
    std::uint64_t va, vb, vc;
    std::memcpy(&va, pa + i, 8);
    std::memcpy(&vb, pb + i, 8);
    std::memcpy(&vc, pc + i, 8);
    a = _mm_crc32_u64(a, va);
    b = _mm_crc32_u64(b, vb);
    c = _mm_crc32_u64(c, vc);
  }
  c = crc32c_sse42_raw(c, pc + lane, n - 3 * lane);  // the tail of the last third
  const std::uint32_t ca = ~static_cast<std::uint32_t>(a);
  const std::uint32_t cb = ~static_cast<std::uint32_t>(b);
  const std::uint32_t cc = ~static_cast<std::uint32_t>(c);
  const std::uint32_t ab = crc32c_combine(ca, cb, lane);
  return crc32c_combine(ab, cc, n - 2 * lane);
}
#endif

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t bytes_b) {
  return multmodp(x8nmodp(bytes_b), crc_a) ^ crc_b;
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const std::uint8_t*>(data);
#if defined(__x86_64__)
  static const bool have_sse42 = __builtin_cpu_supports("sse4.2");
  if (have_sse42) return crc32c_sse42(crc, p, bytes);
#endif
  return crc32c_portable(crc, p, bytes);
}

}  // namespace dcpds
