#include "store/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/populate.h"
#include "store/cuda_memory.h"

namespace kvcache::store {
namespace {

// Owns one anonymous private mapping.
class HostArena final : public Arena {
 public:
  HostArena(void* base, uint64_t size, bool huge)
      : base_(static_cast<uint8_t*>(base)), size_(size), huge_(huge) {}
  ~HostArena() override {
    stop_prefault_.store(true, std::memory_order_relaxed);
    if (prefaulter_.joinable()) prefaulter_.join();
    munmap(base_, size_);
  }
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint64_t size() const override { return size_; }
  MemoryKind kind() const override { return MemoryKind::kHost; }
  std::string Describe() const override {
    return absl::StrCat("host memory, ", size_, " bytes",
                        huge_ ? ", transparent huge pages advised" : "");
  }
  absl::Status Write(uint64_t offset, const void* src, size_t n) override {
    std::memcpy(base_ + offset, src, n);
    return absl::OkStatus();
  }
  absl::Status Read(uint64_t offset, void* dst, size_t n) const override {
    std::memcpy(dst, base_ + offset, n);
    return absl::OkStatus();
  }
  uint8_t* host_base() const override { return base_; }
  void StartPrefault() override {
    if (prefaulter_.joinable()) return;
    prefaulter_ = std::thread([this] { Prefault(); });
  }
  bool prefaulted() const override {
    return prefaulted_.load(std::memory_order_acquire);
  }

 private:
  // Stops when the arena goes; the pages stay as they are (base/populate.h).
  void Prefault() {
    if (!PopulateForWrite(base_, size_, [this] {
          return stop_prefault_.load(std::memory_order_relaxed);
        })) {
      return;
    }
    prefaulted_.store(true, std::memory_order_release);
  }

  uint8_t* base_;
  uint64_t size_;
  bool huge_;
  std::atomic<bool> stop_prefault_{false};
  std::atomic<bool> prefaulted_{false};
  std::thread prefaulter_;  // joined before the mapping goes
};

}  // namespace

std::string MemorySpec::ToString() const {
  if (kind == MemoryKind::kHost) return absl::StrCat("host:", bytes);
  return absl::StrCat("gpu:", device, ":", bytes);
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  struct Unit {
    const char* suffix;
    uint64_t multiplier;
  };
  static constexpr Unit kUnits[] = {
      {"tib", 1ull << 40}, {"gib", 1ull << 30}, {"mib", 1ull << 20},
      {"kib", 1ull << 10}, {"t", 1ull << 40},   {"g", 1ull << 30},
      {"m", 1ull << 20},   {"k", 1ull << 10},   {"b", 1}};
  uint64_t multiplier = 1;
  absl::string_view number = s;
  for (const Unit& unit : kUnits) {
    if (absl::ConsumeSuffix(&number, unit.suffix)) {
      multiplier = unit.multiplier;
      break;
    }
  }
  uint64_t value = 0;
  if (number.empty() || !absl::SimpleAtoi(number, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid byte size '", text, "' (e.g. 512MiB, 8GiB)"));
  }
  if (value > UINT64_MAX / multiplier) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size '", text, "' overflows 64 bits"));
  }
  return value * multiplier;
}

absl::StatusOr<MemorySpec> ParseMemorySpec(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  MemorySpec spec;
  absl::string_view size_text;
  if (parts.size() == 2 && parts[0] == "host") {
    spec.kind = MemoryKind::kHost;
    size_text = parts[1];
  } else if (parts.size() == 3 && parts[0] == "gpu") {
    spec.kind = MemoryKind::kGpu;
    if (!absl::SimpleAtoi(parts[1], &spec.device) || spec.device < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid GPU index in --memory=", text));
    }
    size_text = parts[2];
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid --memory=", text, " (expected host:SIZE or gpu:INDEX:SIZE)"));
  }
  absl::StatusOr<uint64_t> bytes = ParseByteSize(size_text);
  if (!bytes.ok()) return bytes.status();
  if (*bytes == 0) {
    return absl::InvalidArgumentError("--memory size must be positive");
  }
  spec.bytes = *bytes;
  return spec;
}

absl::StatusOr<std::unique_ptr<Arena>> CreateArena(const MemorySpec& spec) {
  if (spec.kind == MemoryKind::kGpu) {
    std::string why;
    int devices = CudaDeviceCount(&why);
    if (spec.device >= devices) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--memory=gpu:", spec.device, ":", spec.bytes,
          ": no such CUDA device (",
          devices == 0 ? why : absl::StrCat(devices, " device(s) present"),
          "); use --memory=host:SIZE on a machine without a GPU"));
    }
    return internal::CreateDeviceArena(spec.device, spec.bytes);
  }
  void* base = mmap(nullptr, spec.bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map ", spec.bytes, " bytes of host memory: ", strerror(errno)));
  }
  bool huge = madvise(base, spec.bytes, MADV_HUGEPAGE) == 0;
  return std::unique_ptr<Arena>(
      std::make_unique<HostArena>(base, spec.bytes, huge));
}

}  // namespace kvcache::store
