// The fuzz targets' input format: little-endian integers and byte strings
// read from the front, in the order a target asks for them; what is asked
// for past the end reads as zeros. fuzz/make_corpus.cc writes seeds in the
// same format with InputWriter.
#ifndef KVCACHE_FUZZ_FUZZ_INPUT_H_
#define KVCACHE_FUZZ_FUZZ_INPUT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvcache::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size)
      : in_(reinterpret_cast<const char*>(data), size) {}

  template <typename T>
  T Int() {
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T) && !in_.empty(); ++i) {
      v |= uint64_t{static_cast<uint8_t>(in_[0])} << (8 * i);
      in_.remove_prefix(1);
    }
    return static_cast<T>(v);
  }
  uint8_t U8() { return Int<uint8_t>(); }
  uint16_t U16() { return Int<uint16_t>(); }
  uint32_t U32() { return Int<uint32_t>(); }
  uint64_t U64() { return Int<uint64_t>(); }
  // Up to n bytes (fewer at the end).
  std::string Bytes(size_t n) {
    absl::string_view v = in_.substr(0, std::min(n, in_.size()));
    in_.remove_prefix(v.size());
    return std::string(v);
  }
  std::string Rest() { return Bytes(in_.size()); }

 private:
  absl::string_view in_;
};

class InputWriter {
 public:
  template <typename T>
  InputWriter& Int(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) {
      out_.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
    }
    return *this;
  }
  InputWriter& U8(uint8_t v) { return Int(v); }
  InputWriter& U16(uint16_t v) { return Int(v); }
  InputWriter& U32(uint32_t v) { return Int(v); }
  InputWriter& U64(uint64_t v) { return Int(v); }
  InputWriter& Bytes(absl::string_view b) {
    out_.append(b.data(), b.size());
    return *this;
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

}  // namespace kvcache::fuzz

#endif  // KVCACHE_FUZZ_FUZZ_INPUT_H_
