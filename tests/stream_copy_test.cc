#include "base/stream_copy.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

// StreamCopy leaves the destination equal to the source and writes nothing
// around it, for lengths below, at and above kStreamCopyMinBytes, lengths
// that leave tails of several sizes under a 64-byte step, destinations at
// six offsets from a 16-byte boundary (the streamed part starts at the
// destination's first boundary) and sources at three.
TEST(StreamCopyTest, CopiesExactlyTheRangeAtEveryAlignment) {
  constexpr size_t kGuard = 64;
  constexpr uint8_t kGuardByte = 0xCD;
  std::mt19937 rng(7);
  std::vector<uint8_t> source(kStreamCopyMinBytes * 4 + 256);
  for (uint8_t& b : source) b = static_cast<uint8_t>(rng());
  size_t cases = 0;
  for (size_t length :
       {size_t{0}, size_t{1}, size_t{100}, kStreamCopyMinBytes - 1,
        kStreamCopyMinBytes, kStreamCopyMinBytes + 1, kStreamCopyMinBytes + 63,
        kStreamCopyMinBytes * 3 + 17, kStreamCopyMinBytes * 4}) {
    for (size_t dst_skew = 0; dst_skew < 16; dst_skew += 3) {
      for (size_t src_skew : {size_t{0}, size_t{5}, size_t{16}}) {
        std::vector<uint8_t> dest(length + 2 * kGuard + 16, kGuardByte);
        uint8_t* at = dest.data() + kGuard;
        at += (16 - reinterpret_cast<uintptr_t>(at) % 16) % 16 + dst_skew;
        StreamCopy(at, source.data() + src_skew, length);
        StreamCopyFence();
        ASSERT_EQ(std::memcmp(at, source.data() + src_skew, length), 0)
            << length << " bytes, skews " << dst_skew << " " << src_skew;
        for (uint8_t* p = dest.data(); p < at; ++p) {
          ASSERT_EQ(*p, kGuardByte) << "before, " << length << " bytes";
        }
        for (uint8_t* p = at + length; p < dest.data() + dest.size(); ++p) {
          ASSERT_EQ(*p, kGuardByte) << "after, " << length << " bytes";
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, size_t{9 * 6 * 3});
}

}  // namespace
}  // namespace kvcache
