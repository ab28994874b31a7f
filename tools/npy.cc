#include "tools/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvcache::tools {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

// The value of `key` in the header's Python dict literal, e.g. "'<f2'".
absl::StatusOr<std::string> DictValue(absl::string_view header,
                                      absl::string_view key) {
  std::string quoted = absl::StrCat("'", key, "'");
  size_t at = header.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("no ", key, " in header"));
  }
  absl::string_view rest = header.substr(at + quoted.size());
  rest = absl::StripLeadingAsciiWhitespace(rest);
  if (!absl::ConsumePrefix(&rest, ":")) {
    return absl::InvalidArgumentError("malformed header");
  }
  rest = absl::StripLeadingAsciiWhitespace(rest);
  size_t end;
  if (!rest.empty() && rest[0] == '(') {
    end = rest.find(')');
    if (end == absl::string_view::npos) {
      return absl::InvalidArgumentError("malformed shape");
    }
    ++end;
  } else if (!rest.empty() && rest[0] == '\'') {
    end = rest.find('\'', 1);
    if (end == absl::string_view::npos) {
      return absl::InvalidArgumentError("malformed header string");
    }
    ++end;
  } else {
    end = rest.find_first_of(",}");
  }
  return std::string(absl::StripAsciiWhitespace(rest.substr(0, end)));
}

size_t ElementSize(const std::string& descr) {
  if (descr == "<f2" || descr == "<u2") return 2;
  if (descr == "<f4") return 4;
  return 0;
}

}  // namespace

uint64_t NpyArray::elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string bytes((std::istreambuf_iterator<char>(in)),
                    std::istreambuf_iterator<char>());
  return ParseNpy(bytes, path);
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes,
                                  absl::string_view name) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", why));
  };
  if (bytes.size() < 10 || bytes.compare(0, 6, kMagic) != 0) {
    return bad("not a .npy file");
  }
  const uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) |
                 (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return bad("truncated header");
    uint32_t len;
    std::memcpy(&len, bytes.data() + 8, 4);
    header_len = len;
    header_start = 12;
  } else {
    return bad(absl::StrCat("unsupported .npy version ", major));
  }
  if (bytes.size() < header_start + header_len) return bad("truncated header");
  absl::string_view header(bytes.data() + header_start, header_len);

  NpyArray array;
  absl::StatusOr<std::string> descr = DictValue(header, "descr");
  absl::StatusOr<std::string> order = DictValue(header, "fortran_order");
  absl::StatusOr<std::string> shape = DictValue(header, "shape");
  if (!descr.ok() || !order.ok() || !shape.ok()) return bad("malformed header");
  array.descr =
      std::string(absl::StripSuffix(absl::StripPrefix(*descr, "'"), "'"));
  if (array.descr == "|f2" || array.descr == "=f2") array.descr = "<f2";
  if (array.descr == "|u2" || array.descr == "=u2") array.descr = "<u2";
  if (ElementSize(array.descr) == 0) {
    return bad(
        absl::StrCat("dtype ", array.descr,
                     " is not little-endian float16, float32 or uint16"));
  }
  if (*order != "False") return bad("Fortran-ordered arrays are not supported");
  absl::string_view dims =
      absl::StripSuffix(absl::StripPrefix(*shape, "("), ")");
  for (absl::string_view d :
       absl::StrSplit(dims, ',', absl::SkipWhitespace())) {
    uint64_t v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v)) {
      return bad("malformed shape");
    }
    array.shape.push_back(v);
  }
  // The element and byte counts must not wrap: a wrapped count would let a
  // huge shape pass with little data (fuzz/regressions/fuzz_npy/).
  uint64_t want = ElementSize(array.descr);
  for (uint64_t d : array.shape) {
    if (__builtin_mul_overflow(want, d, &want)) {
      return bad("shape has more elements than 64 bits count");
    }
  }
  const size_t data_start = header_start + header_len;
  if (bytes.size() - data_start != want) {
    return bad(absl::StrCat("holds ", bytes.size() - data_start,
                            " data bytes; its shape needs ", want));
  }
  array.data.assign(bytes.begin() + data_start, bytes.end());
  return array;
}

std::string NpyBytes(const NpyArray& array) {
  std::vector<std::string> dims;
  for (uint64_t d : array.shape) dims.push_back(absl::StrCat(d));
  std::string shape = absl::StrJoin(dims, ", ");
  if (array.shape.size() == 1) shape += ",";
  std::string header =
      absl::StrCat("{'descr': '", array.descr,
                   "', 'fortran_order': False, 'shape': (", shape, "), }");
  // Pad with spaces and a newline so that the data starts 64-byte aligned.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes(kMagic, 6);
  bytes.push_back(1);  // version 1.0
  bytes.push_back(0);
  const uint16_t len = static_cast<uint16_t>(header.size());
  bytes.push_back(static_cast<char>(len & 0xFF));
  bytes.push_back(static_cast<char>(len >> 8));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(array.data.data()),
               array.data.size());
  return bytes;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  const std::string bytes = NpyBytes(array);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace kvcache::tools
