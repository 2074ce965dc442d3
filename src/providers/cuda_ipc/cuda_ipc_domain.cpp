// cuda_ipc Domain. A WRITE is queued at post time and handed to the GPU at the next poll: writes
// of 1 MiB or more each become one cudaMemcpyAsync (a copy engine), smaller ones are gathered
// into one kernel launch per batch. A batch's event marks its local completion; only then does
// its immediate go to the peer's inbox, so a peer that sees the immediate sees the data.
#include "providers/cuda_ipc/cuda_ipc_domain.h"

#include <unistd.h>

#include <deque>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/driver_api.h"
#include "providers/cuda_ipc/gather_copy.h"
#include "providers/cuda_ipc/ipc_shared.h"
#include "providers/cuda_ipc/shm_segment.h"
#include "util/log.h"

namespace fabric {
namespace {

constexpr const char* kShmPrefix = "fabric-ipc-";
constexpr size_t kDescBlock = 2048;      // copies per gather launch
constexpr size_t kDescBlocks = 32;       // gather launches in flight
constexpr uint64_t kCopyEngineMin = 1 << 20;  // a WRITE this large goes to a copy engine alone

std::string read_host_scope() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  if (id.empty())
    throw Error(ErrorCode::kProvider, "cuda_ipc: cannot read /proc/sys/kernel/random/boot_id");
  return id;
}

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
  uint32_t peer;
  bool has_imm;
  bool kernel_ok;
  uint32_t imm;
  const void* src;
  void* dst;
  uint64_t len;
};

struct Batch {
  cudaEvent_t event = nullptr;
  int desc_block = -1;
  std::vector<PendingOp> ops;
};

struct Peer {
  struct Mapped {
    uint32_t generation = 0;
    uint8_t* ptr = nullptr;
    uint64_t len = 0;
    std::string handle_key;  // empty when not opened through IPC (same process)
  };
  std::string address;
  ShmSegment shm;
  ipc::Endpoint inbox;
  pid_t pid = 0;
  bool same_process = false;
  std::unordered_map<uint32_t, Mapped> regions;
};

struct OpenedAllocation {
  uint8_t* base = nullptr;
  int refs = 0;
};

class CudaIpcDomain final : public Domain {
 public:
  explicit CudaIpcDomain(const EngineConfig& config) : device_(*config.cuda_device) {
    cuda::use_device(device_);
    cuda::check("cudaDeviceGetAttribute",
                cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    cuda::check("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    void* descs = nullptr;
    cuda::check("cudaHostAlloc(descriptors)",
                cudaHostAlloc(&descs, kDescBlock * kDescBlocks * sizeof(cuda::CopyDesc),
                              cudaHostAllocMapped | cudaHostAllocPortable));
    descs_ = static_cast<cuda::CopyDesc*>(descs);
    for (size_t b = kDescBlocks; b-- > 0;) free_blocks_.push_back(static_cast<int>(b));

    ShmSegment::remove_stale(kShmPrefix);
    static std::atomic<uint32_t> counter{0};
    std::string name = fmt::format("/{}{}-{}", kShmPrefix, getpid(), counter.fetch_add(1));
    ipc::Layout layout(config.max_message_size);
    shm_ = ShmSegment::create(name, layout.total);
    ipc::Endpoint::format(shm_.data(), static_cast<uint32_t>(getpid()), config.max_message_size);
    inbox_ = ipc::Endpoint(shm_.data());
    for (uint32_t s = ipc::kMaxRegions; s-- > 0;) free_slots_.push_back(s);
    scope_ = read_host_scope();
    address_ = fmt::format("{}/{}", scope_, name);
    log::info("cuda_ipc: device {} ({} SMs), endpoint {}", device_, sm_count_, address_);
  }

  ~CudaIpcDomain() override {
    cudaStreamSynchronize(stream_);
    for (auto& [key, a] : opened_) cudaIpcCloseMemHandle(a.base);
    for (auto& b : inflight_) cudaEventDestroy(b.event);
    for (auto e : free_events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
    cudaFreeHost(descs_);
  }

  const std::string& provider_name() const override { return name_; }
  const std::string& address() const override { return address_; }
  size_t max_in_flight() const override { return kDescBlock * kDescBlocks; }

  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    auto region = std::make_unique<LocalRegion>();
    DomainRegion r;
    if (device.kind == Device::Kind::kCuda) {
      region->gpu = region->device_readable = true;
      region->slot = export_region(ptr, len, device);
      ipc::RegionEntry& e = inbox_.region(region->slot);
      r.remote.rkey = (static_cast<uint64_t>(region->slot) << 32) |
                      e.generation.load(std::memory_order_relaxed);
    } else {
      // Pinned and mapped, host memory can be a kernel's source and a copy engine's without
      // staging. Peers cannot write host memory through CUDA IPC: a source only.
      cudaError_t rc = cudaHostRegister(ptr, len, cudaHostRegisterPortable | cudaHostRegisterMapped);
      if (rc == cudaSuccess) {
        region->host_registered = region->device_readable = true;
        region->host_ptr = ptr;
      } else {
        cudaGetLastError();
        region->device_readable = rc == cudaErrorHostMemoryAlreadyRegistered;
      }
      r.remote_access = false;
    }
    r.desc = region.get();
    r.provider = region.release();
    return r;
  }

  void deregister_memory(DomainRegion& r) override {
    auto* region = static_cast<LocalRegion*>(r.provider);
    if (!region) return;
    if (region->gpu) {
      inbox_.region(region->slot).generation.fetch_add(1, std::memory_order_release);  // even: gone
      free_slots_.push_back(region->slot);
    }
    if (region->host_registered) cudaHostUnregister(region->host_ptr);
    delete region;
    r = {};
  }

  PeerId insert_peer(const std::string& address) override {
    for (size_t i = 0; i < peers_.size(); i++)
      if (peers_[i].address == address) return i;
    auto slash = address.find('/');
    if (slash == std::string::npos || address.compare(0, slash, scope_) != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("cuda_ipc: peer endpoint '{}' is not on this host (boot id {})",
                              address, scope_));
    Peer p;
    p.address = address;
    p.shm = ShmSegment::open(address.substr(slash));
    auto* h = static_cast<ipc::Header*>(p.shm.data());
    if (p.shm.size() < sizeof(ipc::Header) || h->magic != ipc::kMagic)
      throw Error(ErrorCode::kMalformed, fmt::format("cuda_ipc: {} is not a fabric-lib endpoint", address));
    p.inbox = ipc::Endpoint(p.shm.data());
    if (p.inbox.size() > p.shm.size())
      throw Error(ErrorCode::kMalformed, fmt::format("cuda_ipc: {} is truncated", address));
    p.pid = static_cast<pid_t>(h->pid);
    p.same_process = p.pid == getpid();
    peers_.push_back(std::move(p));
    return peers_.size() - 1;
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    Peer& peer = peers_.at(op.peer);
    uint8_t* dst = nullptr;
    if (op.len > 0) {  // an immediate-only WRITE touches no memory
      dst = map_remote(peer, op.rkey, op.remote_addr, op.len);
      if (!dst) return PostResult::kFailed;
    }
    auto* src_region = static_cast<const LocalRegion*>(op.desc);
    pending_.push_back({ctx, static_cast<uint32_t>(op.peer), op.has_imm,
                        src_region && src_region->device_readable, op.imm, op.src, dst, op.len});
    return PostResult::kPosted;
  }

  PostResult post_send(PeerId peer_id, const void* buf, size_t len, void*, OpContext* ctx) override {
    Peer& peer = peers_.at(peer_id);
    if (len > peer.inbox.msg_capacity()) {
      last_error_ = fmt::format("cuda_ipc: message of {} bytes exceeds the peer's slots of {} bytes "
                                "(its EngineConfig::max_message_size)",
                                len, peer.inbox.msg_capacity());
      return PostResult::kFailed;
    }
    if (!peer.inbox.push_msg(buf, len)) return PostResult::kRetry;  // the peer's inbox is full
    ready_.push_back(local_completion(ctx));
    return PostResult::kPosted;
  }

  PostResult post_recv(void* buf, size_t len, void*, OpContext* ctx) override {
    recvs_.push_back({buf, len, ctx});
    return PostResult::kPosted;
  }

  const std::string& last_error() const override { return last_error_; }

  size_t poll(std::span<Completion> out) override {
    flush();
    complete_batches();
    if (!pending_.empty()) flush();  // completed batches freed descriptor blocks
    deliver_held_imms();

    size_t n = 0;
    while (n < out.size() && !ready_.empty()) {
      out[n++] = std::move(ready_.front());
      ready_.pop_front();
    }
    uint32_t imm;
    while (n < out.size() && inbox_.pop_imm(imm)) {
      Completion& c = out[n++];
      c = Completion{};
      c.kind = Completion::Kind::kRemoteImm;
      c.imm = imm;
    }
    while (n < out.size() && !recvs_.empty()) {
      const ipc::MsgCellHeader* m = inbox_.peek_msg();
      if (!m) break;
      PostedRecv r = recvs_.front();
      recvs_.pop_front();
      Completion& c = out[n++];
      c = Completion{};
      c.context = r.ctx;
      if (m->len <= r.len) {
        std::memcpy(r.buf, reinterpret_cast<const uint8_t*>(m) + sizeof(*m), m->len);
        c.kind = Completion::Kind::kRecv;
        c.len = m->len;
      } else {
        c.kind = Completion::Kind::kError;
        c.error = fmt::format("cuda_ipc: message of {} bytes dropped: the receive buffers hold {}",
                              m->len, r.len);
      }
      inbox_.pop_msg();
    }
    return n;
  }

  void* scratch_desc() const override { return nullptr; }
  void* scratch_buffer() const override { return const_cast<uint8_t*>(scratch_); }

 private:
  struct PostedRecv {
    void* buf;
    size_t len;
    OpContext* ctx;
  };

  static Completion local_completion(OpContext* ctx) {
    Completion c;
    c.kind = Completion::Kind::kLocal;
    c.context = ctx;
    return c;
  }

  uint32_t export_region(void* ptr, size_t len, Device device) {
    cuda::AddressRange range = cuda::allocation_of(ptr);
    auto* p = static_cast<uint8_t*>(ptr);
    if (p + len > range.base + range.size)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("reg_mr: [{}, +{}) runs past the end of its CUDA allocation "
                              "({} bytes at {})",
                              ptr, len, range.size, static_cast<void*>(range.base)));
    cudaIpcMemHandle_t handle;
    cuda::check("cudaIpcGetMemHandle (memory from cudaMalloc is exportable; cuMemCreate memory is "
                "not)",
                cudaIpcGetMemHandle(&handle, range.base));
    if (free_slots_.empty())
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("cuda_ipc: all {} exported regions are in use", ipc::kMaxRegions));
    uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    ipc::RegionEntry& e = inbox_.region(slot);
    e.device = device.index;
    e.offset = static_cast<uint64_t>(p - range.base);
    e.len = len;
    e.owner_ptr = reinterpret_cast<uint64_t>(ptr);
    e.handle = handle;
    e.generation.fetch_add(1, std::memory_order_release);  // odd: published
    return slot;
  }

  // The local address of [remote_addr, +len) of the peer's region `rkey`, or null (last_error_).
  uint8_t* map_remote(Peer& peer, uint64_t rkey, uint64_t remote_addr, uint64_t len) {
    auto slot = static_cast<uint32_t>(rkey >> 32);
    auto generation = static_cast<uint32_t>(rkey);
    if (slot >= ipc::kMaxRegions || (generation & 1) == 0) {
      last_error_ = fmt::format("cuda_ipc: invalid remote key {:#x}", rkey);
      return nullptr;
    }
    ipc::RegionEntry& e = peer.inbox.region(slot);
    Peer::Mapped& m = peer.regions[slot];
    if (m.generation != generation || !m.ptr) {
      unmap(m);
      ipc::RegionEntry copy;
      copy.device = e.device;
      copy.offset = e.offset;
      copy.len = e.len;
      copy.owner_ptr = e.owner_ptr;
      copy.handle = e.handle;
      if (e.generation.load(std::memory_order_acquire) != generation) {
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
    } else if (e.generation.load(std::memory_order_acquire) != generation) {
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

  uint8_t* open_region(const Peer& peer, const ipc::RegionEntry& e, std::string& handle_key) {
    // CUDA refuses to open a handle in the process that exported it: use the address itself.
    if (peer.same_process) return reinterpret_cast<uint8_t*>(e.owner_ptr);
    handle_key.assign(reinterpret_cast<const char*>(&e.handle), sizeof e.handle);
    OpenedAllocation& a = opened_[handle_key];
    if (!a.base) {
      void* base = nullptr;
      cuda::check("cudaIpcOpenMemHandle",
                  cudaIpcOpenMemHandle(&base, e.handle, cudaIpcMemLazyEnablePeerAccess));
      a.base = static_cast<uint8_t*>(base);
    }
    a.refs++;
    return a.base + e.offset;
  }

  void unmap(Peer::Mapped& m) {
    if (!m.handle_key.empty()) {
      auto it = opened_.find(m.handle_key);
      if (it != opened_.end() && --it->second.refs == 0) {
        cudaStreamSynchronize(stream_);  // no copy of ours may still use the mapping
        cudaIpcCloseMemHandle(it->second.base);
        opened_.erase(it);
      }
    }
    m = {};
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

  // Hands pending WRITEs to the GPU, in order, as batches that each end with one event.
  void flush() {
    size_t i = 0;
    while (i < pending_.size()) {
      Batch b;
      uint32_t descs = 0;
      for (; i < pending_.size() && b.ops.size() < kDescBlock; i++) {
        const PendingOp& op = pending_[i];
        if (op.len > 0 && (op.len >= kCopyEngineMin || !op.kernel_ok)) {
          if (!issue(cudaMemcpyAsync(op.dst, op.src, op.len, cudaMemcpyDefault, stream_), "cudaMemcpyAsync", op))
            continue;
        } else if (op.len > 0) {
          if (b.desc_block < 0) {
            if (free_blocks_.empty()) break;  // the rest waits for a completed launch
            b.desc_block = free_blocks_.back();
            free_blocks_.pop_back();
          }
          descs_[b.desc_block * kDescBlock + descs++] = {op.src, op.dst, op.len};
        }
        b.ops.push_back(op);
      }
      if (b.ops.empty()) break;
      if (descs > 0) {
        cudaError_t rc = cuda::launch_gather_copy(descs_ + b.desc_block * kDescBlock, descs,
                                                  sm_count_, stream_);
        if (rc != cudaSuccess) {
          fail_batch(b, fmt::format("cuda_ipc: gather-copy launch failed: {}", cudaGetErrorString(rc)));
          continue;
        }
      }
      b.event = take_event();
      cuda::check("cudaEventRecord", cudaEventRecord(b.event, stream_));
      inflight_.push_back(std::move(b));
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<long>(i));
  }

  bool issue(cudaError_t rc, const char* call, const PendingOp& op) {
    if (rc == cudaSuccess) return true;
    cudaGetLastError();
    Completion c;
    c.kind = Completion::Kind::kError;
    c.context = op.ctx;
    c.error = fmt::format("cuda_ipc: {} of {} bytes failed: {}", call, op.len, cudaGetErrorString(rc));
    ready_.push_back(std::move(c));
    return false;
  }

  void fail_batch(Batch& b, const std::string& why) {
    for (auto& op : b.ops) {
      Completion c;
      c.kind = Completion::Kind::kError;
      c.context = op.ctx;
      c.error = why;
      ready_.push_back(std::move(c));
    }
    if (b.desc_block >= 0) free_blocks_.push_back(b.desc_block);
    if (b.event) free_events_.push_back(b.event);
  }

  void complete_batches() {
    while (!inflight_.empty()) {
      Batch& b = inflight_.front();
      cudaError_t rc = cudaEventQuery(b.event);
      if (rc == cudaErrorNotReady) break;
      if (rc != cudaSuccess) {
        cudaGetLastError();
        fail_batch(b, fmt::format("cuda_ipc: copy failed on the GPU: {}", cudaGetErrorString(rc)));
      } else {
        for (auto& op : b.ops) {
          if (op.has_imm && !peers_[op.peer].inbox.push_imm(op.imm)) {
            held_.push_back(op);  // the peer's inbox is full: deliver on a later poll
            continue;
          }
          ready_.push_back(local_completion(op.ctx));
        }
        if (b.desc_block >= 0) free_blocks_.push_back(b.desc_block);
        free_events_.push_back(b.event);
      }
      inflight_.pop_front();
    }
  }

  void deliver_held_imms() {
    while (!held_.empty() && peers_[held_.front().peer].inbox.push_imm(held_.front().imm)) {
      ready_.push_back(local_completion(held_.front().ctx));
      held_.pop_front();
    }
  }

  const std::string name_ = "cuda_ipc";
  int device_;
  int sm_count_ = 0;
  cudaStream_t stream_ = nullptr;
  cuda::CopyDesc* descs_ = nullptr;
  std::vector<int> free_blocks_;
  std::vector<cudaEvent_t> free_events_;
  ShmSegment shm_;
  ipc::Endpoint inbox_;
  std::vector<uint32_t> free_slots_;
  std::string scope_;
  std::string address_;
  std::string last_error_;
  std::vector<Peer> peers_;
  std::unordered_map<std::string, OpenedAllocation> opened_;
  std::vector<PendingOp> pending_;
  std::deque<Batch> inflight_;
  std::deque<PendingOp> held_;
  std::deque<Completion> ready_;
  std::deque<PostedRecv> recvs_;
  uint8_t scratch_[64] = {};
};

}  // namespace

std::unique_ptr<Domain> open_cuda_ipc_domain(const EngineConfig& config) {
  return std::make_unique<CudaIpcDomain>(config);
}

}  // namespace fabric
