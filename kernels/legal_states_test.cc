#include "kernels/legal_states.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"

namespace kvcache::kernels {
namespace {

constexpr BlockShape kShape = {2, 2, 32, 32};

CodecPolicy Policy(Codec codec) {
  CodecPolicy p;
  p.codec = codec;
  return p;
}

std::vector<uint16_t> Source() {
  return testutil::MakeData(kShape, testutil::Data::kGaussian, 7);
}

TEST(LegalStatesTest, EachCodecAcceptsExactlyItsStates) {
  const std::vector<uint16_t> source = Source();
  for (Codec codec : kAllCodecs) {
    auto states = LegalStates::Make(kShape, Policy(codec), source);
    ASSERT_TRUE(states.ok()) << states.status();
    const bool kivi = codec == Codec::kKivi2 || codec == Codec::kKivi4;
    EXPECT_EQ(*states->Match(states->round_trip()), BlockState::kRoundTrip);
    absl::StatusOr<BlockState> as_source = states->Match(source);
    if (codec == Codec::kNone) {
      EXPECT_EQ(*as_source, BlockState::kRoundTrip);  // the same bytes
    } else if (kivi) {
      EXPECT_EQ(*as_source, BlockState::kSource) << CodecName(codec);
    } else {
      EXPECT_EQ(as_source.status().code(), absl::StatusCode::kDataLoss)
          << CodecName(codec) << ": fp8 blocks are never stored as fp16";
    }
  }
}

TEST(LegalStatesTest, OneWrongElementOrANonFiniteOneIsDataLoss) {
  const std::vector<uint16_t> source = Source();
  auto states = LegalStates::Make(kShape, Policy(Codec::kKivi2), source);
  ASSERT_TRUE(states.ok());
  std::vector<uint16_t> read = states->round_trip();
  read[1000] ^= 1;
  absl::StatusOr<BlockState> m = states->Match(read);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
  read[1000] = 0x7E00;  // NaN
  m = states->Match(read);
  EXPECT_NE(m.status().message().find("not finite"), std::string::npos)
      << m.status();
  EXPECT_EQ(CountNonFinite(read), 1u);
  // Half source, half round trip: a block mixing states is wrong.
  std::vector<uint16_t> mixed = source;
  std::copy(states->round_trip().begin(),
            states->round_trip().begin() + mixed.size() / 2, mixed.begin());
  EXPECT_EQ(states->Match(mixed).status().code(), absl::StatusCode::kDataLoss);
}

TEST(LegalStatesTest, SectionsMatchTheirPartOfTheBlock) {
  const std::vector<uint16_t> source = Source();
  auto states = LegalStates::Make(kShape, Policy(Codec::kFp8E4M3), source);
  ASSERT_TRUE(states.ok());
  const size_t section = 32 * 2 * 32;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      auto slice = absl::MakeConstSpan(states->round_trip())
                       .subspan((layer * 2 + kv) * section, section);
      EXPECT_EQ(*states->MatchSection(layer, kv, slice),
                BlockState::kRoundTrip);
      // The right bytes in the wrong section are wrong.
      EXPECT_FALSE(states->MatchSection(1 - layer, kv, slice).ok());
    }
  }
}

TEST(LegalStatesTest, RefusesWhatNoStoreWouldHold) {
  std::vector<uint16_t> source = Source();
  source[3] = 0x7C00;  // +inf
  EXPECT_EQ(LegalStates::Make(kShape, Policy(Codec::kFp8E4M3), source)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(LegalStates::Make(kShape, Policy(Codec::kNone),
                                 absl::MakeConstSpan(source).subspan(1))
                   .ok());
}

}  // namespace
}  // namespace kvcache::kernels
