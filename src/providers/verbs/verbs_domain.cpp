// verbs Domain: one device port, reliable-connected (RC) queue pairs per peer, connected by a
// handshake over an unreliable-datagram (UD) queue pair. This class composes the pieces and
// implements the Domain contract; each piece has one job:
//
//   verbs_queues.*       the CQs and SRQs every queue pair shares, and the RC queue pair factory
//   verbs_posting.*      work requests chained per queue pair, doorbells, in-flight accounting,
//                        retired queue pairs until their last request is back
//   verbs_connections.*  the peer table and each peer's two queue pairs: the handshake, epochs,
//                        losing and re-making connections (over verbs_handshake_channel.*)
//   verbs_completions.*  the CQs read into Completions, errors named, immediate receives refilled
//
// Every QP completes into one send CQ and one receive CQ whose sizes are bounded by this domain's
// in-flight limit and the two SRQ depths, never by the number of peers, so any number of peers
// cannot overrun them. A retired queue pair is destroyed once its last request has come back (and
// the receive CQ has been read, since some providers drop a destroyed queue pair's entries from
// it), so no completion finds freed state.
#include "providers/verbs/verbs_domain.h"

#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "providers/verbs/verbs_completions.h"
#include "providers/verbs/verbs_connections.h"
#include "providers/verbs/verbs_device.h"
#include "providers/verbs/verbs_posting.h"
#include "providers/verbs/verbs_queues.h"
#include "util/log.h"
#ifdef FABRIC_WITH_CUDA
#include "cuda/driver_api.h"
#endif

namespace fabric {
namespace verbs {
namespace {

constexpr size_t kScratchLen = 64;

int access_flags() {
  // Relaxed ordering lets PCIe reorder the NIC's writes to memory (faster on many hosts); our
  // completions never depend on the order of bytes within a WRITE. It is an optional flag:
  // libibverbs drops it where the device or kernel does not support it.
  return IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_RELAXED_ORDERING;
}

// The queue sizes for this device, once `cfg` is known to suit it: kInvalidArgument before
// anything is created otherwise.
QueueSizes checked_sizes(const VerbsConfig& cfg, const DeviceContext& dev) {
  auto bad = [&](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("verbs on {}: {}", dev.name, what));
  };
  const ibv_device_attr& da = dev.dev_attr;
  if (cfg.service_level > 15)
    bad(fmt::format("VerbsConfig::service_level {} is not a service level (0-15)",
                    cfg.service_level));
  if (cfg.min_rnr_timer > 31)
    bad(fmt::format("VerbsConfig::min_rnr_timer {} is not an RNR timer code (0-31)",
                    cfg.min_rnr_timer));
  if (cfg.imm_receives > static_cast<uint32_t>(da.max_srq_wr))
    bad(fmt::format(
        "VerbsConfig::imm_receives {} exceeds the device's shared receive queue depth ({})",
        cfg.imm_receives, da.max_srq_wr));
  if (cfg.imm_receives != 0 && cfg.imm_receives < CompletionReader::kImmRefill)
    bad(fmt::format("VerbsConfig::imm_receives {} is too few (at least {}; 0 for the default)",
                    cfg.imm_receives, CompletionReader::kImmRefill));
  return QueueSizes::for_device(dev, cfg.imm_receives);
}

class VerbsDomain final : public Domain {
 public:
  VerbsDomain(const EngineConfig& config, size_t nic_index)
      : dev_(config.nics.at(nic_index).domain, config.verbs.port, config.verbs.gid_index),
        queues_(dev_, checked_sizes(config.verbs, dev_)),
        poster_(dev_, queues_, backlog_,
                [this](Peer& p, const std::string& why) { connections_.lose_connection(p, why); }),
        connections_(config.verbs, dev_, queues_, poster_),
        reader_(dev_, queues_, poster_, connections_, backlog_) {
    // Read by every address vector, made from the first peer on.
    dev_.traffic_class = config.verbs.traffic_class;
    dev_.service_level = config.verbs.service_level;
    const QueueSizes& sizes = queues_.sizes;
    // EngineConfig::max_in_flight_per_nic, at most what the send CQ holds.
    size_t max_in_flight = config.max_in_flight_per_nic;
    if (max_in_flight == 0 || max_in_flight > sizes.send_cq) max_in_flight = sizes.send_cq;

    caps_.nic_name = dev_.name;
#ifdef FABRIC_WITH_CUDA
    caps_.gpu_memory = true;  // register_gpu: dma-buf, else peer memory
#endif
    caps_.max_message = sizes.max_message;  // the split size of post_write
    caps_.inject_size = queues_.max_inline();
    caps_.link_gbps = link_gbps(dev_.port_attr);
    caps_.manual_progress = true;  // chained requests and the handshake move at poll()
    // ibv_reg_mr / ibv_reg_dmabuf_mr / ibv_dereg_mr are thread-safe and register_memory reads
    // only what the constructor fixed (the PD, the access flags).
    caps_.concurrent_registration = true;
    caps_.max_in_flight = max_in_flight;
    caps_.max_write_batch = 0;  // one WRITE (a chain of work requests) per post

    scratch_ = std::aligned_alloc(64, kScratchLen);
    std::memset(scratch_, 0, kScratchLen);
    scratch_region_ = register_memory(scratch_, kScratchLen, Device::host());

    const VerbsAddress& me = connections_.me();
    address_ = me.to_bytes();
    log::info("nic {}: verbs {} {} (qp depth {}, max message {} B, inline {} B, link {} Gb/s)",
              nic_index, dev_.name, me.describe(), sizes.qp_depth, sizes.max_message,
              caps_.inject_size, caps_.link_gbps);
  }

  ~VerbsDomain() override {
    if (scratch_region_.provider) ibv_dereg_mr(static_cast<ibv_mr*>(scratch_region_.provider));
    std::free(scratch_);
  }

  const std::string& provider_name() const override { return provider_; }
  const std::string& address() const override { return address_; }
  const DomainCaps& caps() const override { return caps_; }
  void* scratch_desc() const override { return scratch_region_.desc; }
  void* scratch_buffer() const override { return scratch_; }
  const std::string& last_error() const override { return last_error_; }

  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    ibv_mr* mr = device.kind == Device::Kind::kCuda ? register_gpu(ptr, len)
                                                    : ibv_reg_mr(dev_.pd, ptr, len, access_flags());
    if (!mr)
      throw Error(ErrorCode::kProvider,
                  fmt::format("verbs: ibv_reg_mr of {} bytes on {} failed: {}{}", len, dev_.name,
                              errno_text(errno),
                              errno == ENOMEM ? " (locked-memory limit? see `ulimit -l`)" : ""));
    DomainRegion r;
    r.provider = mr;
    r.desc = mr;
    r.remote.rkey = mr->rkey;
    r.remote.base = reinterpret_cast<uint64_t>(ptr);  // verbs addresses are virtual addresses
    return r;
  }

  void deregister_memory(DomainRegion& region) override {
    if (region.provider) {
      int rc = ibv_dereg_mr(static_cast<ibv_mr*>(region.provider));
      if (rc != 0) fail("ibv_dereg_mr", rc, dev_.name);
    }
    region = {};
  }

  PeerId insert_peer(const std::string& address) override {
    return connections_.insert_peer(address);
  }
  void remove_peer(PeerId id) override { connections_.remove_peer(id); }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    if (PostResult r = poster_.check_write(op.len, last_error_); r != PostResult::kPosted) return r;
    Peer* p = connections_.find(op.peer);
    if (PostResult r = connections_.check_peer(p, op.peer, last_error_); r != PostResult::kPosted)
      return r;
    return poster_.write(*p->write, op, ctx);
  }

  PostResult post_write_batch(std::span<const WriteOp>, OpContext*) override {  // never called
    last_error_ = "verbs: no write batches (caps().max_write_batch is 0)";
    return PostResult::kFailed;
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    if (PostResult r = poster_.check_send(len, last_error_); r != PostResult::kPosted) return r;
    Peer* p = connections_.find(peer);
    if (PostResult r = connections_.check_peer(p, peer, last_error_); r != PostResult::kPosted)
      return r;
    return poster_.send(*p->msg, buf, len, desc, ctx);
  }

  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return poster_.recv(buf, len, desc, ctx, last_error_);
  }

  size_t poll(std::span<Completion> out) override {
    connections_.progress_handshakes();
    poster_.flush_chains();
    size_t n = reader_.read(out);
    if (poster_.has_idle_retired()) {
      reader_.read_out_receives();  // an immediate on a queue pair about to go still counts
      poster_.destroy_idle_retired();
    }
    return n;
  }

 private:
  ibv_mr* register_gpu(void* ptr, size_t len) {
#ifdef FABRIC_WITH_CUDA
    // dma-buf first (no kernel module needed besides the GPU driver), then the peer-memory path
    // (nvidia-peermem), which plain ibv_reg_mr takes for device pointers.
    try {
      cuda::DmaBuf buf = cuda::dmabuf_of(ptr, len);
      ibv_mr* mr = ibv_reg_dmabuf_mr(dev_.pd, buf.offset, len, reinterpret_cast<uint64_t>(ptr),
                                     buf.fd, access_flags());
      int err = errno;
      close(buf.fd);
      if (mr) return mr;
      log::info("verbs: ibv_reg_dmabuf_mr on {} failed ({}); trying peer memory", dev_.name,
                errno_text(err));
    } catch (const Error& e) {
      log::info("verbs: no dma-buf for GPU memory ({}); trying peer memory", e.what());
    }
    return ibv_reg_mr(dev_.pd, ptr, len, access_flags());
#else
    (void)ptr;
    (void)len;
    throw Error(ErrorCode::kUnsupported, "verbs: GPU memory needs a CUDA build of fabric-lib");
#endif
  }

  // Declared in the order they are made; each piece refers only to those above it (the poster
  // reaches connections_ through its PeerLost callback).
  DeviceContext dev_;
  CompletionBacklog backlog_;
  SharedQueues queues_;
  RequestPoster poster_;
  Connections connections_;
  CompletionReader reader_;

  std::string provider_ = "verbs";
  std::string address_;
  DomainCaps caps_;
  std::string last_error_;
  void* scratch_ = nullptr;
  DomainRegion scratch_region_;
};

}  // namespace
}  // namespace verbs

std::unique_ptr<Domain> open_verbs_domain(const EngineConfig& config, size_t nic_index) {
  return std::make_unique<verbs::VerbsDomain>(config, nic_index);
}

}  // namespace fabric
