// The CUDA codecs against the scalar reference, byte for byte, for fp16 and
// bf16 sources. Skipped (not passed) where no CUDA device is present; the
// argument checks run anywhere.
#include "kernels/cuda/codec_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/codec_test_util.h"
#include "kernels/half.h"

namespace kvcache::kernels::cuda {
namespace {

using ::testing::HasSubstr;
using testutil::Data;
using testutil::Describe;
using testutil::MakeData;
using testutil::Policies;
using testutil::ShapeCase;
using testutil::Shapes;

// A device buffer holding a copy of a host vector.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(1, n * sizeof(T))),
              cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host)
      : DeviceBuffer(host.size()) {
    EXPECT_EQ(
        cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return static_cast<T*>(ptr_); }
  std::vector<T> ToHost() const {
    std::vector<T> v(n_);
    EXPECT_EQ(
        cudaMemcpy(v.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
        cudaSuccess);
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

class CudaCodecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
    RecordProperty("device", CudaDeviceDescription());
  }
};

TEST(CudaCodecArgsTest, RejectsBadArgumentsWithoutTouchingTheDevice) {
  const BlockShape shape{2, 2, 64, 32};
  CodecPolicy p;
  p.codec = Codec::kFp8E4M3;
  uint16_t* in_ptrs[2] = {reinterpret_cast<uint16_t*>(8),
                          reinterpret_cast<uint16_t*>(16)};
  uint8_t* out_ptrs[2] = {reinterpret_cast<uint8_t*>(8), nullptr};
  const uint16_t* const_in[2] = {in_ptrs[0], in_ptrs[1]};
  const uint8_t* const_out[2] = {out_ptrs[0], out_ptrs[1]};
  // Mismatched batch sizes.
  EXPECT_EQ(EncodeBlocksCuda(shape, p, absl::MakeConstSpan(const_in, 2),
                             absl::MakeConstSpan(out_ptrs, 1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Null output pointer.
  EXPECT_THAT(
      std::string(EncodeBlocksCuda(shape, p, absl::MakeConstSpan(const_in, 2),
                                   absl::MakeConstSpan(out_ptrs, 2))
                      .message()),
      HasSubstr("output pointer 1 is null"));
  EXPECT_EQ(DecodeBlocksCuda(shape, p, absl::MakeConstSpan(const_out, 2),
                             absl::MakeConstSpan(in_ptrs, 2))
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Invalid policy.
  CodecPolicy bad;
  bad.codec = Codec::kKivi2;
  bad.kivi_group_size = 3;
  EXPECT_THAT(
      std::string(EncodeBlocksCuda(shape, bad, absl::MakeConstSpan(const_in, 1),
                                   absl::MakeConstSpan(out_ptrs, 1))
                      .message()),
      HasSubstr("must divide"));
  // An empty batch is a no-op.
  EXPECT_TRUE(EncodeBlocksCuda(shape, p, {}, {}).ok());
}

TEST(CudaCodecArgsTest, DeviceCountIsNeverAnError) {
  const int n = CudaDeviceCount();
  EXPECT_GE(n, 0);
  EXPECT_EQ(CudaAvailable(), n > 0);
}

// Batches of three blocks with different data, every shape, policy and data
// kind of the SIMD test, encode and decode compared with the reference; the
// blocks' source dtype is `dtype`.
void CheckBatchesMatchReference(SourceDtype dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  size_t blocks = 0;
  for (ShapeCase sc : Shapes()) {
    sc.shape.source_dtype = dtype;
    for (const CodecPolicy& p : Policies(sc.shape, sc.group, rng)) {
      if (!ValidatePolicy(sc.shape, p).ok()) continue;
      const size_t bytes = EncodedBlockBytes(sc.shape, p);
      for (int kind = 0; kind < testutil::kNumDataKinds; ++kind) {
        std::vector<std::vector<uint16_t>> in;
        std::vector<std::vector<uint8_t>> ref;
        std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> d_in, d_out16;
        std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> d_enc;
        std::vector<const uint16_t*> in_ptrs;
        std::vector<uint8_t*> enc_ptrs;
        std::vector<const uint8_t*> enc_const;
        std::vector<uint16_t*> out_ptrs;
        for (int b = 0; b < 3; ++b) {
          in.push_back(testutil::MakeSourceData(sc.shape, kind,
                                                static_cast<uint32_t>(rng())));
          ref.emplace_back(bytes);
          ASSERT_TRUE(EncodeBlockReference(sc.shape, p, in.back(),
                                           absl::MakeSpan(ref.back()))
                          .ok());
          d_in.push_back(std::make_unique<DeviceBuffer<uint16_t>>(in.back()));
          d_enc.push_back(std::make_unique<DeviceBuffer<uint8_t>>(bytes));
          d_out16.push_back(
              std::make_unique<DeviceBuffer<uint16_t>>(in.back().size()));
          in_ptrs.push_back(d_in.back()->get());
          enc_ptrs.push_back(d_enc.back()->get());
          enc_const.push_back(d_enc.back()->get());
          out_ptrs.push_back(d_out16.back()->get());
        }
        ASSERT_TRUE(EncodeBlocksCuda(sc.shape, p, in_ptrs, enc_ptrs).ok())
            << Describe(sc.shape, p);
        for (int b = 0; b < 3; ++b) {
          const std::vector<uint8_t> got = d_enc[b]->ToHost();
          for (size_t i = 0; i < bytes; ++i) {
            ASSERT_EQ(got[i], ref[b][i])
                << "encode byte " << i << " of block " << b << " "
                << Describe(sc.shape, p) << " data " << static_cast<int>(kind);
          }
        }
        // Decode the reference bytes (already on the device: they match).
        ASSERT_TRUE(DecodeBlocksCuda(sc.shape, p, enc_const, out_ptrs).ok());
        for (int b = 0; b < 3; ++b) {
          std::vector<uint16_t> want(in[b].size());
          ASSERT_TRUE(
              DecodeBlockReference(sc.shape, p, ref[b], absl::MakeSpan(want))
                  .ok());
          const std::vector<uint16_t> got = d_out16[b]->ToHost();
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(got[i], want[i])
                << "decode value " << i << " of block " << b << " "
                << Describe(sc.shape, p) << " data " << static_cast<int>(kind);
          }
        }
        blocks += 3;
      }
    }
  }
  EXPECT_GT(blocks, size_t{1500});
}

TEST_F(CudaCodecTest, EncodeAndDecodeMatchReferenceBitForBit) {
  CheckBatchesMatchReference(SourceDtype::kFp16, 4321);
}

// bf16 sources (docs/codecs.md): the same, on bf16 data of every kind
// (subnormals, magnitudes up to just below 2^126, constant groups, ±0).
TEST_F(CudaCodecTest, Bf16EncodeAndDecodeMatchReferenceBitForBit) {
  CheckBatchesMatchReference(SourceDtype::kBf16, 8642);
}

// Arbitrary fp8 codes (NaN and infinity codes included) and KIVI codes with
// finite metadata decode the same; the blocks' source dtype is `dtype`.
void CheckArbitraryDecodeMatchesReference(SourceDtype dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  for (ShapeCase sc : Shapes()) {
    sc.shape.source_dtype = dtype;
    for (const CodecPolicy& p : Policies(sc.shape, sc.group, rng)) {
      if (!ValidatePolicy(sc.shape, p).ok()) continue;
      // Start from a real encoding (sane scales and metadata), then
      // randomize the codes.
      const std::vector<uint16_t> in =
          testutil::MakeSourceData(sc.shape, static_cast<int>(Data::kGaussian),
                                   static_cast<uint32_t>(rng()));
      std::vector<uint8_t> enc(EncodedBlockBytes(sc.shape, p));
      ASSERT_TRUE(
          EncodeBlockReference(sc.shape, p, in, absl::MakeSpan(enc)).ok());
      const size_t n = size_t{sc.shape.tokens_per_block} *
                       sc.shape.num_kv_heads * sc.shape.head_dim;
      size_t off = 0;
      for (uint32_t l = 0; l < sc.shape.num_layers; ++l) {
        const bool skip = !p.fp16_layers.empty() && p.fp16_layers[0] == l;
        for (int t = 0; t < 2; ++t) {
          internal::Section s;
          s.codec = skip ? Codec::kNone : p.codec;
          s.tokens = sc.shape.tokens_per_block;
          s.heads = sc.shape.num_kv_heads;
          s.dim = sc.shape.head_dim;
          s.group = p.kivi_group_size;
          const float one = 1.0f;
          if (p.scale_mode != ScaleMode::kDynamic) s.static_scales = &one;
          const size_t size = internal::SectionBytes(s);
          size_t meta = 0;
          if (internal::IsFp8(s.codec) && s.static_scales == nullptr) {
            meta = 4 * s.heads;
          } else if (internal::IsKivi(s.codec)) {
            meta = 4 * (n / s.group);
          }
          if (s.codec != Codec::kNone) {
            for (size_t i = off + meta; i < off + size; ++i) {
              enc[i] = static_cast<uint8_t>(rng());
            }
          }
          off += size;
        }
      }
      ASSERT_EQ(off, enc.size());
      std::vector<uint16_t> want(in.size());
      ASSERT_TRUE(
          DecodeBlockReference(sc.shape, p, enc, absl::MakeSpan(want)).ok());
      DeviceBuffer<uint8_t> d_enc(enc);
      DeviceBuffer<uint16_t> d_out(in.size());
      const uint8_t* ins[1] = {d_enc.get()};
      uint16_t* outs[1] = {d_out.get()};
      ASSERT_TRUE(DecodeBlocksCuda(sc.shape, p, ins, outs).ok());
      const std::vector<uint16_t> got = d_out.ToHost();
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i])
            << "value " << i << " " << Describe(sc.shape, p);
      }
    }
  }
}

TEST_F(CudaCodecTest, DecodeOfArbitraryBytesMatchesReference) {
  CheckArbitraryDecodeMatchesReference(SourceDtype::kFp16, 17);
}

TEST_F(CudaCodecTest, Bf16DecodeOfArbitraryBytesMatchesReference) {
  CheckArbitraryDecodeMatchesReference(SourceDtype::kBf16, 71);
}

// FP8 on all 64,768 accepted bf16 patterns (one head of 506 tokens x 128
// channels), dynamic and static scales: the GPU's codes and decoded values
// equal the reference's (kernels/bf16_test.cc checks the reference against
// an independent model).
TEST_F(CudaCodecTest, Bf16Fp8EveryPatternMatchesReference) {
  BlockShape shape{1, 1, 128, 506};
  shape.source_dtype = SourceDtype::kBf16;
  std::vector<uint16_t> in;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7FFFu) < 0x7E80u) in.push_back(static_cast<uint16_t>(b));
  }
  ASSERT_EQ(in.size(), size_t{506} * 128);
  const std::vector<uint16_t> reversed(in.rbegin(), in.rend());
  in.insert(in.end(), reversed.begin(), reversed.end());  // V: reversed
  for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
    for (float sc : {0.0f, 1.0f, 3e-5f, 1e-40f, 3e38f,
                     FloatFromBits(0x3F808000u), FloatFromBits(0x3F818000u)}) {
      CodecPolicy p;
      p.codec = c;
      if (sc != 0.0f) {
        p.scale_mode = ScaleMode::kStaticPerLayer;
        p.static_k_scales = {sc};
        p.static_v_scales = {sc};
      }
      const size_t bytes = EncodedBlockBytes(shape, p);
      std::vector<uint8_t> ref(bytes);
      ASSERT_TRUE(EncodeBlockReference(shape, p, in, absl::MakeSpan(ref)).ok());
      std::vector<uint16_t> want(in.size());
      ASSERT_TRUE(
          DecodeBlockReference(shape, p, ref, absl::MakeSpan(want)).ok());
      DeviceBuffer<uint16_t> d_in(in), d_out(in.size());
      DeviceBuffer<uint8_t> d_enc(bytes);
      const uint16_t* ins[1] = {d_in.get()};
      uint8_t* encs[1] = {d_enc.get()};
      ASSERT_TRUE(EncodeBlocksCuda(shape, p, ins, encs).ok());
      EXPECT_EQ(d_enc.ToHost(), ref) << CodecName(c) << " scale " << sc;
      const uint8_t* enc_in[1] = {d_enc.get()};
      uint16_t* outs[1] = {d_out.get()};
      ASSERT_TRUE(DecodeBlocksCuda(shape, p, enc_in, outs).ok());
      EXPECT_EQ(d_out.ToHost(), want) << CodecName(c) << " scale " << sc;
    }
  }
}

TEST_F(CudaCodecTest, RejectsNonFiniteNamingBlockLayerAndHead) {
  const BlockShape shape{3, 4, 16, 8};
  const size_t sec = size_t{8} * 4 * 16;
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    p.kivi_group_size = 8;
    std::vector<uint16_t> a = MakeData(shape, Data::kGaussian, 1);
    std::vector<uint16_t> b = MakeData(shape, Data::kGaussian, 2);
    // Block 1, layer 2, V, token 5, head 3, channel 7.
    b[(2 * 2 + 1) * sec + (5 * 4 + 3) * 16 + 7] = 0xFC00;
    DeviceBuffer<uint16_t> da(a), db(b);
    DeviceBuffer<uint8_t> ea(EncodedBlockBytes(shape, p)),
        eb(EncodedBlockBytes(shape, p));
    const uint16_t* ins[2] = {da.get(), db.get()};
    uint8_t* outs[2] = {ea.get(), eb.get()};
    const absl::Status st = EncodeBlocksCuda(shape, p, ins, outs);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << CodecName(c);
    EXPECT_THAT(std::string(st.message()),
                HasSubstr("block 1 of the batch at layer 2 V head 3 (token 5, "
                          "channel 7)"))
        << CodecName(c);
  }
}

// bf16: inf, NaN and finite magnitudes >= 2^126 are rejected like the CPU
// paths reject them, naming block, layer and head.
TEST_F(CudaCodecTest, Bf16RejectsNonFiniteAndOutOfRange) {
  BlockShape shape{3, 4, 16, 8};
  shape.source_dtype = SourceDtype::kBf16;
  const size_t sec = size_t{8} * 4 * 16;
  for (Codec c : kAllCodecs) {
    for (uint16_t bad : {0xFF80, 0x7FC0, 0x7E80, 0xFF7F}) {
      CodecPolicy p;
      p.codec = c;
      p.kivi_group_size = 8;
      std::vector<uint16_t> a =
          testutil::MakeBf16Data(shape, testutil::Bf16Data::kGaussian, 1);
      std::vector<uint16_t> b =
          testutil::MakeBf16Data(shape, testutil::Bf16Data::kGaussian, 2);
      // Block 1, layer 2, V, token 5, head 3, channel 7.
      b[(2 * 2 + 1) * sec + (5 * 4 + 3) * 16 + 7] = bad;
      DeviceBuffer<uint16_t> da(a), db(b);
      DeviceBuffer<uint8_t> ea(EncodedBlockBytes(shape, p)),
          eb(EncodedBlockBytes(shape, p));
      const uint16_t* ins[2] = {da.get(), db.get()};
      uint8_t* outs[2] = {ea.get(), eb.get()};
      const absl::Status st = EncodeBlocksCuda(shape, p, ins, outs);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
          << CodecName(c) << " " << bad;
      EXPECT_THAT(std::string(st.message()), HasSubstr("bf16 input"));
      EXPECT_THAT(std::string(st.message()),
                  HasSubstr("block 1 of the batch at layer 2 V head 3 (token "
                            "5, channel 7)"))
          << CodecName(c) << " " << bad;
    }
  }
}

}  // namespace
}  // namespace kvcache::kernels::cuda
