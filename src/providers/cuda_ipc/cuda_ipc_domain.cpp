// cuda_ipc Domain. A WRITE is queued at post time and handed to the GPU at the next poll: writes
// of 8 MiB or more each become one cudaMemcpyAsync (a copy engine), smaller ones are gathered
// into one kernel launch per batch, cut into descriptors of at most 256 KiB so that a few large
// WRITEs still spread over every SM (one cudaMemcpyAsync per 1-4 MiB WRITE cost ~5 us of host time
// each: the "1 MiB dip"). Batches alternate between two streams, so one batch's last blocks
// overlap the next batch's first instead of leaving SMs idle between launches. A batch's event
// marks its local completion; only then does its immediate go to the peer's inbox, so a peer
// that sees the immediate sees the data (batches complete in posting order).
// post_write_batch (the pages of a paged transfer, up to kBatchMax at once) is handed to the GPU
// at post time: its descriptors go straight into a descriptor block, at most two gather launches,
// one event and one completion for the whole batch, its immediates pushed in one go.
// Writers hold a peer's region while their copies into it run (ipc_shared.h), so deregistration
// waits for them; peers can be removed, their mappings closed, with operations still in flight.
#include "providers/cuda_ipc/cuda_ipc_domain.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/driver_api.h"
#include "providers/cuda_ipc/gather_copy.h"
#include "providers/ipc/local_domain.h"

namespace fabric {
namespace {

constexpr size_t kDescBlock = 4096;  // copies per gather launch
constexpr size_t kDescBlocks = 32;   // gather launches in flight
constexpr size_t kBatchMax = 4096;   // WRITEs per post_write_batch (two launches at most)
constexpr size_t kBatchBlocks = 1;   // a post_write_batch fills one descriptor block
static_assert(kBatchMax <= kDescBlock);
constexpr uint32_t kBatchKick = 256;  // an idle GPU gets a batch's first pages this early
// A single WRITE this large goes to a copy engine alone; a page of a post_write_batch from
// kBatchCopyEngineMin (pages are not cut).
constexpr uint64_t kCopyEngineMin = 8 << 20;
constexpr uint64_t kBatchCopyEngineMin = 1 << 20;
constexpr uint64_t kChunk = 256 << 10;  // a single WRITE's bytes per descriptor
constexpr size_t kStreams = 2;

static_assert(sizeof(cudaIpcMemHandle_t) == ipc::kHandleBytes);

// What this domain knows about one of its own registrations.
struct LocalRegion {
  bool gpu = false;
  bool device_readable = false;  // a kernel may read it (GPU memory, or mapped host memory)
  bool host_registered = false;  // we called cudaHostRegister and must undo it
  uint32_t slot = UINT32_MAX;    // exported GPU region: its entry in our table
  void* host_ptr = nullptr;
};

struct PendingOp {
  OpContext* ctx;
  PeerId peer;
  bool has_imm;
  bool kernel_ok;
  uint32_t imm;
  uint32_t generation;       // of the destination region
  ipc::RegionEntry* region;  // the destination's entry in the peer's segment; null: no bytes
  const void* src;
  void* dst;
  uint64_t len;
};

struct Batch {
  uint64_t id = 0;  // debug logs: batches in the order they were handed to the GPU
  cudaEvent_t event = nullptr;
  int desc_block = -1;  // a batch of single WRITEs: its descriptor block
  std::vector<PendingOp> ops;
  std::vector<std::pair<ipc::RegionEntry*, uint32_t>> holds;  // (region, generation): released
                                                              // once the batch completed
  std::string failure;  // set: every op of the batch fails with this
  // A post_write_batch: one context for all its WRITEs, their peer, the descriptor blocks its
  // launches read, and the immediates it delivers once its event has completed.
  OpContext* group = nullptr;
  PeerId group_peer = 0;
  std::array<int, kBatchBlocks> group_blocks{};
  size_t group_block_count = 0;
  std::vector<uint32_t> imms;
};

struct Peer : ipc::PeerEndpoint {
  struct Mapped {
    uint32_t generation = 0;
    uint8_t* ptr = nullptr;
    uint64_t len = 0;
    std::string handle_key;  // empty when not opened through IPC (same process)
  };
  std::unordered_map<uint32_t, Mapped> regions;
};

struct OpenedAllocation {
  uint8_t* base = nullptr;
  int refs = 0;
};

// GPU memory is all it writes (8 MiB and more go to cudaMemcpyAsync whole); as many operations
// in flight as the descriptor ring holds; batches of up to kBatchMax pages, one gather launch each.
class CudaIpcDomain final : public ipc::LocalDomain<Peer, LocalRegion> {
 public:
  explicit CudaIpcDomain(const EngineConfig& config)
      : LocalDomain("cuda_ipc", ipc::EndpointKind::kCuda, config,
                    {.gpu_memory = true,
                     .max_in_flight = kDescBlock * kDescBlocks,
                     .max_write_batch = kBatchMax}),
        device_(*config.cuda_device) {
    cuda::use_device(device_);
    cuda::check("cudaDeviceGetAttribute",
                cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    for (cudaStream_t& st : streams_)
      cuda::check("cudaStreamCreateWithFlags",
                  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cuda::check("cudaFuncGetAttributes(gather copy)", cuda::load_gather_copy());
    void* descs = nullptr;
    cuda::check("cudaHostAlloc(descriptors)",
                cudaHostAlloc(&descs, kDescBlock * kDescBlocks * sizeof(cuda::CopyDesc),
                              cudaHostAllocMapped | cudaHostAllocPortable));
    descs_ = static_cast<cuda::CopyDesc*>(descs);
    for (size_t b = kDescBlocks; b-- > 0;) free_blocks_.push_back(static_cast<int>(b));
    log::info("cuda_ipc: device {} ({} SMs), endpoint {}", device_, sm_count_, own_.address());
  }

  ~CudaIpcDomain() override {
    own_.close();  // peers' new posts fail at once
    sync_streams();
    for (auto& b : inflight_) {
      for (auto& [region, generation] : b.holds) region->release();
      cudaEventDestroy(b.event);
    }
    inflight_.clear();
    // Regions still registered are revoked as dereg_mr would: their memory may be freed once the
    // engine is gone, so writers that hold them are waited for.
    own_.revoke_all(drain_timeout_, [this] { complete_batches(); });
    for (auto& [key, a] : opened_) cudaIpcCloseMemHandle(a.base);
    for (auto e : free_events_) cudaEventDestroy(e);
    for (cudaStream_t st : streams_) cudaStreamDestroy(st);
    cudaFreeHost(descs_);
  }

  DomainRegion register_region(LocalRegion& region, void* ptr, size_t len, Device device) override {
    DomainRegion r;
    if (device.kind == Device::Kind::kCuda) {
      region.gpu = region.device_readable = true;
      r.remote.rkey = publish(region.slot, exported(ptr, len, device));
    } else {
      // Pinned and mapped, host memory can be a kernel's source and a copy engine's without
      // staging. Peers cannot write host memory through CUDA IPC: a source only.
      cudaError_t rc =
          cudaHostRegister(ptr, len, cudaHostRegisterPortable | cudaHostRegisterMapped);
      if (rc == cudaSuccess) {
        region.host_registered = region.device_readable = true;
        region.host_ptr = ptr;
      } else {
        cudaGetLastError();
        region.device_readable = rc == cudaErrorHostMemoryAlreadyRegistered;
      }
      r.remote_access = false;
    }
    return r;
  }

  void deregister_region(LocalRegion& region) override {
    // Copies already issued into it complete meanwhile (REVIEW M3).
    if (region.gpu) unpublish(region.slot, [this] { complete_batches(); });
    if (region.host_registered) cudaHostUnregister(region.host_ptr);
  }

  // Releases the peer's IPC mappings and segment. WRITEs to it not yet handed to the GPU fail
  // now; those already issued are waited for (one stream synchronisation: removal is rare), and
  // their immediates, which had nowhere to go any more, complete with an error.
  void remove_peer(PeerId id) override {
    Peer* peer = peers_.live(id);
    if (!peer) return;
    auto gone = std::stable_partition(pending_.begin(), pending_.end(),
                                      [&](const PendingOp& op) { return op.peer != id; });
    for (auto it = gone; it != pending_.end(); ++it)
      ready_.push_back(
          ipc::error_completion(it->ctx, "cuda_ipc: the peer was removed before this WRITE ran"));
    pending_.erase(gone, pending_.end());
    if (!inflight_.empty()) sync_streams();
    peers_.forget(id);   // `id` is unknown from here on
    complete_batches();  // every batch has completed: holds on the peer's regions go now
    for (auto& [region_slot, m] : peer->regions) unmap(m);
    peers_.release(id);
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    PostResult result;
    Peer* peer = writable_peer(op.peer, ctx, result);
    if (!peer) return result;
    uint8_t* dst = nullptr;
    ipc::RegionEntry* region = nullptr;
    auto generation = static_cast<uint32_t>(op.rkey);
    if (op.len > 0) {  // an immediate-only WRITE touches no memory
      dst = map_remote(*peer, op.rkey, op.remote_addr, op.len);
      if (!dst) return PostResult::kFailed;
      region = &peer->inbox.region(static_cast<uint32_t>(op.rkey >> 32));
    }
    auto* src_region = static_cast<const LocalRegion*>(op.desc);
    pending_.push_back({ctx, op.peer, op.has_imm, src_region && src_region->device_readable, op.imm,
                        generation, region, op.src, dst, op.len});
    return PostResult::kPosted;
  }

  // The pages of a paged transfer to one peer, handed to the GPU now: each destination region is
  // held (and its generation checked) before the first copy into it, descriptors are written
  // into one descriptor block (the first kBatchKick launched at once when the domain's GPU work is
  // idle, the rest in a second launch at the end), pages of 1 MiB or more and those from memory no
  // kernel can read go to a copy engine, and one event ends the batch. When it has completed: the
  // holds go, the immediates go into the peer's inbox in one go, and ctx completes once. Every
  // WRITE is checked before anything is launched: an invalid one anywhere refuses the whole batch
  // (kFailed) with nothing posted; a CUDA call that fails after a launch fails the batch once its
  // event completes.
  PostResult post_write_batch(std::span<const WriteOp> ops, OpContext* ctx) override {
    PostResult result;
    Peer* peer = batch_peer(ops, ctx, result);
    if (!peer) return result;
    const PeerId id = ops[0].peer;
    // One descriptor block for the batch (kBatchMax fits one; copy-engine pages leave it unused).
    if (free_blocks_.empty()) return PostResult::kRetry;  // wait for launches to complete

    Batch b;
    b.group = ctx;
    b.group_peer = id;
    cudaStream_t stream = next_stream();
    if (ops[0].has_imm) b.imms.reserve(ops.size());  // a paged transfer: all or none have one
    b.event = take_event();
    std::string failure;
    bool issued = false;  // something of this batch runs on the GPU: it must end with its event
    // The destination of the WRITEs so far (a paged batch has one), and their source's region.
    uint64_t map_rkey = 0;
    uint8_t* map_base = nullptr;
    uint64_t map_len = 0;
    const void* src_desc = nullptr;
    bool src_readable = false;
    bool src_known = false;
    cuda::CopyDesc* block = nullptr;
    uint32_t descs = 0, launched = 0;  // in the current block: written, handed to the GPU
    // Nothing of ours runs on the GPU: launch the first kBatchKick pages at once, then each time
    // the pages written since double (256, 512, 1024, ...), so that the GPU copies while the host
    // writes the rest instead of idling until the block is full (a busy GPU gets the block in one
    // launch at the end).
    uint32_t next_launch = inflight_.empty() ? kBatchKick : static_cast<uint32_t>(kDescBlock);
    // Every WRITE checked before anything reaches the GPU: an invalid one refuses the whole batch
    // with nothing posted, wherever it is.
    for (const WriteOp& op : ops) {
      if (op.peer != id) {
        failure = "cuda_ipc: the WRITEs of a batch must go to one peer";
        break;
      }
      if (op.len == 0) continue;
      if (map_base == nullptr || op.rkey != map_rkey) {
        if (!map_batch_destination(*peer, b, op.rkey, map_base, map_len, failure)) break;
        map_rkey = op.rkey;
      }
      if (op.remote_addr > map_len || op.len > map_len - op.remote_addr) {
        failure = fmt::format("cuda_ipc: [{}, +{}) is outside the remote region of {} bytes",
                              op.remote_addr, op.len, map_len);
        break;
      }
    }
    if (!failure.empty()) {
      release(b);
      free_events_.push_back(b.event);
      return refuse(std::move(failure));
    }
    map_base = nullptr;
    auto launch = [&] {
      cudaError_t rc =
          cuda::launch_gather_copy(block + launched, descs - launched, sm_count_, stream);
      issued = true;
      if (rc != cudaSuccess && failure.empty())
        failure = fmt::format("cuda_ipc: gather-copy launch failed: {}", cudaGetErrorString(rc));
      launched = descs;
      if (descs == kDescBlock) {
        block = nullptr;
        descs = launched = 0;
      }
    };
    for (const WriteOp& op : ops) {  // checked above: the peer, the keys, the bounds
      if (op.has_imm) b.imms.push_back(op.imm);
      if (op.len == 0) continue;  // an immediate only
      if (map_base == nullptr || op.rkey != map_rkey) {
        if (!map_batch_destination(*peer, b, op.rkey, map_base, map_len, failure)) break;
        map_rkey = op.rkey;
      }
      uint8_t* dst = map_base + op.remote_addr;
      if (!src_known || op.desc != src_desc) {
        auto* r = static_cast<const LocalRegion*>(op.desc);
        src_desc = op.desc;
        src_readable = r && r->device_readable;
        src_known = true;
      }
      if (op.len >= kBatchCopyEngineMin || !src_readable) {
        cudaError_t rc = cudaMemcpyAsync(dst, op.src, op.len, cudaMemcpyDefault, stream);
        if (rc != cudaSuccess) {
          cudaGetLastError();
          failure = fmt::format("cuda_ipc: cudaMemcpyAsync of {} bytes failed: {}", op.len,
                                cudaGetErrorString(rc));
          break;
        }
        issued = true;
        continue;
      }
      if (!block) {  // reserved above: never empty here (one block: kBatchMax <= kDescBlock)
        int k = free_blocks_.back();
        free_blocks_.pop_back();
        b.group_blocks[b.group_block_count++] = k;
        block = descs_ + static_cast<size_t>(k) * kDescBlock;
      }
      block[descs++] = {op.src, dst, op.len};
      if (descs == next_launch || descs == kDescBlock) {
        launch();
        next_launch = std::min<uint32_t>(2 * next_launch, kDescBlock);
      }
    }
    if (!failure.empty() && !issued) {  // nothing reached the GPU: refuse the batch now
      release(b);
      free_events_.push_back(b.event);
      return refuse(std::move(failure));
    }
    if (failure.empty() && descs > launched) launch();
    b.failure = std::move(failure);
    b.id = ++batches_;
    log::debug("cuda_ipc: batch {} ({} WRITEs of a write batch) handed to the GPU", b.id,
               ops.size());
    cuda::check("cudaEventRecord", cudaEventRecord(b.event, stream));
    inflight_.push_back(std::move(b));
    return PostResult::kPosted;
  }

  // Single WRITEs to the GPU, completed batches' immediates to their peers, in posting order.
  void progress() override {
    flush();
    complete_batches();
    if (!pending_.empty()) flush();  // completed batches freed descriptor blocks
    while (!held_.empty() && deliver_imm(held_.front())) held_.pop_front();
  }

 private:
  // What a peer needs to open [ptr, +len) of a CUDA allocation: its IPC handle and the offset.
  ipc::RegionFields exported(void* ptr, size_t len, Device device) {
    cuda::AddressRange range = cuda::allocation_of(ptr);
    auto* p = static_cast<uint8_t*>(ptr);
    if (p + len > range.base + range.size)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("reg_mr: [{}, +{}) runs past the end of its CUDA allocation "
                              "({} bytes at {})",
                              ptr, len, range.size, static_cast<void*>(range.base)));
    cudaIpcMemHandle_t handle;
    cuda::check(
        "cudaIpcGetMemHandle (memory from cudaMalloc is exportable; cuMemCreate memory "
        "is not)",
        cudaIpcGetMemHandle(&handle, range.base));
    ipc::RegionFields f;
    f.device = device.index;
    f.offset = static_cast<uint64_t>(p - range.base);
    f.len = len;
    f.owner_ptr = reinterpret_cast<uint64_t>(ptr);
    std::memcpy(f.handle, &handle, sizeof handle);
    return f;
  }

  // The local address of [remote_addr, +len) of the peer's region `rkey`, or null (last_error_).
  uint8_t* map_remote(Peer& peer, uint64_t rkey, uint64_t remote_addr, uint64_t len) {
    uint32_t slot, generation;
    if (!split_key(rkey, slot, generation)) return nullptr;
    ipc::RegionEntry& e = peer.inbox.region(slot);
    Peer::Mapped& m = peer.regions[slot];
    if (m.generation != generation || !m.ptr) {
      unmap(m);
      ipc::RegionFields copy;
      if (!e.read(generation, copy)) {  // the seqlock: a torn or stale copy is refused
        last_error_ = "cuda_ipc: the remote region was deregistered";
        return nullptr;
      }
      try {
        m.ptr = open_region(peer, copy, m.handle_key);
      } catch (const Error& err) {
        last_error_ = err.what();
        return nullptr;
      }
      m.len = copy.len;
      m.generation = generation;
    } else if (!e.is(generation)) {
      last_error_ = "cuda_ipc: the remote region was deregistered";
      return nullptr;
    }
    if (remote_addr > m.len || len > m.len - remote_addr) {
      last_error_ = fmt::format("cuda_ipc: [{}, +{}) is outside the remote region of {} bytes",
                                remote_addr, len, m.len);
      return nullptr;
    }
    return m.ptr + remote_addr;
  }

  uint8_t* open_region(const Peer& peer, const ipc::RegionFields& e, std::string& handle_key) {
    // CUDA refuses to open a handle in the process that exported it: use the address itself.
    if (peer.same_process) return reinterpret_cast<uint8_t*>(e.owner_ptr);
    std::string key(reinterpret_cast<const char*>(e.handle), sizeof e.handle);
    OpenedAllocation& a = opened_[key];
    if (!a.base) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, e.handle, sizeof handle);
      void* base = nullptr;
      cudaError_t rc = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
      if (rc != cudaSuccess) {
        opened_.erase(key);
        cuda::check("cudaIpcOpenMemHandle", rc);
      }
      a.base = static_cast<uint8_t*>(base);
    }
    handle_key = std::move(key);
    a.refs++;
    return a.base + e.offset;
  }

  void unmap(Peer::Mapped& m) {
    if (!m.handle_key.empty()) {
      auto it = opened_.find(m.handle_key);
      if (it != opened_.end() && --it->second.refs == 0) {
        sync_streams();  // no copy of ours may still use the mapping
        cudaIpcCloseMemHandle(it->second.base);
        opened_.erase(it);
      }
    }
    m = {};
  }

  // Batches take the streams in turn.
  cudaStream_t next_stream() { return streams_[next_stream_++ % kStreams]; }
  void sync_streams() {
    for (cudaStream_t st : streams_) cudaStreamSynchronize(st);
  }

  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    cuda::check("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // A hold on the op's destination region for batch `b` (taken once per region and batch), or
  // false when the region was deregistered since the op was posted.
  // (While we hold a generation, its owner cannot publish a newer one in that entry, so an op of
  // another generation for a held entry is a stale one.)
  using Held = std::pair<ipc::RegionEntry*, uint32_t>;
  static bool hold_for(Batch& b, const PendingOp& op, std::vector<Held>& refused) {
    Held want{op.region, op.generation};
    for (const Held& h : b.holds)
      if (h.first == op.region) return h.second == op.generation;
    if (std::find(refused.begin(), refused.end(), want) != refused.end()) return false;
    if (op.region->hold(op.generation)) {
      b.holds.push_back(want);
      return true;
    }
    refused.push_back(want);
    return false;
  }

  // For post_write_batch: the local address and length of the peer's region `rkey`, held for
  // batch `b` from now until the batch has completed. False (and `failure`) when the key is
  // invalid, the region was deregistered, or the batch already holds another generation of that
  // entry (then `rkey` is stale: its owner cannot publish a newer one while we hold it, and
  // mapping it would close the mapping the batch's earlier copies use).
  bool map_batch_destination(Peer& peer, Batch& b, uint64_t rkey, uint8_t*& base, uint64_t& len,
                             std::string& failure) {
    auto slot = static_cast<uint32_t>(rkey >> 32);
    auto generation = static_cast<uint32_t>(rkey);
    if (slot < ipc::kMaxRegions) {
      ipc::RegionEntry* entry = &peer.inbox.region(slot);
      for (const Held& h : b.holds)
        if (h.first == entry && h.second != generation) {
          failure = "cuda_ipc: the remote region was deregistered";
          return false;
        }
    }
    uint8_t* p = map_remote(peer, rkey, 0, 0);  // checks the key and the generation, maps
    if (!p) {
      failure = last_error_;
      return false;
    }
    ipc::RegionEntry* entry = &peer.inbox.region(slot);
    bool held = false;
    for (const Held& h : b.holds) held |= h.first == entry;
    if (!held) {
      if (!entry->hold(generation)) {  // deregistered since map_remote looked
        failure = "cuda_ipc: the remote region was deregistered";
        return false;
      }
      b.holds.push_back({entry, generation});
    }
    const Peer::Mapped& m = peer.regions[slot];
    base = m.ptr;
    len = m.len;
    return true;
  }

  // Hands pending WRITEs to the GPU, in order, as batches that each end with one event. Each
  // destination region is held (and its generation re-checked) right before its first copy.
  void flush() {
    size_t i = 0;
    std::vector<Held> refused;
    while (i < pending_.size()) {
      Batch b;
      uint32_t descs = 0;
      const cudaStream_t stream = next_stream();
      for (; i < pending_.size() && b.ops.size() < kDescBlock; i++) {
        const PendingOp& op = pending_[i];
        bool engine = op.len >= kCopyEngineMin || !op.kernel_ok;
        const uint64_t chunks = engine ? 0 : (op.len + kChunk - 1) / kChunk;
        if (descs + chunks > kDescBlock) break;  // the next batch takes it
        if (op.len > 0 && !engine && b.desc_block < 0) {
          if (free_blocks_.empty()) break;  // the rest waits for a completed launch
          b.desc_block = free_blocks_.back();
          free_blocks_.pop_back();
        }
        if (op.len > 0 && !hold_for(b, op, refused)) {
          ready_.push_back(
              ipc::error_completion(op.ctx, "cuda_ipc: the remote region was deregistered"));
          continue;
        }
        if (op.len > 0 && engine) {
          if (!issue(cudaMemcpyAsync(op.dst, op.src, op.len, cudaMemcpyDefault, stream),
                     "cudaMemcpyAsync", op))
            continue;
        } else if (op.len > 0) {
          for (uint64_t at = 0; at < op.len; at += kChunk)
            descs_[b.desc_block * kDescBlock + descs++] = {static_cast<const uint8_t*>(op.src) + at,
                                                           static_cast<uint8_t*>(op.dst) + at,
                                                           std::min(kChunk, op.len - at)};
        }
        b.ops.push_back(op);
      }
      if (b.ops.empty()) {
        release(b);
        if (i < pending_.size() && free_blocks_.empty()) break;
        continue;
      }
      if (descs > 0) {
        cudaError_t rc =
            cuda::launch_gather_copy(descs_ + b.desc_block * kDescBlock, descs, sm_count_, stream);
        // The batch's copy-engine WRITEs may still run: fail it once its event says they are done.
        if (rc != cudaSuccess)
          b.failure =
              fmt::format("cuda_ipc: gather-copy launch failed: {}", cudaGetErrorString(rc));
      }
      b.event = take_event();
      b.id = ++batches_;
      cuda::check("cudaEventRecord", cudaEventRecord(b.event, stream));
      if (log::level() >= log::Level::kDebug) {
        std::string what;
        for (const PendingOp& op : b.ops)
          what +=
              fmt::format(" {}B{}", op.len, op.has_imm ? fmt::format("/imm {:#x}", op.imm) : "");
        log::debug(
            "cuda_ipc: batch {} of {} WRITEs handed to the GPU on stream {} ({} descriptors):{}",
            b.id, b.ops.size(), (next_stream_ - 1) % kStreams, descs, what);
      }
      inflight_.push_back(std::move(b));
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<long>(i));
  }

  // A batch that will not run (or has run): its holds and descriptor block go back.
  void release(Batch& b) {
    for (auto& [region, generation] : b.holds) region->release();
    b.holds.clear();
    if (b.desc_block >= 0) free_blocks_.push_back(b.desc_block);
    b.desc_block = -1;
    for (size_t k = 0; k < b.group_block_count; k++) free_blocks_.push_back(b.group_blocks[k]);
    b.group_block_count = 0;
  }

  bool issue(cudaError_t rc, const char* call, const PendingOp& op) {
    if (rc == cudaSuccess) return true;
    cudaGetLastError();
    Completion c;
    c.kind = Completion::Kind::kError;
    c.context = op.ctx;
    c.error =
        fmt::format("cuda_ipc: {} of {} bytes failed: {}", call, op.len, cudaGetErrorString(rc));
    ready_.push_back(std::move(c));
    return false;
  }

  void fail_batch(Batch& b, const std::string& why) {
    if (b.group) ready_.push_back(ipc::error_completion(b.group, why));  // one error for the batch
    for (auto& op : b.ops) ready_.push_back(ipc::error_completion(op.ctx, why));
    release(b);
    if (b.event) free_events_.push_back(b.event);
  }

  void complete_batches() {
    while (!inflight_.empty()) {
      Batch& b = inflight_.front();
      cudaError_t rc = cudaEventQuery(b.event);
      if (rc == cudaErrorNotReady) break;
      log::debug("cuda_ipc: batch {} of {} WRITEs completed on the GPU", b.id,
                 b.group ? b.imms.size() : b.ops.size());
      if (rc != cudaSuccess) {
        cudaGetLastError();
        fail_batch(b, fmt::format("cuda_ipc: copy failed on the GPU: {}", cudaGetErrorString(rc)));
      } else if (!b.failure.empty()) {
        fail_batch(b, b.failure);
      } else if (b.group) {
        release(b);  // the copies are done: their regions' owners may deregister now
        ipc::HeldImms g{b.group, b.group_peer, std::move(b.imms)};
        if (!deliver(g)) held_imms_.push_back(std::move(g));  // the inbox is full
        free_events_.push_back(b.event);
      } else {
        release(b);  // the copies are done: their regions' owners may deregister now
        for (auto& op : b.ops) {
          if (!op.has_imm) {
            ready_.push_back(ipc::local_completion(op.ctx));
          } else if (!deliver_imm(op)) {
            held_.push_back(op);  // the peer's inbox is full: deliver on a later poll
          }
        }
        free_events_.push_back(b.event);
      }
      inflight_.pop_front();
    }
  }

  // Delivers op's immediate and completes op; false when the peer's inbox is full.
  bool deliver_imm(const PendingOp& op) {
    Peer* peer = receiving_peer(op.peer, op.ctx, "this WRITE's immediate was");
    if (!peer) return true;
    if (!peer->inbox.push_imm(op.imm)) return false;
    ready_.push_back(ipc::local_completion(op.ctx));
    return true;
  }

  int device_;
  int sm_count_ = 0;
  std::array<cudaStream_t, kStreams> streams_{};
  size_t next_stream_ = 0;
  uint64_t batches_ = 0;
  cuda::CopyDesc* descs_ = nullptr;
  std::vector<int> free_blocks_;
  std::vector<cudaEvent_t> free_events_;
  std::unordered_map<std::string, OpenedAllocation> opened_;
  std::vector<PendingOp> pending_;
  std::deque<Batch> inflight_;
  std::deque<PendingOp> held_;  // single WRITEs completed whose immediate found the inbox full
};

}  // namespace

std::unique_ptr<Domain> open_cuda_ipc_domain(const EngineConfig& config) {
  return std::make_unique<CudaIpcDomain>(config);
}

}  // namespace fabric
