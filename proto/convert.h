// The one mapping between the wire's codec, policy and layout messages and
// the public codec types (kvcache/codec.h), shared by the node's service and
// the client library.
#ifndef KVCACHE_PROTO_CONVERT_H_
#define KVCACHE_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "kvcache/codec.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::proto {

v1::Codec CodecToProto(kvcache::Codec codec);
// INVALID_ARGUMENT for CODEC_UNSPECIFIED and values outside the enum.
absl::StatusOr<kvcache::Codec> CodecFromProto(v1::Codec codec);

void PolicyToProto(const kvcache::CodecPolicy& policy, v1::CodecPolicy* out);
// The codec is left kNone when the message leaves it unspecified (the caller
// decides what that means); kivi_group_size 0 means 32. INVALID_ARGUMENT
// for an unknown codec or scale mode.
absl::StatusOr<kvcache::CodecPolicy> PolicyFromProto(const v1::CodecPolicy& p);

void ShapeToProto(const kvcache::BlockShape& shape, v1::Layout* out);
kvcache::BlockShape ShapeFromProto(const v1::Layout& layout);

}  // namespace kvcache::proto

#endif  // KVCACHE_PROTO_CONVERT_H_
