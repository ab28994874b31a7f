// Writes the seed corpus of every fuzz target: a handful of small valid
// inputs each, made with the project's own encoders, as
// ROOT/<target>/<name>. Run by hand when an input format changes:
//   build-fuzz/fuzz/fuzz_make_corpus fuzz/corpus
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "fuzz/fuzz_input.h"
#include "kernels/codec.h"
#include "kvcache/v1/kvcache.pb.h"
#include "store/block_header.h"
#include "tools/npy.h"
#include "transport/wire.h"

namespace kvcache::fuzz {
namespace {

std::string root;  // NOLINT: set once by main

void Write(const std::string& target, const std::string& name,
           const std::string& bytes) {
  const std::string dir = root + "/" + target;
  mkdir(root.c_str(), 0755);
  mkdir(dir.c_str(), 0755);
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

// fuzz_wire: the selector byte, then the message.
void Wire() {
  ucx::Token token;
  for (size_t i = 0; i < token.size(); ++i) token[i] = static_cast<uint8_t>(i);
  auto put = [](uint8_t selector, const std::string& name,
                const std::string& bytes) {
    Write("fuzz_wire", name,
          std::string(1, static_cast<char>(selector)) + bytes);
  };
  put(0, "write_block", ucx::Encode(ucx::WriteBlockHeader{7, token, 2, 512}));
  ucx::WritePullHeader pull{9, token, 0, 0, 0, 3, 0x10000, 0x4000};
  put(1, "write_pull", ucx::Encode(pull));
  ucx::ReadStartHeader read{11, token, 0, 0, 0, ucx::kReadFlagBounded, 0};
  put(2, "read_start", ucx::Encode(read));
  ucx::ReadStatusHeader status{11, token, 1, 2, 0, false, 0};
  put(3, "read_status", ucx::Encode(status));
  status.has_data_messages = true;
  status.data_messages = 4;
  put(3, "read_status_counted", ucx::Encode(status));
  put(4, "release_buffer", ucx::Encode(ucx::ReleaseBufferHeader{3}));
  put(5, "read_data", ucx::Encode(ucx::ReadDataHeader{11, token, 1, 256}));
  ucx::ReadStartBody body;
  body.remote_key = "rkey";
  body.destinations = {0x10000, 0x12000};
  body.client_address = "worker-address";
  body.region_base = 0x10000;
  body.region_length = 0x4000;
  put(6, "read_start_bounded", ucx::EncodeReadStart(read, body).bytes);
  read.flags = ucx::kReadFlagPerLayer | ucx::kReadFlagMessages;
  body.destinations = {0x20000};
  put(6, "read_start_per_layer", ucx::EncodeReadStart(read, body).bytes);
  read.flags = ucx::kReadFlagBounded | ucx::kReadFlagNamesBuffer;
  body.named = {5, 0x40000, 0x8000, "named-rkey"};
  put(6, "read_start_named", ucx::EncodeReadStart(read, body).bytes);
  ucx::WritePullBody pull_body;
  pull_body.remote_key = "rkey";
  pull_body.blocks = {{0, 0x10000}, {1, 0x11000}};
  pull_body.client_address = "worker-address";
  put(7, "write_pull_body", ucx::EncodeWritePull(pull, pull_body).bytes);
  put(8, "token", ucx::TokenBytes(token));
  InputWriter region;
  region.U64(0x10000).U64(0x4000).U64(0x11000).U64(0x1000);
  put(9, "region", region.bytes());
}

// fuzz_block_header's expectations (its ReadExpected).
void Expected(InputWriter* w, const kernels::BlockShape& shape,
              const kernels::CodecPolicy& policy, uint64_t fingerprint,
              const std::string& key) {
  w->U32(shape.num_layers).U32(shape.num_kv_heads).U32(shape.head_dim);
  w->U32(shape.tokens_per_block);
  w->U8(static_cast<uint8_t>(policy.codec));
  w->U8(static_cast<uint8_t>(policy.scale_mode));
  w->U32(policy.kivi_group_size).U64(fingerprint);
  w->U8(static_cast<uint8_t>(key.size())).Bytes(key);
}

void BlockHeaders() {
  const kernels::BlockShape shape{2, 2, 8, 4};
  kernels::CodecPolicy policy;
  policy.codec = kernels::Codec::kFp8E4M3;
  const std::string key = "block-key";
  const std::string payload(96, 'p');
  const auto span = absl::MakeConstSpan(
      reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
  store::BlockHeader h = store::MakeBlockHeader(shape, policy, 42, key, span);
  InputWriter raw;
  raw.U8(0);
  Expected(&raw, shape, policy, 42, key);
  raw.Bytes(absl::string_view(reinterpret_cast<const char*>(&h), sizeof(h)));
  raw.Bytes(payload);
  Write("fuzz_block_header", "raw_valid", raw.bytes());
  for (uint8_t what = 0; what < 3; ++what) {
    InputWriter made;
    made.U8(static_cast<uint8_t>(1 + 2 * what));
    Expected(&made, shape, policy, 42, key);
    made.U16(17).U8(0x20);
    Expected(&made, shape, policy, what == 2 ? 43 : 42, key);
    made.Bytes(payload);
    Write("fuzz_block_header", "made_" + std::to_string(what), made.bytes());
  }
}

void Npy() {
  tools::NpyArray a;
  a.descr = "<f2";
  a.shape = {2, 3};
  a.data.assign(12, 0x3c);
  Write("fuzz_npy", "f2_2x3", tools::NpyBytes(a));
  a.descr = "<f4";
  a.shape = {4};
  a.data.assign(16, 0);
  Write("fuzz_npy", "f4_4", tools::NpyBytes(a));
  a.descr = "<f2";
  a.shape = {1, 2, 2};
  a.data.assign(8, 0);
  Write("fuzz_npy", "f2_1x2x2", tools::NpyBytes(a));
  // Version 2.0: a 4-byte header length.
  std::string header =
      "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }";
  std::string v2("\x93NUMPY\x02\x00", 8);
  InputWriter len;
  len.U32(static_cast<uint32_t>(header.size()));
  Write("fuzz_npy", "v2_f2_2", v2 + len.bytes() + header + std::string(4, 0));
}

// fuzz_codec_decode's layout (its Check): a real encoding of finite values.
void Codec(const std::string& name, const kernels::BlockShape& shape,
           const kernels::CodecPolicy& policy) {
  if (!kernels::ValidatePolicy(shape, policy).ok()) {
    std::fprintf(stderr, "seed %s: invalid policy\n", name.c_str());
    std::exit(1);
  }
  InputWriter w;
  w.U8(static_cast<uint8_t>(shape.num_layers - 1));
  w.U8(static_cast<uint8_t>(shape.num_kv_heads - 1));
  w.U8(static_cast<uint8_t>(shape.head_dim - 1));
  w.U8(static_cast<uint8_t>(shape.tokens_per_block - 1));
  w.U8(static_cast<uint8_t>(policy.codec));
  w.U8(static_cast<uint8_t>(policy.scale_mode));
  w.U8(static_cast<uint8_t>(policy.fp16_layers.size()));
  for (uint32_t l : policy.fp16_layers) w.U8(static_cast<uint8_t>(l));
  w.U8(0);  // flags: no static scales unless the mode has them; exact size
  if (policy.scale_mode != kernels::ScaleMode::kDynamic) {
    for (const std::vector<float>* v :
         {&policy.static_k_scales, &policy.static_v_scales}) {
      w.U8(0);  // the count the mode needs
      for (float f : *v) w.U8(static_cast<uint8_t>(f * 16 - 1));
    }
  }
  static constexpr uint32_t kGroups[] = {1, 2, 4, 8, 16, 32, 3, 0};
  uint8_t group = 0;
  while (kGroups[group] != policy.kivi_group_size) ++group;
  w.U8(group);
  std::vector<uint16_t> fp16(kernels::Fp16BlockBytes(shape) / 2);
  for (size_t i = 0; i < fp16.size(); ++i) {
    fp16[i] = static_cast<uint16_t>(0x3000 + (i * 37) % 0x1000) |
              (i % 3 == 0 ? 0x8000 : 0);
  }
  std::vector<uint8_t> encoded(kernels::EncodedBlockBytes(shape, policy));
  if (!kernels::EncodeBlock(shape, policy, fp16, absl::MakeSpan(encoded))
           .ok()) {
    std::fprintf(stderr, "seed %s: encode failed\n", name.c_str());
    std::exit(1);
  }
  w.Bytes(absl::string_view(reinterpret_cast<const char*>(encoded.data()),
                            encoded.size()));
  Write("fuzz_codec_decode", name, w.bytes());
}

void Codecs() {
  const kernels::BlockShape shape{2, 2, 8, 4};
  kernels::CodecPolicy p;
  p.kivi_group_size = 4;
  for (kernels::Codec c : kernels::kAllCodecs) {
    p.codec = c;
    Codec(std::string(kernels::CodecName(c)), shape, p);
  }
  p.codec = kernels::Codec::kFp8E4M3;
  p.fp16_layers = {1};
  Codec("fp8_e4m3_fp16_layer", shape, p);
  p.fp16_layers.clear();
  p.scale_mode = kernels::ScaleMode::kStaticPerLayer;
  p.static_k_scales = {0.5f, 1.0f};
  p.static_v_scales = {0.25f, 2.0f};
  Codec("fp8_e4m3_static_layer", shape, p);
  p.codec = kernels::Codec::kFp8E5M2;
  p.scale_mode = kernels::ScaleMode::kStaticPerLayerHead;
  p.static_k_scales = {0.5f, 1.0f, 1.5f, 2.0f};
  p.static_v_scales = {0.25f, 0.5f, 0.75f, 1.0f};
  Codec("fp8_e5m2_static_layer_head", shape, p);
}

// fuzz_rpc: calls as (op, u16 length, request bytes).
class Calls {
 public:
  Calls& Add(uint8_t op, const google::protobuf::Message& request) {
    const std::string bytes = request.SerializeAsString();
    w_.U8(op).U16(static_cast<uint16_t>(bytes.size())).Bytes(bytes);
    return *this;
  }
  const std::string& bytes() const { return w_.bytes(); }

 private:
  InputWriter w_;
};

constexpr uint8_t kPatch = 0x80;

void Rpcs() {
  v1::RegisterNamespaceRequest reg;
  v1::NamespaceSpec* spec = reg.mutable_spec();
  spec->set_name("seed-kivi");
  spec->set_model("m");
  v1::Layout* l = spec->mutable_layout();
  l->set_num_layers(2);
  l->set_num_kv_heads(2);
  l->set_head_dim(8);
  l->set_tokens_per_block(4);
  spec->mutable_codec_policy()->set_codec(v1::CODEC_KIVI2);
  spec->mutable_codec_policy()->set_kivi_group_size(4);
  Write("fuzz_rpc", "register", Calls().Add(0, reg).bytes());

  v1::LookupRequest lookup;
  lookup.set_namespace_name("fuzz");
  for (const char* k : {"k0", "k1", "k2", "k9"}) lookup.add_keys(k);
  lookup.set_pin(true);
  v1::BeginReadRequest read;
  read.set_namespace_name("fuzz");
  read.add_keys("k0");
  read.add_keys("k1");
  read.set_inline_data(true);
  v1::EndReadRequest end;
  Write("fuzz_rpc", "lookup_pin_read_end",
        Calls()
            .Add(1, lookup)
            .Add(5 | kPatch, read)
            .Add(6 | kPatch, end)
            .bytes());

  // Calls that state a fingerprint "fuzz" does not have: refused.
  v1::LookupRequest stale_lookup = lookup;
  stale_lookup.set_namespace_fingerprint(0x5eedf00d);
  v1::BeginReadRequest stale_read = read;
  stale_read.set_namespace_fingerprint(0x5eedf00d);
  Write("fuzz_rpc", "stale_fingerprint",
        Calls().Add(1, stale_lookup).Add(5, stale_read).bytes());

  v1::BeginWriteRequest begin;
  begin.set_namespace_name("fuzz");
  v1::BlockRef* b = begin.add_blocks();
  b->set_key("w0");
  b->set_parent_key("k3");
  v1::CommitWriteRequest commit;
  v1::BlockPayload* p = commit.add_payloads();
  p->set_index(0);
  p->set_fp16(std::string(512, '\x3c'));  // L=2 H=2 D=8 T=4 fp16
  v1::BeginReadRequest raw = read;
  raw.clear_keys();
  raw.add_keys("w0");
  raw.set_format(v1::READ_FORMAT_RAW);
  Write("fuzz_rpc", "write_commit_read",
        Calls()
            .Add(2, begin)
            .Add(3 | kPatch, commit)
            .Add(5, raw)
            .Add(6 | kPatch, end)
            .bytes());
  v1::AbortWriteRequest abort;
  Write("fuzz_rpc", "write_abort",
        Calls().Add(2, begin).Add(4 | kPatch, abort).bytes());
  v1::DeleteRequest del;
  del.set_namespace_name("fuzz");
  del.add_keys("w0");
  Write("fuzz_rpc", "delete_stats",
        Calls().Add(7, del).Add(8, v1::StatsRequest()).bytes());
  // DropNamespace (op 0x7f): of a namespace just registered, then of "fuzz"
  // itself (patched), which the target restores after the sequence.
  v1::DropNamespaceRequest drop;
  drop.set_namespace_name("seed-kivi");
  v1::LookupRequest lookup_fuzz;
  Write("fuzz_rpc", "register_drop",
        Calls()
            .Add(0, reg)
            .Add(0x7f, drop)
            .Add(0x7f | kPatch, v1::DropNamespaceRequest())
            .Add(1 | kPatch, lookup_fuzz)
            .bytes());
}

}  // namespace
}  // namespace kvcache::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT\n", argv[0]);
    return 2;
  }
  kvcache::fuzz::root = argv[1];
  kvcache::fuzz::Wire();
  kvcache::fuzz::BlockHeaders();
  kvcache::fuzz::Npy();
  kvcache::fuzz::Codecs();
  kvcache::fuzz::Rpcs();
  return 0;
}
