// The gather-copy kernel's per-thread body (src/providers/cuda_ipc/gather_copy_impl.h) on the CPU,
// thread by thread: for every pair of source and destination alignments modulo 16 and lengths
// around every word, unroll and block boundary, exactly the bytes asked for are copied and the
// bytes around them are untouched. (The GPU runs the same code; tests/gpu checks it there.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "providers/cuda_ipc/gather_copy_impl.h"

namespace fabric {
namespace {

struct alignas(16) Host16 {
  uint64_t a, b;
};

// Copies with `threads` simulated threads; false (and a message) on the first wrong byte.
bool copy_checked(uint64_t len, unsigned src_mod, unsigned dst_mod, uint32_t threads, std::string& why) {
  constexpr size_t kGuard = 64;
  std::vector<uint8_t> src(len + 2 * kGuard + 16), dst(len + 2 * kGuard + 16, 0xEE);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 131 + 7);
  auto align16 = [](std::vector<uint8_t>& v) {
    return v.data() + (16 - reinterpret_cast<uintptr_t>(v.data()) % 16) % 16;
  };
  const uint8_t* s = align16(src) + kGuard / 2 + src_mod;
  uint8_t* t = align16(dst) + kGuard / 2 + dst_mod;
  for (uint32_t tid = 0; tid < threads; tid++)
    cuda::gather::copy_one<Host16, uint64_t>(s, t, len, tid, threads);
  for (size_t i = 0; i < dst.size(); i++) {
    const uint8_t* p = dst.data() + i;
    bool inside = p >= t && p < t + len;
    uint8_t want = inside ? s[p - t] : 0xEE;
    if (dst[i] != want) {
      why = "len " + std::to_string(len) + " src%16 " + std::to_string(src_mod) + " dst%16 " +
            std::to_string(dst_mod) + " threads " + std::to_string(threads) + ": byte " +
            std::to_string(p - t) + (inside ? " not copied right" : " outside the copy written");
      return false;
    }
  }
  return true;
}

TEST(GatherCopy, EveryAlignmentPairAndSmallLengthCopiesExactly) {
  std::string why;
  for (uint64_t len = 0; len <= 80; len++)
    for (unsigned sm = 0; sm < 16; sm++)
      for (unsigned dm = 0; dm < 16; dm++) ASSERT_TRUE(copy_checked(len, sm, dm, 256, why)) << why;
}

TEST(GatherCopy, LengthsAroundUnrollAndBlockBoundariesCopyExactly) {
  std::string why;
  // 256 threads x 4 loads x 16 bytes = 16 KiB per pass; pages of 64 KiB + 4 as in the GPU test.
  const uint64_t lens[] = {255, 256, 257, 4095, 4096, 4097, 16383, 16384, 16385, 16400,
                           32768 + 15, 65535, 65536, 65540, 65549, 100003};
  const unsigned mods[][2] = {{0, 0}, {3, 3}, {15, 15}, {0, 8}, {8, 0}, {4, 12}, {2, 6}, {1, 2}, {7, 0}, {0, 1}};
  for (uint64_t len : lens)
    for (auto& m : mods) {
      ASSERT_TRUE(copy_checked(len, m[0], m[1], 256, why)) << why;
      ASSERT_TRUE(copy_checked(len, m[0], m[1], 32, why)) << why;  // more passes per thread
    }
}

}  // namespace
}  // namespace fabric
