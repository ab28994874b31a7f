#include "kvcache/device.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "client/cuda/device_runtime.h"
#include "kernels/codec.h"

namespace kvcache {

namespace di = device_internal;

absl::Status CudaDeviceStatus() {
  std::string why;
  if (di::DeviceCount(&why) > 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("no usable CUDA device: ", why));
}

int CudaDeviceCount() { return di::DeviceCount(); }

bool IsDeviceMemory(const void* p) {
  int device = 0;
  return di::QueryDevicePointer(p, &device);
}

namespace {

// ---- Staging memory, pooled

enum class StagingKind {
  kPutPinned,      // cudaHostAlloc: device-to-host copies of a Put
  kReadPinned,     // read staging for device destinations
  kReadHost,       // read staging for host decoding (no CUDA involved)
  kDeviceScratch,  // device copies of encodings for the decode kernel
};

struct Staging {
  StagingKind kind = StagingKind::kReadHost;
  // Members are destroyed bottom to top: a registration ends before the
  // DataBuffer it pins is freed.
  std::unique_ptr<DataBuffer> buffer;
  std::unique_ptr<di::HostRegistration> registration;
  std::unique_ptr<di::PinnedHostMemory> pinned;
  std::unique_ptr<di::DeviceMemory> device;
  uint8_t* data = nullptr;
  size_t size = 0;
};

// Sizes are rounded up so that similar requests reuse one buffer.
size_t StagingSize(size_t bytes) {
  constexpr size_t kGrain = size_t{1} << 20;
  return (bytes + kGrain - 1) / kGrain * kGrain;
}

class StagingPool {
 public:
  explicit StagingPool(size_t max_idle) : max_idle_(max_idle) {}

  // The smallest idle buffer of `kind` holding `bytes`, or null.
  std::unique_ptr<Staging> Take(StagingKind kind, size_t bytes) {
    MutexLock lock(&mu_);
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->kind == kind && (*it)->size >= bytes &&
          (best == idle_.end() || (*it)->size < (*best)->size)) {
        best = it;
      }
    }
    if (best == idle_.end()) return nullptr;
    std::unique_ptr<Staging> s = std::move(*best);
    idle_.erase(best);
    idle_bytes_ -= s->size;
    return s;
  }

  // Keeps `s` for reuse, dropping the oldest idle buffers beyond the bound.
  // The caller guarantees nothing (network, GPU) touches it any more.
  void Give(std::unique_ptr<Staging> s) {
    if (s == nullptr) return;
    std::vector<std::unique_ptr<Staging>> dropped;
    {
      MutexLock lock(&mu_);
      if (s->size > max_idle_) {
        dropped.push_back(std::move(s));
      } else {
        while (idle_bytes_ + s->size > max_idle_) {
          idle_bytes_ -= idle_.front()->size;
          dropped.push_back(std::move(idle_.front()));
          idle_.erase(idle_.begin());
        }
        idle_bytes_ += s->size;
        idle_.push_back(std::move(s));
      }
    }
    // `dropped` is freed here, outside the lock (cudaFree synchronizes).
  }

  size_t idle_bytes() const {
    MutexLock lock(&mu_);
    return idle_bytes_;
  }

 private:
  const size_t max_idle_;
  mutable Mutex mu_;
  // Oldest first.
  std::vector<std::unique_ptr<Staging>> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// ---- Layouts

// Layer l of one block: its bytes in the staging slot and where its output
// goes in the destination slot (offsets from the slot's start).
struct Segment {
  uint64_t src = 0;
  uint64_t len = 0;
  uint64_t out = 0;
  bool decode = false;  // false: a plain copy of len bytes

  bool SameAs(const Segment& o) const {
    return src == o.src && len == o.len && out == o.out && decode == o.decode;
  }
};

}  // namespace

// ---- DeviceClient::Impl

struct DeviceClient::Impl {
  Impl(Client* c, const DeviceClientOptions& o, bool device)
      : client(c),
        options(o),
        has_device(device),
        pool(o.max_idle_staging_bytes) {}

  // A staging buffer of at least `bytes` bytes, from the pool or new.
  absl::StatusOr<std::unique_ptr<Staging>> Acquire(StagingKind kind,
                                                   size_t bytes) {
    if (std::unique_ptr<Staging> s = pool.Take(kind, bytes)) return s;
    auto s = std::make_unique<Staging>();
    s->kind = kind;
    s->size = StagingSize(bytes);
    switch (kind) {
      case StagingKind::kPutPinned: {
        auto pinned = di::PinnedHostMemory::Allocate(options.device, s->size);
        if (!pinned.ok()) return pinned.status();
        s->pinned = *std::move(pinned);
        s->data = s->pinned->data();
        return s;
      }
      case StagingKind::kReadPinned: {
        // A DataBuffer the data plane reaches without per-read registration,
        // page-locked for CUDA so that host-to-device copies run at full
        // speed; else cudaHostAlloc memory (the Client registers it with UCX
        // for each read).
        auto buffer = client->AllocateBuffer(s->size);
        if (buffer.ok()) {
          auto registration = di::HostRegistration::Register(
              options.device, (*buffer)->data(), s->size);
          if (registration.ok()) {
            s->buffer = *std::move(buffer);
            s->registration = *std::move(registration);
            s->data = s->buffer->data();
            return s;
          }
        }
        auto pinned = di::PinnedHostMemory::Allocate(options.device, s->size);
        if (!pinned.ok()) return pinned.status();
        s->pinned = *std::move(pinned);
        s->data = s->pinned->data();
        return s;
      }
      case StagingKind::kReadHost: {
        auto buffer = client->AllocateBuffer(s->size);
        if (!buffer.ok()) return buffer.status();
        s->buffer = *std::move(buffer);
        s->data = s->buffer->data();
        return s;
      }
      case StagingKind::kDeviceScratch: {
        auto device = di::DeviceMemory::Allocate(options.device, s->size);
        if (!device.ok()) return device.status();
        s->device = *std::move(device);
        s->data = s->device->data();
        return s;
      }
    }
    return absl::InternalError("unknown staging kind");
  }

  // FAILED_PRECONDITION when a stream is given to a client without device.
  absl::Status CheckStream(void* stream) const {
    if (stream != nullptr && !has_device) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a CUDA stream was given, but ", CudaDeviceStatus().message()));
    }
    return absl::OkStatus();
  }

  // CheckStream, then *on_device: `p` is device (or managed) memory;
  // INVALID_ARGUMENT for memory of another device.
  absl::Status Classify(const void* p, void* stream, bool* on_device) const {
    if (absl::Status s = CheckStream(stream); !s.ok()) return s;
    int device = -1;
    *on_device = has_device && di::QueryDevicePointer(p, &device);
    if (*on_device && device != -1 && device != options.device) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory of CUDA device ", device,
                       " given to a DeviceClient of device ", options.device));
    }
    return absl::OkStatus();
  }

  Client* const client;
  const DeviceClientOptions options;
  const bool has_device;
  StagingPool pool;
};

// ---- DeviceRead

struct DeviceRead::Impl {
  std::shared_ptr<DeviceClient::Impl> owner;
  std::unique_ptr<PendingRead> pending;
  bool on_device = false;
  bool pass_through = false;  // host fp16/raw: the Client reads into dest
  GetResult metadata;
  std::vector<BlockPlacement> placements;
  uint32_t num_layers = 1;
  absl::Time deadline;

  // Staged reads (device destination, or decoding on the host).
  DeviceReadMode mode = DeviceReadMode::kFp16;
  uint8_t* dest = nullptr;
  size_t stride = 0;
  size_t num_blocks = 0;
  BlockShape layer_shape;                 // one layer
  std::vector<CodecPolicy> layer_policy;  // of the namespace, per layer
  std::vector<Segment> segments;          // [block * num_layers + layer]
  bool separable = true;  // each layer lands on its own (else all at the end)
  bool needs_scratch = false;  // some segment is decoded on the device
  std::unique_ptr<Staging> staging;
  std::unique_ptr<Staging> scratch;  // device copies of encodings
  std::unique_ptr<di::Stream> stream;
  std::vector<std::unique_ptr<di::Event>> events;  // one per layer
  std::unique_ptr<di::Event> drain;                // the destructor's wait

  Mutex mu;
  CondVar cv;                                 // signalled as the below change
  uint32_t ready ABSL_GUARDED_BY(mu) = 0;     // layers ready
  bool finished ABSL_GUARDED_BY(mu) = false;  // the worker has stopped
  absl::Status failure ABSL_GUARDED_BY(mu);
  std::atomic<bool> stop{false};
  std::thread worker;

  const Segment& At(size_t block, uint32_t layer) const {
    return segments[block * num_layers + layer];
  }

  // The layout of every block, from its namespace's shape and policy,
  // checked against what the node said it sends: segments, placements and
  // num_layers. Needs pending, mode, stride and num_blocks.
  absl::Status Plan(ReadFormat format) {
    metadata = pending->metadata();
    const BlockShape& shape = metadata.shape;
    const CodecPolicy& policy = metadata.policy;
    const std::vector<BlockPlacement>& sent = pending->placements();
    const uint32_t L = shape.num_layers;
    if (L == 0 || metadata.blocks.size() != num_blocks ||
        sent.size() != num_blocks) {
      return absl::InternalError(
          "the node described the read inconsistently (layers or blocks)");
    }
    if (absl::Status s = kernels::ValidatePolicy(shape, policy); !s.ok()) {
      return absl::InternalError(
          absl::StrCat("the node sent an invalid codec policy: ", s.message()));
    }
    const bool fp16_out = mode != DeviceReadMode::kRaw;
    num_layers = L;
    layer_shape = shape;
    layer_shape.num_layers = 1;
    const uint64_t layer_fp16 = kernels::Fp16BlockBytes(layer_shape);
    for (uint32_t l = 0; l < L; ++l) {
      layer_policy.push_back(kernels::LayerPolicy(shape, policy, l));
    }
    const std::vector<size_t> encoded_offsets =
        kernels::EncodedLayerOffsets(shape, policy);
    const CodecPolicy fp16_policy;
    segments.resize(num_blocks * L);
    for (size_t b = 0; b < num_blocks; ++b) {
      const BlockData& block = metadata.blocks[b];
      const bool residual = block.codec != policy.codec;
      if (residual && block.codec != Codec::kNone) {
        return absl::DataLossError(absl::StrCat(
            "block ", b, " is stored with codec ", CodecName(block.codec),
            " in a namespace of codec ", CodecName(policy.codec)));
      }
      BlockPlacement out;
      out.offset = b * stride;
      uint64_t src = 0;
      for (uint32_t l = 0; l < L; ++l) {
        const CodecPolicy& lp = residual ? fp16_policy : layer_policy[l];
        Segment& seg = segments[b * L + l];
        seg.src = src;
        seg.len = format == ReadFormat::kFp16 || residual
                      ? layer_fp16
                      : encoded_offsets[l + 1] - encoded_offsets[l];
        seg.decode =
            mode == DeviceReadMode::kDecodeHere && lp.codec != Codec::kNone;
        seg.out = fp16_out ? l * layer_fp16 : src;
        needs_scratch |= seg.decode;
        src += seg.len;
        out.layer_ends.push_back(fp16_out ? (l + 1) * layer_fp16 : src);
      }
      out.length = out.layer_ends.back();
      if (sent[b].length != src) {
        return absl::DataLossError(
            absl::StrCat("block ", b, " has ", sent[b].length,
                         " bytes where its namespace's layout has ", src));
      }
      if (sent[b].layer_ends.size() == L) {
        for (uint32_t l = 0; l < L; ++l) {
          const uint64_t end = At(b, l).src + At(b, l).len;
          if (sent[b].layer_ends[l] != end) {
            return absl::DataLossError(
                absl::StrCat("block ", b, ": the node's layer ", l, " ends at ",
                             sent[b].layer_ends[l], ", its layout's at ", end));
          }
        }
      } else {
        separable = false;
      }
      if (out.length > stride) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ", b, " decodes to ", out.length,
                         " bytes, more than the stride of ", stride));
      }
      placements.push_back(std::move(out));
      if (fp16_out) metadata.blocks[b].format = ReadFormat::kFp16;
    }
    return absl::OkStatus();
  }

  absl::Status QueueDeviceLayer(uint32_t l) {
    std::vector<const uint8_t*> encoded;
    std::vector<uint16_t*> out;
    for (size_t b = 0; b < num_blocks;) {
      const Segment& seg = At(b, l);
      size_t e = b + 1;
      while (e < num_blocks && At(e, l).SameAs(seg)) ++e;
      const uint8_t* src = staging->data + b * stride + seg.src;
      if (!seg.decode) {
        if (absl::Status s =
                di::Copy2DAsync(dest + b * stride + seg.out, stride, src,
                                stride, seg.len, e - b, *stream);
            !s.ok()) {
          return s;
        }
      } else {
        uint8_t* in_device = scratch->data + b * stride + seg.src;
        if (absl::Status s = di::Copy2DAsync(in_device, stride, src, stride,
                                             seg.len, e - b, *stream);
            !s.ok()) {
          return s;
        }
        for (size_t i = b; i < e; ++i) {
          encoded.push_back(scratch->data + i * stride + seg.src);
          out.push_back(
              reinterpret_cast<uint16_t*>(dest + i * stride + seg.out));
        }
      }
      b = e;
    }
    if (encoded.empty()) return absl::OkStatus();
    // Queued after the copies into scratch on the same stream; returns once
    // the decode has finished.
    return di::DecodeBlocks(layer_shape, layer_policy[l], encoded, out,
                            *stream);
  }

  absl::Status DecodeHostLayer(uint32_t l) {
    for (size_t b = 0; b < num_blocks; ++b) {
      const Segment& seg = At(b, l);
      const uint8_t* src = staging->data + b * stride + seg.src;
      uint8_t* to = dest + b * stride + seg.out;
      if (!seg.decode) {
        std::memcpy(to, src, seg.len);
        continue;
      }
      const size_t halves = kernels::Fp16BlockBytes(layer_shape) / 2;
      if (absl::Status s = kernels::DecodeBlock(
              layer_shape, layer_policy[l], absl::MakeConstSpan(src, seg.len),
              absl::MakeSpan(reinterpret_cast<uint16_t*>(to), halves));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  // A device read's stream (`borrowed`, or one of its own), its events (one
  // per layer, then the drain) and, when some segment is decoded on the
  // device, its scratch of `span` bytes.
  absl::Status PrepareDevice(void* borrowed, size_t span) {
    const int device = owner->options.device;
    if (borrowed != nullptr) {
      stream = di::Stream::Borrow(device, borrowed);
    } else {
      absl::StatusOr<std::unique_ptr<di::Stream>> created =
          di::Stream::Create(device);
      if (!created.ok()) return created.status();
      stream = *std::move(created);
    }
    for (uint32_t l = 0; l <= num_layers; ++l) {
      absl::StatusOr<std::unique_ptr<di::Event>> event =
          di::Event::Create(device);
      if (!event.ok()) return event.status();
      if (l < num_layers) {
        events.push_back(*std::move(event));
      } else {
        drain = *std::move(event);
      }
    }
    if (needs_scratch) {
      absl::StatusOr<std::unique_ptr<Staging>> acquired =
          owner->Acquire(StagingKind::kDeviceScratch, span);
      if (!acquired.ok()) return acquired.status();
      scratch = *std::move(acquired);
    }
    return absl::OkStatus();
  }

  void Run() {
    for (uint32_t l = 0; l < num_layers; ++l) {
      absl::Status s;
      if (stop.load()) {
        s = absl::CancelledError("the read was destroyed");
      } else {
        s = pending->WaitLayer(separable ? l : num_layers - 1);
      }
      if (s.ok()) s = on_device ? QueueDeviceLayer(l) : DecodeHostLayer(l);
      if (s.ok() && on_device) s = events[l]->Record(*stream);
      MutexLock lock(&mu);
      if (!s.ok()) {
        failure = s;
        break;
      }
      ready = l + 1;
      cv.SignalAll();
    }
    MutexLock lock(&mu);
    finished = true;
    cv.SignalAll();
  }
};

DeviceRead::DeviceRead(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceRead::~DeviceRead() {
  Impl& r = *impl_;
  if (r.worker.joinable()) {
    r.stop.store(true);
    r.worker.join();  // bounded: the Client's deadline, the GPU's work
  }
  r.pending.reset();  // ends (or cancels) the transfer into staging
  bool idle = true;
  if (r.on_device) {
    // Everything this read queued precedes this event on the stream.
    absl::Status s = r.drain->Record(*r.stream);
    if (s.ok()) s = r.drain->WaitUntil(absl::Now() + r.owner->options.timeout);
    idle = s.ok();
  }
  if (idle) {
    r.owner->pool.Give(std::move(r.staging));
    r.owner->pool.Give(std::move(r.scratch));
  } else {
    // The GPU may still copy from or into these: never free them under it.
    static_cast<void>(r.staging.release());
    static_cast<void>(r.scratch.release());
  }
}

absl::Status DeviceRead::WaitLayer(uint32_t layer) {
  Impl& r = *impl_;
  if (layer >= r.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " of a ", r.num_layers, "-layer block"));
  }
  if (r.pass_through) return r.pending->WaitLayer(layer);
  MutexLock lock(&r.mu);
  const bool done = r.cv.WaitUntil(
      &r.mu, r.deadline, [&r, layer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) {
        return r.ready > layer || r.finished;
      });
  if (r.ready > layer) return absl::OkStatus();
  if (!r.failure.ok()) return r.failure;
  if (!done) {
    return absl::DeadlineExceededError(
        absl::StrCat("layer ", layer, " was not ready by the read's deadline"));
  }
  return absl::InternalError("the read ended before its last layer");
}

absl::Status DeviceRead::SyncLayer(uint32_t layer) {
  if (absl::Status s = WaitLayer(layer); !s.ok()) return s;
  if (!impl_->on_device) return absl::OkStatus();
  return impl_->events[layer]->WaitUntil(impl_->deadline);
}

absl::Status DeviceRead::Wait() { return SyncLayer(impl_->num_layers - 1); }

void* DeviceRead::LayerEvent(uint32_t layer) const {
  Impl& r = *impl_;
  if (!r.on_device || layer >= r.num_layers) return nullptr;
  MutexLock lock(&r.mu);
  return r.ready > layer ? r.events[layer]->get() : nullptr;
}

void* DeviceRead::stream() const {
  return impl_->on_device ? impl_->stream->get() : nullptr;
}
uint32_t DeviceRead::num_layers() const { return impl_->num_layers; }
const GetResult& DeviceRead::metadata() const { return impl_->metadata; }
const std::vector<BlockPlacement>& DeviceRead::placements() const {
  return impl_->placements;
}
bool DeviceRead::on_device() const { return impl_->on_device; }
bool DeviceRead::over_data_plane() const {
  return impl_->pending->over_data_plane();
}

// ---- DeviceClient

DeviceClient::DeviceClient(std::shared_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
DeviceClient::~DeviceClient() = default;

absl::StatusOr<std::unique_ptr<DeviceClient>> DeviceClient::Create(
    Client* client, const DeviceClientOptions& options) {
  if (client == nullptr) return absl::InvalidArgumentError("no Client");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout must be positive");
  }
  const int count = CudaDeviceCount();
  if (count == 0 && options.require_device) return CudaDeviceStatus();
  if (count > 0 && (options.device < 0 || options.device >= count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", options.device, " of a process with ", count));
  }
  return std::unique_ptr<DeviceClient>(new DeviceClient(
      std::make_shared<Impl>(client, options, /*device=*/count > 0)));
}

bool DeviceClient::has_device() const { return impl_->has_device; }
Client* DeviceClient::client() const { return impl_->client; }
size_t DeviceClient::idle_staging_bytes() const {
  return impl_->pool.idle_bytes();
}

absl::StatusOr<PutResult> DeviceClient::Put(const std::string& ns,
                                            absl::Span<const BlockWrite> blocks,
                                            void* stream) {
  Impl& c = *impl_;
  if (absl::Status s = c.CheckStream(stream); !s.ok()) return s;
  std::vector<size_t> staged;  // indices of device blocks
  size_t bytes = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    bool on_device = false;
    if (absl::Status s = c.Classify(blocks[i].fp16.data(), stream, &on_device);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("block ", i, ": ", s.message()));
    }
    if (on_device && !blocks[i].fp16.empty()) {
      staged.push_back(i);
      bytes += blocks[i].fp16.size() * sizeof(uint16_t);
    }
  }
  if (staged.empty()) return c.client->Put(ns, blocks);

  absl::StatusOr<std::unique_ptr<Staging>> staging =
      c.Acquire(StagingKind::kPutPinned, bytes);
  if (!staging.ok()) return staging.status();
  std::unique_ptr<di::Stream> own;
  if (stream != nullptr) {
    own = di::Stream::Borrow(c.options.device, stream);
  } else {
    absl::StatusOr<std::unique_ptr<di::Stream>> created =
        di::Stream::Create(c.options.device);
    if (!created.ok()) return created.status();
    own = *std::move(created);
  }
  absl::StatusOr<std::unique_ptr<di::Event>> done =
      di::Event::Create(c.options.device);
  if (!done.ok()) return done.status();

  std::vector<BlockWrite> writes(blocks.begin(), blocks.end());
  size_t offset = 0;
  absl::Status s;
  bool queued = false;
  for (size_t i : staged) {
    const size_t n = blocks[i].fp16.size() * sizeof(uint16_t);
    uint8_t* to = (*staging)->data + offset;
    s = di::CopyAsync(to, blocks[i].fp16.data(), n, *own);
    if (!s.ok()) break;
    queued = true;
    writes[i].fp16 = absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(to),
                                         blocks[i].fp16.size());
    offset += n;
  }
  if (queued) {
    absl::Status recorded = (*done)->Record(*own);
    if (recorded.ok()) {
      recorded = (*done)->WaitUntil(absl::Now() + c.options.timeout);
    }
    if (!recorded.ok()) {
      // A copy may still be writing into the staging buffer: leak it rather
      // than free or reuse it under the GPU.
      static_cast<void>(staging->release());
      return s.ok() ? recorded : s;
    }
  }
  if (!s.ok()) {
    c.pool.Give(*std::move(staging));
    return s;
  }
  absl::StatusOr<PutResult> result = c.client->Put(ns, writes);
  c.pool.Give(*std::move(staging));
  return result;
}

absl::StatusOr<std::unique_ptr<DeviceRead>> DeviceClient::GetInto(
    const std::string& ns, const std::vector<std::string>& keys, void* dest,
    size_t dest_bytes, size_t stride, const DeviceReadOptions& options) {
  Impl& c = *impl_;
  if (keys.empty()) return absl::InvalidArgumentError("no keys to read");
  if (dest == nullptr || stride == 0 || dest_bytes / stride < keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a destination of ", dest_bytes, " bytes does not hold ",
                     keys.size(), " blocks of stride ", stride));
  }
  bool on_device = false;
  if (absl::Status s = c.Classify(dest, options.stream, &on_device); !s.ok()) {
    return s;
  }
  const bool fp16_out = options.mode != DeviceReadMode::kRaw;
  if (fp16_out &&
      (reinterpret_cast<uintptr_t>(dest) % 2 != 0 || stride % 2 != 0)) {
    return absl::InvalidArgumentError(
        "fp16 output needs an even destination address and stride");
  }
  const ReadFormat format = options.mode == DeviceReadMode::kFp16
                                ? ReadFormat::kFp16
                                : ReadFormat::kRaw;
  const size_t span = keys.size() * stride;
  auto r = std::make_unique<DeviceRead::Impl>();
  r->owner = impl_;
  r->on_device = on_device;
  r->mode = options.mode;
  r->deadline = absl::Now() + c.options.timeout;

  const bool pass_through =
      !on_device && options.mode != DeviceReadMode::kDecodeHere;
  if (!pass_through) {
    absl::StatusOr<std::unique_ptr<Staging>> staging = c.Acquire(
        on_device ? StagingKind::kReadPinned : StagingKind::kReadHost, span);
    if (!staging.ok()) return staging.status();
    r->staging = *std::move(staging);
  }
  // From here on a failure must end the transfer before the staging buffer
  // goes back to the pool.
  auto fail = [&](absl::Status s) {
    r->pending.reset();
    c.pool.Give(std::move(r->staging));
    c.pool.Give(std::move(r->scratch));
    return s;
  };
  uint8_t* landing =
      pass_through ? static_cast<uint8_t*>(dest) : r->staging->data;
  absl::StatusOr<std::unique_ptr<PendingRead>> pending =
      c.client->GetInto(ns, keys, format, absl::MakeSpan(landing, span), stride,
                        options.pin_lease);
  if (!pending.ok()) return fail(pending.status());
  r->pending = *std::move(pending);
  r->pass_through = pass_through;
  r->dest = static_cast<uint8_t*>(dest);
  r->stride = stride;
  r->num_blocks = keys.size();
  if (absl::Status s = r->Plan(format); !s.ok()) return fail(s);
  if (pass_through) return std::make_unique<DeviceRead>(std::move(r));

  if (on_device) {
    if (absl::Status s = r->PrepareDevice(options.stream, span); !s.ok()) {
      return fail(s);
    }
  }
  DeviceRead::Impl* raw = r.get();
  raw->worker = std::thread([raw] { raw->Run(); });
  return std::make_unique<DeviceRead>(std::move(r));
}

}  // namespace kvcache
