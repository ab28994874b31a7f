// kvcache-tool node-roundtrip: a model's whole KV prefix through a real
// node (put over the client, then get as fp16), for the real-KV quality
// harness (tools/real_kv, docs/quality.md).
#ifndef KVCACHE_TOOLS_NODE_ROUNDTRIP_H_
#define KVCACHE_TOOLS_NODE_ROUNDTRIP_H_

#include <string>
#include <vector>

namespace kvcache::tools {

inline constexpr char kNodeRoundtripUsage[] =
    "  kvcache-tool node-roundtrip --node HOST:PORT --codec C\n"
    "      [--tokens-per-block N] [--residual-tokens N] [--fp16-layers "
    "L,L,...]\n"
    "      [--namespace NAME] K.npy V.npy OUTK.npy OUTV.npy\n";

// K and V: fp16 [layers, tokens, kv_heads, head_dim] (post-RoPE keys in the
// engine's layout). Registers a namespace of that layout with the codec,
// puts the tokens as one chain of blocks (tokens_per_block each, default
// 32), reads them back as fp16 and writes them in the same layout. Prints
// one JSON line: the codec each block is stored with (KIVI's residual
// window keeps the last blocks fp16), block sizes and the node's usage.
// Returns the process exit code (0, 1 on errors, 2 on usage errors).
int NodeRoundtrip(const std::vector<std::string>& args);

}  // namespace kvcache::tools

#endif  // KVCACHE_TOOLS_NODE_ROUNDTRIP_H_
