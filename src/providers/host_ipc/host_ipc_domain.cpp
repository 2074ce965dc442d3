// host_ipc Domain. A WRITE is copied at post time, by the initiator, from its source straight
// into the peer's registered memory with process_vm_writev (the kernel's cross-memory attach, as
// UCX's cma transport does): one copy, and the peer's CPU does nothing for the bytes. The pages of
// a post_write_batch go in as few calls as there are IOV_MAX iovecs (neighbours that are contiguous
// on both sides merged into one). Only then does a WRITE's immediate go into the peer's inbox, so
// a peer that sees the immediate sees the data. Regions, inboxes, messages, the writers' holds
// that make deregistration safe, and liveness are cuda_ipc's protocol (ipc_shared.h,
// shm_segment.h) over an endpoint of kind kHost.
//
// process_vm_writev needs ptrace access to the peer: each domain lets any process of its user
// attach (prctl PR_SET_PTRACER_ANY, for Yama's ptrace_scope 1), and insert_peer tries a write into
// the peer's header once; a peer that cannot be written (Yama 2 or 3, a seccomp filter, another
// user) is refused with kUnsupported, and the engine uses its NICs for it.
#include "providers/host_ipc/host_ipc_domain.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "providers/ipc/local_domain.h"

namespace fabric {
namespace {

constexpr size_t kBatchMax = 1024;   // WRITEs per post_write_batch: 64 MiB of 64 KiB pages, ~10 ms
constexpr size_t kIovMax = IOV_MAX;  // iovecs per process_vm_writev

// One of this domain's registrations.
struct LocalRegion {
  bool host = true;            // false: GPU memory, which this domain cannot read or export
  uint32_t slot = UINT32_MAX;  // its entry in our region table
};

struct Peer : ipc::PeerEndpoint {
  struct Mapped {
    uint32_t generation = 0;
    uint64_t base = 0;  // the region's address in the peer's process
    uint64_t len = 0;
  };
  pid_t pid = 0;
  int pidfd = -1;  // readable once the peer's process has ended (-1: no pidfd_open)
  std::unordered_map<uint32_t, Mapped> regions;

  Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer() {
    if (pidfd >= 0) close(pidfd);
  }
  // Checked before each copy: a PID is reused only after its process has ended, and the pidfd
  // says so without waiting for the next liveness sweep.
  bool ended() {
    if (inbox.closed()) return true;
    if (pidfd < 0) return false;
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
};

// One copy of a batch: [src, +len) to the peer's address dst.
struct Copy {
  const uint8_t* src;
  uint64_t dst;
  uint64_t len;
};

// Host memory only; 65,536 operations in flight (copies are done when posted: what is in flight is
// only completions not yet polled); batches of up to kBatchMax WRITEs, as few process_vm_writev
// calls as their iovecs need.
class HostIpcDomain final : public ipc::LocalDomain<Peer, LocalRegion> {
 public:
  explicit HostIpcDomain(const EngineConfig& config)
      : LocalDomain(
            "host_ipc", ipc::EndpointKind::kHost, config,
            {.gpu_memory = false, .max_in_flight = size_t{1} << 16, .max_write_batch = kBatchMax}) {
    // Yama's ptrace_scope 1 lets only ancestors attach: let peers of this user write into us.
    // Elsewhere (no Yama) the call fails harmlessly; insert_peer's probe tells what holds.
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    log::info("host_ipc: endpoint {}", own_.address());
  }

  ~HostIpcDomain() override {
    own_.close();
    // Regions still registered are revoked as deregistration would: their memory may be freed
    // once the engine is gone, so writers that hold them are waited for.
    own_.revoke_all(drain_timeout_, [] {});
  }

  DomainRegion register_region(LocalRegion& region, void* ptr, size_t len, Device device) override {
    DomainRegion r;
    if (device.kind == Device::Kind::kCuda) {
      region.host = false;  // posts from it are refused; the NICs (or cuda_ipc) carry GPU memory
      r.remote_access = false;
    } else {
      ipc::RegionFields f;
      f.device = -1;
      f.len = len;
      f.owner_ptr = reinterpret_cast<uint64_t>(ptr);
      r.remote.rkey = publish(region.slot, f);
    }
    return r;
  }

  void deregister_region(LocalRegion& region) override {
    if (region.host) unpublish(region.slot, [] {});
  }

  // Refuses (kUnsupported) a process we may not write into: the engine then uses its NICs.
  void admit_peer(Peer& p) override {
    p.pid = static_cast<pid_t>(p.header().pid);
    if (!p.same_process) {
      p.pidfd = static_cast<int>(syscall(SYS_pidfd_open, p.pid, 0));
      probe_access(p);
    }
  }

  // Copies are synchronous: nothing of the peer is in flight here but immediates that did not
  // fit into its inbox, which now fail.
  void remove_peer(PeerId id) override {
    if (!peers_.live(id)) return;
    peers_.forget(id);
    deliver_held_imms();  // those of the removed peer complete with an error
    peers_.release(id);
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    return post_write_batch(std::span<const WriteOp>(&op, 1), ctx);
  }

  // Every WRITE is checked (peer, source, key, bounds) before anything is copied: an invalid one
  // anywhere refuses the whole batch (kFailed) with nothing written. Then each destination region
  // is held while its copies run, the copies go in as few calls as the iovec limit allows, and
  // the immediates follow in one push. A copy that fails completes the batch with an error.
  PostResult post_write_batch(std::span<const WriteOp> ops, OpContext* ctx) override {
    PostResult result;
    Peer* peer = batch_peer(ops, ctx, result);
    if (!peer) return result;
    const PeerId id = ops[0].peer;
    copies_.clear();
    imms_.clear();
    holds_.clear();
    for (const WriteOp& op : ops) {
      if (op.peer != id) return refuse("host_ipc: the WRITEs of a batch must go to one peer");
      if (op.has_imm) imms_.push_back(op.imm);
      if (op.len == 0) continue;  // an immediate only
      auto* src = static_cast<const LocalRegion*>(op.desc);
      if (!src || !src->host)
        return refuse(
            "host_ipc: the source is not host memory registered with this engine (GPU memory goes "
            "through the NICs or cuda_ipc)");
      uint64_t base = 0;
      if (!map_remote(*peer, op.rkey, op.remote_addr, op.len, base))
        return refuse(std::move(last_error_));
      const auto* from = static_cast<const uint8_t*>(op.src);
      const uint64_t to = base + op.remote_addr;
      if (!copies_.empty() && copies_.back().src + copies_.back().len == from &&
          copies_.back().dst + copies_.back().len == to) {
        copies_.back().len += op.len;  // contiguous on both sides: one iovec
      } else {
        copies_.push_back({from, to, op.len});
      }
    }
    if (!hold_destinations(*peer, ops))
      return refuse("host_ipc: the remote region was deregistered");
    if (peer->ended()) {  // checked right before the copy: a PID is reused only once its process
                          // ended
      release_holds();
      peer->lost = true;
      ready_.push_back(ipc::lost_completion(ctx, name_));
      return PostResult::kPosted;
    }
    std::string failure = copy(*peer);
    release_holds();  // the bytes are in (or failed): the regions' owners may deregister now
    if (failure == kPeerGone) {
      peer->lost = true;
      ready_.push_back(ipc::lost_completion(ctx, name_));
    } else if (!failure.empty()) {
      ready_.push_back(ipc::error_completion(ctx, std::move(failure)));
    } else {
      const size_t pushed = ipc::push_imms(peer->inbox, imms_.data(), imms_.size());
      if (pushed == imms_.size()) {
        ready_.push_back(ipc::local_completion(ctx));
      } else {  // the inbox is full: the rest on a later poll
        held_imms_.push_back(ipc::HeldImms{
            ctx, id,
            std::vector<uint32_t>(imms_.begin() + static_cast<long>(pushed), imms_.end())});
      }
    }
    return PostResult::kPosted;
  }

  // Copies are done when posted: poll() only delivers held immediates (LocalDomain).
  void progress() override {}

 private:
  static constexpr const char* kPeerGone = "host_ipc: the peer's process has ended";

  // One write of our nonce into the peer's header through process_vm_writev: whether this
  // process may write into the peer's memory at all.
  void probe_access(const Peer& p) {
    const ipc::Header& h = p.header();
    const uint64_t value = own_.nonce();
    const auto offset = static_cast<uint64_t>(reinterpret_cast<const uint8_t*>(&h.probe) -
                                              reinterpret_cast<const uint8_t*>(&h));
    iovec local{const_cast<uint64_t*>(&value), sizeof value};
    iovec remote{reinterpret_cast<void*>(h.owner_base + offset), sizeof value};
    if (process_vm_writev(p.pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof value))
      return;
    const int err = errno;
    throw Error(
        ErrorCode::kUnsupported,
        fmt::format(
            "host_ipc: this process may not write into process {} ({}) with process_vm_writev: "
            "{} (it needs ptrace access: Yama's ptrace_scope 2 or 3, a seccomp filter or "
            "another user forbid it); use the NICs",
            p.pid, p.address, std::strerror(err)));
  }

  // The peer's address of region `rkey` (its base), checked against [remote_addr, +len); false
  // with last_error_ when the key is invalid, stale, or the bytes fall outside the region.
  bool map_remote(Peer& peer, uint64_t rkey, uint64_t remote_addr, uint64_t len, uint64_t& base) {
    uint32_t slot, generation;
    if (!split_key(rkey, slot, generation)) return false;
    Peer::Mapped& m = peer.regions[slot];
    if (m.generation != generation) {
      ipc::RegionFields f;
      if (!peer.inbox.region(slot).read(generation, f) ||
          f.device != -1) {  // torn, stale or not ours
        last_error_ = "host_ipc: the remote region was deregistered";
        return false;
      }
      m = {generation, f.owner_ptr, f.len};
    }
    if (remote_addr > m.len || len > m.len - remote_addr) {
      last_error_ = fmt::format("host_ipc: [{}, +{}) is outside the remote region of {} bytes",
                                remote_addr, len, m.len);
      return false;
    }
    base = m.base;
    return true;
  }

  // Holds every destination region of `ops` (each once) at the generation its key names; false
  // (and nothing held) when one was deregistered since.
  bool hold_destinations(Peer& peer, std::span<const WriteOp> ops) {
    for (const WriteOp& op : ops) {
      if (op.len == 0) continue;
      ipc::RegionEntry* e = &peer.inbox.region(static_cast<uint32_t>(op.rkey >> 32));
      const auto generation = static_cast<uint32_t>(op.rkey);
      if (std::any_of(holds_.begin(), holds_.end(), [&](const Held& h) { return h.first == e; }))
        continue;
      if (!e->hold(generation)) {
        release_holds();
        return false;
      }
      holds_.push_back({e, generation});
    }
    return true;
  }
  void release_holds() {
    for (auto& [entry, generation] : holds_) entry->release();
    holds_.clear();
  }

  // Performs copies_; "" when every byte is in, else why not (kPeerGone when the process ended).
  std::string copy(const Peer& peer) {
    if (peer.same_process) {
      for (const Copy& c : copies_) std::memcpy(reinterpret_cast<void*>(c.dst), c.src, c.len);
      return {};
    }
    size_t next = 0;
    while (next < copies_.size()) {
      const size_t n = std::min(kIovMax, copies_.size() - next);
      local_iov_.resize(n);
      remote_iov_.resize(n);
      uint64_t want = 0;
      for (size_t k = 0; k < n; k++) {
        const Copy& c = copies_[next + k];
        local_iov_[k] = {const_cast<uint8_t*>(c.src), c.len};
        remote_iov_[k] = {reinterpret_cast<void*>(c.dst), c.len};
        want += c.len;
      }
      const ssize_t got =
          process_vm_writev(peer.pid, local_iov_.data(), n, remote_iov_.data(), n, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == ESRCH) return kPeerGone;
        return fmt::format("host_ipc: process_vm_writev into process {} failed: {}", peer.pid,
                           std::strerror(errno));
      }
      if (static_cast<uint64_t>(got) == want) {
        next += n;
        continue;
      }
      if (got == 0)
        return fmt::format("host_ipc: process_vm_writev into process {} wrote nothing of {} bytes",
                           peer.pid, want);
      // A partial copy stops at an iovec boundary or inside one: go on from the first byte not
      // written.
      auto left = static_cast<uint64_t>(got);
      while (left >= copies_[next].len) left -= copies_[next++].len;
      copies_[next].src += left;
      copies_[next].dst += left;
      copies_[next].len -= left;
    }
    return {};
  }

  using Held = std::pair<ipc::RegionEntry*, uint32_t>;

  // One batch's work, kept to reuse their memory.
  std::vector<Copy> copies_;
  std::vector<uint32_t> imms_;
  std::vector<Held> holds_;
  std::vector<iovec> local_iov_, remote_iov_;
};

}  // namespace

std::unique_ptr<Domain> open_host_ipc_domain(const EngineConfig& config) {
  return std::make_unique<HostIpcDomain>(config);
}

}  // namespace fabric
