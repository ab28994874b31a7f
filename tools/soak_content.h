// What kvcache-soak writes and how it proves every read right.
//
// The fp16 KV of a block is a pure function of (namespace, chain, block,
// generation), so any process can tell what a read must return without
// talking to the writer. A key is written with generation 0 or 1 (a key
// deleted and written again may come back with the other one), so a read
// of it is right when it is exactly one legal state (kernels/legal_states.h)
// of either generation: as written, or its codec's round trip.
#ifndef KVCACHE_TOOLS_SOAK_CONTENT_H_
#define KVCACHE_TOOLS_SOAK_CONTENT_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "kernels/codec.h"
#include "kernels/legal_states.h"

namespace kvcache::soak {

inline constexpr uint32_t kGenerations = 2;

// A namespace of the soak: its name, shape and codec policy.
struct SoakNamespace {
  std::string name;
  kernels::BlockShape shape;
  kernels::CodecPolicy policy;
  uint32_t index = 0;  // seeds the content
};

// The namespaces every soak process registers: each codec at a small
// block (eager messages) and a large one (rendezvous messages) of fp16, and
// a small one of bf16.
std::vector<SoakNamespace> SoakNamespaces();

// "c<chain>b<block>": the key of a block of a chain.
std::string BlockKey(uint32_t chain, uint32_t block);

// The fp16 KV of (ns, chain, block, generation); finite, about [-4, 4].
std::vector<uint16_t> BlockContent(const SoakNamespace& ns, uint32_t chain,
                                   uint32_t block, uint32_t generation);

// The legal states of every generation of a block, computed on first use
// and kept (least recently used first out beyond `max_entries`).
// Thread-safe.
class Verifier {
 public:
  explicit Verifier(size_t max_entries) : max_entries_(max_entries) {}

  // OK when `read` (a whole fp16 block) is exactly a legal state of some
  // generation of the block; DATA_LOSS naming the first wrong element
  // otherwise.
  absl::Status CheckBlock(const SoakNamespace& ns, uint32_t chain,
                          uint32_t block, absl::Span<const uint16_t> read);
  // The same for one section (layer, K|V) of a layer-wise read; the
  // generation and state it matched go to *matched (generation * 2 +
  // state), so that a caller can require one for all sections of a block.
  absl::Status CheckSection(const SoakNamespace& ns, uint32_t chain,
                            uint32_t block, uint32_t layer, uint32_t kv,
                            absl::Span<const uint16_t> read, int* matched);
  // For a wrong read of section (layer, kv): whose bytes it holds, found by
  // searching every section of the namespace's first `chains` x `blocks`
  // blocks ("c0b3 gen 1 layer 2 V round trip"), or how many leading
  // elements the best candidate shares. A diagnostic; slow.
  std::string Identify(const SoakNamespace& ns, uint32_t chains,
                       uint32_t blocks, absl::Span<const uint16_t> read);

 private:
  using States = std::vector<kernels::LegalStates>;  // per generation
  absl::StatusOr<std::shared_ptr<const States>> Get(const SoakNamespace& ns,
                                                    uint32_t chain,
                                                    uint32_t block);
  const size_t max_entries_;
  Mutex mu_;
  std::list<std::string> order_ ABSL_GUARDED_BY(mu_);  // front: newest
  absl::flat_hash_map<std::string, std::pair<std::shared_ptr<const States>,
                                             std::list<std::string>::iterator>>
      cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::soak

#endif  // KVCACHE_TOOLS_SOAK_CONTENT_H_
