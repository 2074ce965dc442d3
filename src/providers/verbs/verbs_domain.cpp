// verbs Domain: one device port, reliable-connected (RC) queue pairs per peer, connected by a
// handshake over an unreliable-datagram (UD) queue pair.
//
// Per peer: one RC QP for SEND/RECV and one for WRITE/WRITE_WITH_IMM, so that immediates (which
// consume a receive on the target) never take the application's message buffers. All message QPs
// share one receive queue (SRQ) of application buffers, all write QPs one SRQ of zero-length
// receives that this domain refills itself. Every QP completes into one send CQ and one receive
// CQ whose sizes are bounded by this domain's in-flight limit and the two SRQ depths, never by the
// number of peers, so any number of peers cannot overrun them.
//
// Posting: work requests wait in a per-QP chain and go to the NIC four at a time, or at the next
// poll(), so one doorbell carries several requests. A WRITE longer than the port's largest message
// is cut into several requests; its OpContext completes once, when the last of them has.
//
// Connections come and go: an error completion (a transient fault that outlasted the RC retries,
// a bad remote key) leaves a queue pair in the error state for good, so the peer's two queue pairs
// are retired (moved to the error state: the NIC flushes every request on them, and each fails
// once) and the next post to that peer connects new ones under a higher epoch; the peer sees the
// epoch and replaces its own. remove_peer retires them the same way. A retired queue pair is
// destroyed once its last request has come back (and the receive CQ has been read, since some
// providers drop a destroyed queue pair's entries from it), so no completion finds freed state.
#include "providers/verbs/verbs_domain.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <unordered_map>
#include <vector>

#include "providers/verbs/handshake.h"
#include "providers/verbs/verbs_device.h"
#include "providers/verbs/verbs_wire.h"
#include "util/log.h"
#ifdef FABRIC_WITH_CUDA
#include "cuda/driver_api.h"
#endif

namespace fabric {
namespace verbs {
namespace {

constexpr uint32_t kChain = 4;             // work requests per doorbell
constexpr uint32_t kQkey = 0x0FAB1C00;     // UD queue key of handshake QPs (high bit clear: unprivileged)
constexpr uint32_t kUdRecvs = 256;         // handshake receive buffers
constexpr uint32_t kUdSends = 64;          // handshake send buffers
constexpr size_t kGrh = 40;                // UD receives start with room for the global route header
constexpr size_t kUdSlot = 128;            // >= HandshakeMsg::kSize
constexpr size_t kScratchLen = 64;
constexpr uint64_t kImmRecvId = 1;         // wr_id of the zero-length receives (contexts are aligned)
constexpr uint64_t kUdSendTag = 1ull << 32;
constexpr size_t kMaxPeers = 65536;        // peers a domain accepts (inserted or connecting to us)
constexpr uint32_t kMaxInline = 64;

static_assert(HandshakeMsg::kSize <= kUdSlot);

int access_flags() {
  // Relaxed ordering lets PCIe reorder the NIC's writes to memory (faster on many hosts); our
  // completions never depend on the order of bytes within a WRITE. It is an optional flag:
  // libibverbs drops it where the device or kernel does not support it.
  return IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_RELAXED_ORDERING;
}

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

[[noreturn]] void fail(const char* call, int err, const std::string& device) {
  throw Error(ErrorCode::kProvider, fmt::format("verbs: {} on {} failed: {}", call, device, errno_text(err)));
}

template <class T>
T* check_ptr(T* p, const char* call, const std::string& device) {
  if (!p) fail(call, errno, device);
  return p;
}

struct Peer;

// The send side of one RC queue pair, with its chain of requests not yet handed to the NIC. Owned
// by its peer while in use, then by the domain's retired list until its last request is back.
struct SendQueue {
  ibv_qp* qp = nullptr;
  Peer* peer = nullptr;      // null once retired
  uint32_t psn = 0;
  uint32_t depth = 0;        // max_send_wr
  uint32_t outstanding = 0;  // posted or chained, not completed
  uint32_t chained = 0;
  bool dirty = false;  // listed for flushing at the next poll
  std::string error;   // set when it failed or was retired: its remaining requests fail with it
  ibv_send_wr wr[kChain]{};
  ibv_sge sge[kChain]{};
};

// kDown: no queue pairs (never connected, or lost); the next post connects.
// kConnecting: queue pairs made, handshake under way. kReady: writes may go.
// kFailed: the last handshake went unanswered; posts fail at once until retry_at, then connect.
enum class PeerState { kDown, kConnecting, kReady, kFailed };

struct Peer {
  Peer(Handshake::Clock::time_point now, Handshake::Timing t) : hs(now, t) {}
  VerbsAddress addr;
  std::string key;  // the address bytes (peer_ids_)
  PeerId id = 0;
  ibv_ah* ah = nullptr;  // towards the peer's handshake QP
  std::unique_ptr<SendQueue> msg, write;  // both or neither
  uint32_t remote_msg_qpn = 0, remote_write_qpn = 0;
  uint32_t epoch = 0;  // of the current (or last) connection; 0: none yet
  uint32_t connections = 0;
  Handshake hs;
  PeerState state = PeerState::kDown;
  bool handshaking = false;  // listed in handshaking_
  std::string error;         // why it failed (kFailed) or was lost (kDown)
  Handshake::Clock::time_point retry_at{};
};

// What an OpContext carries while its requests are out (provider_space).
struct OpState {
  uint64_t requests_left;
  SendQueue* queue;
  uint64_t failed;  // 1 once a request of it failed
};
static_assert(sizeof(OpState) <= sizeof(OpContext::provider_space));
OpState& op_state(OpContext* ctx) { return *reinterpret_cast<OpState*>(ctx->provider_space); }

// PeerId: the slot in the low 32 bits, the slot's generation above, so that the id of a removed
// peer never reaches the peer that takes its slot later.
constexpr PeerId make_id(uint32_t slot, uint32_t generation) { return (static_cast<PeerId>(generation) << 32) | slot; }
constexpr uint32_t id_slot(PeerId id) { return static_cast<uint32_t>(id); }
constexpr uint32_t id_generation(PeerId id) { return static_cast<uint32_t>(id >> 32); }

class VerbsDomain final : public Domain {
 public:
  VerbsDomain(const EngineConfig& config, size_t nic_index)
      : cfg_(config.verbs),
        dev_(config.nics.at(nic_index).domain, config.verbs.port, config.verbs.gid_index) {
    timing_.timeout = cfg_.handshake_timeout;
    drops_left_ = cfg_.drop_handshake_packets;
    const ibv_device_attr& da = dev_.dev_attr;
    max_msg_ = std::max<uint64_t>(dev_.port_attr.max_msg_sz, 4096);
    qp_depth_ = static_cast<uint32_t>(std::min<int>(da.max_qp_wr, 1024));
    check_config(da);
    dev_.traffic_class = cfg_.traffic_class;
    dev_.service_level = cfg_.service_level;
    msg_srq_depth_ = static_cast<uint32_t>(std::min<int>(da.max_srq_wr, 8192));
    imm_srq_depth_ = cfg_.imm_receives ? cfg_.imm_receives : static_cast<uint32_t>(std::min<int>(da.max_srq_wr, 16384));
    send_cq_depth_ = static_cast<uint32_t>(std::min<int>(da.max_cqe, 8192));
    // Completions waiting in the receive CQ are at most the receives posted to both SRQs.
    uint32_t recv_cq_depth = static_cast<uint32_t>(std::min<int>(da.max_cqe, msg_srq_depth_ + imm_srq_depth_));
    if (recv_cq_depth < msg_srq_depth_ + imm_srq_depth_) {
      msg_srq_depth_ = recv_cq_depth / 2;
      imm_srq_depth_ = recv_cq_depth - msg_srq_depth_;
    }
    // EngineConfig::max_in_flight_per_nic, at most what the send CQ holds.
    size_t max_in_flight = config.max_in_flight_per_nic;
    if (max_in_flight == 0 || max_in_flight > send_cq_depth_) max_in_flight = send_cq_depth_;

    const std::string& d = dev_.name;
    send_cq_ = check_ptr(ibv_create_cq(dev_.ctx, static_cast<int>(send_cq_depth_), nullptr, nullptr, 0), "ibv_create_cq(send)", d);
    recv_cq_ = check_ptr(ibv_create_cq(dev_.ctx, static_cast<int>(recv_cq_depth), nullptr, nullptr, 0), "ibv_create_cq(recv)", d);
    ud_cq_ = check_ptr(ibv_create_cq(dev_.ctx, kUdRecvs + kUdSends, nullptr, nullptr, 0), "ibv_create_cq(ud)", d);
    msg_srq_ = create_srq(msg_srq_depth_);
    imm_srq_ = create_srq(imm_srq_depth_);
    imm_reposts_ = imm_srq_depth_;  // fill the immediate SRQ
    repost_imm_recvs();

    caps_.nic_name = d;
#ifdef FABRIC_WITH_CUDA
    caps_.gpu_memory = true;  // register_gpu: dma-buf, else peer memory
#endif
    caps_.max_message = max_msg_;  // the split size of post_write
    caps_.inject_size = probe_inline();
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
    open_handshake_qp();

    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid()));
    VerbsAddress me;
    std::memcpy(me.gid.data(), dev_.gid.raw, 16);
    me.lid = dev_.roce() ? 0 : dev_.port_attr.lid;
    me.ud_qpn = ud_qp_->qp_num;
    me.nonce = rng_() | 1;  // never 0
    me_ = me;
    address_ = me.to_bytes();
    log::info("nic {}: verbs {} {} (qp depth {}, max message {} B, inline {} B, link {} Gb/s)", nic_index, d,
              me.describe(), qp_depth_, max_msg_, caps_.inject_size, caps_.link_gbps);
  }

  ~VerbsDomain() override {
    for (auto& p : slots_) {
      if (!p) continue;
      for (SendQueue* q : {p->msg.get(), p->write.get()})
        if (q) ibv_destroy_qp(q->qp);
      if (p->ah) ibv_destroy_ah(p->ah);
    }
    for (auto& q : retired_) ibv_destroy_qp(q->qp);
    if (ud_qp_) ibv_destroy_qp(ud_qp_);
    if (ud_mr_) ibv_dereg_mr(ud_mr_);
    if (scratch_region_.provider) ibv_dereg_mr(static_cast<ibv_mr*>(scratch_region_.provider));
    if (msg_srq_) ibv_destroy_srq(msg_srq_);
    if (imm_srq_) ibv_destroy_srq(imm_srq_);
    for (ibv_cq* cq : {send_cq_, recv_cq_, ud_cq_})
      if (cq) ibv_destroy_cq(cq);
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
      throw Error(ErrorCode::kProvider, fmt::format("verbs: ibv_reg_mr of {} bytes on {} failed: {}{}", len,
                                                    dev_.name, errno_text(errno),
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
    auto it = peer_ids_.find(address);
    if (it != peer_ids_.end()) return it->second;
    VerbsAddress a = VerbsAddress::from_bytes(
        std::span(reinterpret_cast<const uint8_t*>(address.data()), address.size()));
    return add_peer(a, address).id;
  }

  // Its queue pairs are retired (what is posted on them fails, once each, through poll()); the
  // slot is reused with a new generation, so the old id stays unknown.
  void remove_peer(PeerId id) override {
    Peer* p = find(id);
    if (!p) return;
    drop_connection(*p, fmt::format("verbs: peer {} on {} was removed", p->addr.describe(), dev_.name));
    unlist_handshake(*p);
    peer_ids_.erase(p->key);
    if (p->ah) ibv_destroy_ah(p->ah);
    uint32_t slot = id_slot(id);
    slots_[slot].reset();
    generations_[slot]++;
    free_slots_.push_back(slot);
    peer_count_--;
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    uint64_t requests = op.len <= max_msg_ ? 1 : (op.len + max_msg_ - 1) / max_msg_;
    if (requests > qp_depth_) {
      last_error_ = fmt::format("verbs: a WRITE of {} bytes needs {} requests of at most {} bytes, more than "
                                "the queue pair holds ({})", op.len, requests, max_msg_, qp_depth_);
      return PostResult::kFailed;
    }
    Peer* p = find(op.peer);
    if (PostResult r = check_peer(p, op.peer); r != PostResult::kPosted) return r;
    SendQueue& q = *p->write;
    if (PostResult r = room(q, requests); r != PostResult::kPosted) return r;
    op_state(ctx) = OpState{requests, &q, 0};
    auto lkey = op.desc ? static_cast<ibv_mr*>(op.desc)->lkey : 0;
    for (uint64_t i = 0; i < requests; i++) {
      uint64_t off = i * max_msg_;
      uint64_t len = std::min<uint64_t>(op.len - off, max_msg_);
      bool last = i + 1 == requests;
      ibv_send_wr& wr = next_request(q, ctx, static_cast<const uint8_t*>(op.src) + off, len, lkey);
      wr.opcode = last && op.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
      wr.imm_data = htonl(op.imm);
      wr.wr.rdma.remote_addr = op.remote_addr + off;
      wr.wr.rdma.rkey = static_cast<uint32_t>(op.rkey);
      commit_request(q);
    }
    return PostResult::kPosted;
  }

  PostResult post_write_batch(std::span<const WriteOp>, OpContext*) override {  // caps_: never called
    last_error_ = "verbs: no write batches (caps().max_write_batch is 0)";
    return PostResult::kFailed;
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx) override {
    if (len > max_msg_) {
      last_error_ = fmt::format("verbs: a SEND of {} bytes exceeds the port's largest message ({})", len, max_msg_);
      return PostResult::kFailed;
    }
    Peer* p = find(peer);
    if (PostResult r = check_peer(p, peer); r != PostResult::kPosted) return r;
    SendQueue& q = *p->msg;
    if (PostResult r = room(q, 1); r != PostResult::kPosted) return r;
    op_state(ctx) = OpState{1, &q, 0};
    ibv_send_wr& wr = next_request(q, ctx, buf, len, desc ? static_cast<ibv_mr*>(desc)->lkey : 0);
    wr.opcode = IBV_WR_SEND;
    commit_request(q);
    return PostResult::kPosted;
  }

  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(len),
                desc ? static_cast<ibv_mr*>(desc)->lkey : 0};
    ibv_recv_wr wr{};
    wr.wr_id = reinterpret_cast<uint64_t>(ctx);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    int rc = ibv_post_srq_recv(msg_srq_, &wr, &bad);
    if (rc == 0) return PostResult::kPosted;
    if (rc == ENOMEM) return PostResult::kRetry;
    last_error_ = fmt::format("verbs: ibv_post_srq_recv on {} failed: {}", dev_.name, errno_text(rc));
    return PostResult::kFailed;
  }

  size_t poll(std::span<Completion> out) override {
    progress_handshakes();
    for (SendQueue* q : dirty_) flush(*q);
    dirty_.clear();
    size_t n = 0;
    while (n < out.size() && !synthetic_.empty()) {
      out[n++] = std::move(synthetic_.front());
      synthetic_.pop_front();
    }
    // Each CQ may take half of `out` first, then the send CQ the rest: a stream of local
    // completions never leaves the receive CQ (and so the immediate receives' reposting) unread.
    const size_t half = n + (out.size() - n + 1) / 2;
    n = drain_send_cq(out, n, half);
    n = drain_recv_cq(out, n, out.size());
    n = drain_send_cq(out, n, out.size());
    if (imm_reposts_ >= kChain * 4) repost_imm_recvs();
    if (!retired_.empty()) reap_retired();
    return n;
  }

 private:
  size_t drain_send_cq(std::span<Completion> out, size_t n, size_t limit) {
    ibv_wc wcs[32];
    while (n < limit) {
      int got = ibv_poll_cq(send_cq_, static_cast<int>(std::min<size_t>(std::size(wcs), limit - n)), wcs);
      if (got <= 0) break;
      for (int i = 0; i < got; i++) n += on_send_completion(wcs[i], out[n]);
    }
    return n;
  }

  size_t drain_recv_cq(std::span<Completion> out, size_t n, size_t limit) {
    ibv_wc wcs[32];
    while (n < limit) {
      int got = ibv_poll_cq(recv_cq_, static_cast<int>(std::min<size_t>(std::size(wcs), limit - n)), wcs);
      if (got <= 0) break;
      for (int i = 0; i < got; i++) n += on_recv_completion(wcs[i], out[n]);
    }
    if (imm_reposts_ > imm_srq_depth_ - imm_srq_depth_ / 4) warn_imm_receives_low();
    return n;
  }

  // Fewer than a quarter of the immediate receives still posted: senders are about to meet
  // receiver-not-ready and wait min_rnr_timer. Said at most once a second.
  void warn_imm_receives_low() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_low_warning_) return;
    next_low_warning_ = now + std::chrono::seconds(1);
    log::warn("verbs: only {} of {} immediate receives posted on {} (WRITEs with immediates arrive faster than "
              "this worker polls): raise VerbsConfig::imm_receives (device max {}) or poll more often",
              imm_srq_depth_ - imm_reposts_, imm_srq_depth_, dev_.name, dev_.dev_attr.max_srq_wr);
  }

  // ---- setup ---------------------------------------------------------------------------------

  void check_config(const ibv_device_attr& da) const {
    auto bad = [&](const std::string& what) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("verbs on {}: {}", dev_.name, what));
    };
    if (cfg_.service_level > 15)
      bad(fmt::format("VerbsConfig::service_level {} is not a service level (0-15)", cfg_.service_level));
    if (cfg_.min_rnr_timer > 31)
      bad(fmt::format("VerbsConfig::min_rnr_timer {} is not an RNR timer code (0-31)", cfg_.min_rnr_timer));
    if (cfg_.imm_receives > static_cast<uint32_t>(da.max_srq_wr))
      bad(fmt::format("VerbsConfig::imm_receives {} exceeds the device's shared receive queue depth ({})",
                      cfg_.imm_receives, da.max_srq_wr));
    if (cfg_.imm_receives != 0 && cfg_.imm_receives < 4 * kChain)
      bad(fmt::format("VerbsConfig::imm_receives {} is too few (at least {}; 0 for the default)", cfg_.imm_receives,
                      4 * kChain));
  }

  ibv_srq* create_srq(uint32_t depth) {
    ibv_srq_init_attr a{};
    a.attr.max_wr = depth;
    a.attr.max_sge = 1;
    return check_ptr(ibv_create_srq(dev_.pd, &a), "ibv_create_srq", dev_.name);
  }

  ibv_mr* register_gpu(void* ptr, size_t len) {
#ifdef FABRIC_WITH_CUDA
    // dma-buf first (no kernel module needed besides the GPU driver), then the peer-memory path
    // (nvidia-peermem), which plain ibv_reg_mr takes for device pointers.
    try {
      cuda::DmaBuf buf = cuda::dmabuf_of(ptr, len);
      ibv_mr* mr = ibv_reg_dmabuf_mr(dev_.pd, buf.offset, len, reinterpret_cast<uint64_t>(ptr), buf.fd,
                                     access_flags());
      int err = errno;
      close(buf.fd);
      if (mr) return mr;
      log::info("verbs: ibv_reg_dmabuf_mr on {} failed ({}); trying peer memory", dev_.name, errno_text(err));
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

  ibv_qp* create_rc_qp(ibv_srq* srq, int remote_access) {
    ibv_qp_init_attr a{};
    a.send_cq = send_cq_;
    a.recv_cq = recv_cq_;
    a.srq = srq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = qp_depth_;
    a.cap.max_send_sge = 1;
    a.cap.max_inline_data = kMaxInline;
    ibv_qp* qp = ibv_create_qp(dev_.pd, &a);
    if (!qp) {  // some devices have no inline data: ask again without
      a.cap.max_inline_data = 0;
      qp = check_ptr(ibv_create_qp(dev_.pd, &a), "ibv_create_qp(RC)", dev_.name);
    }
    max_inline_ = a.cap.max_inline_data;
    ibv_qp_attr m{};
    m.qp_state = IBV_QPS_INIT;
    m.port_num = dev_.port;
    m.qp_access_flags = static_cast<unsigned>(remote_access);
    if (int rc = ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
      ibv_destroy_qp(qp);
      fail("ibv_modify_qp(RC INIT)", rc, dev_.name);
    }
    return qp;
  }

  // The inline size this device gives RC queue pairs (what create_rc_qp asks for, as the device
  // answers, 0 where it has none): one queue pair created and destroyed at open, so that caps()
  // is known before the first peer.
  uint32_t probe_inline() {
    ibv_destroy_qp(create_rc_qp(msg_srq_, 0));
    return max_inline_;
  }

  void open_handshake_qp() {
    ud_buf_.resize((kUdRecvs + kUdSends) * (kGrh + kUdSlot));
    ud_mr_ = check_ptr(ibv_reg_mr(dev_.pd, ud_buf_.data(), ud_buf_.size(), IBV_ACCESS_LOCAL_WRITE), "ibv_reg_mr(ud)", dev_.name);
    ibv_qp_init_attr a{};
    a.send_cq = ud_cq_;
    a.recv_cq = ud_cq_;
    a.qp_type = IBV_QPT_UD;
    a.cap.max_send_wr = kUdSends;
    a.cap.max_recv_wr = kUdRecvs;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    ud_qp_ = check_ptr(ibv_create_qp(dev_.pd, &a), "ibv_create_qp(UD)", dev_.name);
    ibv_qp_attr m{};
    m.qp_state = IBV_QPS_INIT;
    m.port_num = dev_.port;
    m.qkey = kQkey;
    int rc = ibv_modify_qp(ud_qp_, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    m = {};
    m.qp_state = IBV_QPS_RTR;
    if (!rc) rc = ibv_modify_qp(ud_qp_, &m, IBV_QP_STATE);
    m.qp_state = IBV_QPS_RTS;
    m.sq_psn = 0;
    if (!rc) rc = ibv_modify_qp(ud_qp_, &m, IBV_QP_STATE | IBV_QP_SQ_PSN);
    if (rc) fail("ibv_modify_qp(UD)", rc, dev_.name);
    for (uint32_t i = 0; i < kUdRecvs; i++) post_ud_recv(i);
    for (uint32_t i = 0; i < kUdSends; i++) free_ud_sends_.push_back(i);
  }

  uint8_t* ud_slot(uint32_t i) { return ud_buf_.data() + i * (kGrh + kUdSlot); }

  void post_ud_recv(uint32_t slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(ud_slot(slot)), kGrh + kUdSlot, ud_mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(ud_qp_, &wr, &bad)) log::error("verbs: handshake receive lost: {}", errno_text(rc));
  }

  // ---- peers and connections ----------------------------------------------------------------

  Peer* find(PeerId id) {
    uint32_t slot = id_slot(id);
    if (slot >= slots_.size() || !slots_[slot] || generations_[slot] != id_generation(id)) return nullptr;
    return slots_[slot].get();
  }

  // A known peer, not connected yet: its queue pairs are made by the first post to it or by its
  // first message.
  Peer& add_peer(const VerbsAddress& a, const std::string& key) {
    if (peer_count_ >= kMaxPeers)
      throw Error(ErrorCode::kResourceExhausted, fmt::format("verbs: {} peers on {} already", kMaxPeers, dev_.name));
    ibv_gid dgid;
    std::memcpy(dgid.raw, a.gid.data(), 16);
    ibv_ah_attr ah = dev_.ah_attr(dgid, a.lid);
    ibv_ah* handle = check_ptr(ibv_create_ah(dev_.pd, &ah), "ibv_create_ah", dev_.name);
    uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = static_cast<uint32_t>(slots_.size());
      slots_.emplace_back();
      generations_.push_back(0);
    }
    auto p = std::make_unique<Peer>(Handshake::Clock::now(), timing_);
    p->addr = a;
    p->key = key;
    p->ah = handle;
    p->id = make_id(slot, generations_[slot]);
    Peer& ref = *p;
    slots_[slot] = std::move(p);
    peer_count_++;
    peer_ids_.emplace(key, ref.id);
    return ref;
  }

  // kPosted when `p` can take a request now. A lost connection is re-made here, at the first post
  // after it: the post waits (kRetryPeer) for the handshake.
  PostResult check_peer(Peer* p, PeerId id) {
    if (!p) {
      last_error_ = fmt::format("verbs: peer id {:#x} is not known on {} (removed?)", id, dev_.name);
      return PostResult::kFailed;
    }
    switch (p->state) {
      case PeerState::kReady:
        return PostResult::kPosted;
      case PeerState::kConnecting:
        return PostResult::kRetryPeer;
      case PeerState::kFailed:
        if (Handshake::Clock::now() < p->retry_at) {
          last_error_ = p->error;
          return PostResult::kFailed;
        }
        [[fallthrough]];
      case PeerState::kDown:
        try {
          begin_connection(*p, p->epoch + 1, Handshake::Clock::now());
        } catch (const Error& e) {
          fail_connection(*p, e.what());
          last_error_ = p->error;
          return PostResult::kFailed;
        }
        return PostResult::kRetryPeer;
    }
    return PostResult::kFailed;
  }

  std::unique_ptr<SendQueue> new_queue(Peer& p, ibv_srq* srq, int remote_access) {
    auto q = std::make_unique<SendQueue>();
    q->qp = create_rc_qp(srq, remote_access);
    q->peer = &p;
    q->depth = qp_depth_;
    q->psn = static_cast<uint32_t>(rng_()) & 0xFFFFFF;
    return q;
  }

  // New queue pairs (INIT) under `epoch` and a fresh handshake; the peer has none when called.
  void begin_connection(Peer& p, uint32_t epoch, Handshake::Clock::time_point now) {
    p.msg = new_queue(p, msg_srq_, 0);
    try {
      p.write = new_queue(p, imm_srq_, IBV_ACCESS_REMOTE_WRITE);
    } catch (...) {
      ibv_destroy_qp(p.msg->qp);
      p.msg.reset();
      throw;
    }
    p.epoch = epoch;
    p.remote_msg_qpn = p.remote_write_qpn = 0;
    p.hs = Handshake(now, timing_);
    p.state = PeerState::kConnecting;
    if (!p.handshaking) {
      p.handshaking = true;
      handshaking_.push_back(&p);
    }
    if (p.connections++ > 0)
      log::info("verbs: reconnecting to peer {} on {} (epoch {})", p.addr.describe(), dev_.name, epoch);
  }

  // Retires the peer's queue pairs, if any: every request on them fails with `why`.
  void drop_connection(Peer& p, const std::string& why) {
    retire(std::move(p.msg), why);
    retire(std::move(p.write), why);
    if (p.state == PeerState::kConnecting || p.state == PeerState::kReady) p.state = PeerState::kDown;
  }

  // A connection that will not come (handshake unanswered, a queue pair that cannot be connected):
  // posts fail at once for VerbsConfig::reconnect_backoff, then the next one tries again.
  void fail_connection(Peer& p, const std::string& why) {
    drop_connection(p, why);
    p.state = PeerState::kFailed;
    p.error = why;
    p.retry_at = Handshake::Clock::now() + cfg_.reconnect_backoff;
  }

  // A completion error on one of the peer's current queue pairs: that queue pair is in the error
  // state for good, so both are retired and the next post connects anew.
  void lose_connection(Peer& p, const std::string& why) {
    log::warn("{}; its queue pairs are retired, the next post reconnects", why);
    p.error = why;
    drop_connection(p, fmt::format("verbs: connection to peer {} on {} reset after an error: {}", p.addr.describe(),
                                   dev_.name, why));
  }

  void retire(std::unique_ptr<SendQueue> q, const std::string& why) {
    if (!q) return;
    if (q->error.empty()) q->error = why;
    q->peer = nullptr;
    // Chained requests never reached the NIC: they fail here.
    for (uint32_t i = 0; i < q->chained; i++) {
      Completion c;
      if (request_done(reinterpret_cast<OpContext*>(q->wr[i].wr_id), &q->error, c)) synthetic_.push_back(std::move(c));
    }
    q->chained = 0;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;  // the NIC flushes what it holds: each request completes with an error
    if (int rc = ibv_modify_qp(q->qp, &a, IBV_QP_STATE))
      log::warn("verbs: moving a queue pair of {} to the error state failed: {}", dev_.name, errno_text(rc));
    retired_.push_back(std::move(q));
  }

  // Destroys the retired queue pairs whose requests have all come back. Some providers (mlx5)
  // remove a destroyed queue pair's entries from its CQs, so the receive CQ is read out first:
  // an immediate that arrived on it must still be counted.
  void reap_retired() {
    bool drained = false;
    for (size_t i = 0; i < retired_.size();) {
      SendQueue& q = *retired_[i];
      if (q.outstanding > 0) {
        i++;
        continue;
      }
      if (!drained) {
        drain_recv_cq();
        drained = true;
      }
      if (int rc = ibv_destroy_qp(q.qp)) log::warn("verbs: ibv_destroy_qp on {} failed: {}", dev_.name, errno_text(rc));
      std::erase(dirty_, &q);
      retired_[i] = std::move(retired_.back());
      retired_.pop_back();
    }
  }

  void drain_recv_cq() {
    ibv_wc wcs[32];
    int got;
    while ((got = ibv_poll_cq(recv_cq_, static_cast<int>(std::size(wcs)), wcs)) > 0)
      for (int i = 0; i < got; i++) {
        Completion c;
        if (on_recv_completion(wcs[i], c)) synthetic_.push_back(std::move(c));
      }
  }

  void unlist_handshake(Peer& p) {
    if (!p.handshaking) return;
    std::erase(handshaking_, &p);
    p.handshaking = false;
  }

  void progress_handshakes() {
    // Off the hot path: with no handshake of ours under way, a new peer's first message waits
    // at most 64 polls (microseconds) to be read; a handshake in progress is served every poll.
    if (handshaking_.empty() && (++polls_ & 63) != 0) return;
    ibv_wc wcs[16];
    int got = ibv_poll_cq(ud_cq_, static_cast<int>(std::size(wcs)), wcs);
    for (int i = 0; i < got; i++) {
      const ibv_wc& wc = wcs[i];
      if (wc.wr_id & kUdSendTag) {
        free_ud_sends_.push_back(static_cast<uint32_t>(wc.wr_id & 0xFFFFFFFF));
        continue;
      }
      auto slot = static_cast<uint32_t>(wc.wr_id);
      if (wc.status == IBV_WC_SUCCESS && wc.byte_len > kGrh)
        on_handshake(std::span<const uint8_t>(ud_slot(slot) + kGrh, wc.byte_len - kGrh));
      post_ud_recv(slot);
    }
    if (handshaking_.empty()) return;
    auto now = Handshake::Clock::now();
    for (size_t i = 0; i < handshaking_.size();) {
      Peer& p = *handshaking_[i];
      if (p.state == PeerState::kConnecting) {
        if (p.hs.due(now)) send_handshake(p, now);
        if (p.hs.failed())
          fail_connection(p, fmt::format("verbs: no connection to peer {} on {}: handshake unanswered after {} "
                                         "messages in {} ms (is the peer alive, on the same fabric, with the "
                                         "same GID type?)",
                                         p.addr.describe(), dev_.name, p.hs.messages_sent(),
                                         cfg_.handshake_timeout.count()));
      }
      if (p.state != PeerState::kConnecting) {
        p.handshaking = false;
        handshaking_[i] = handshaking_.back();
        handshaking_.pop_back();
      } else {
        i++;
      }
    }
  }

  void on_handshake(std::span<const uint8_t> bytes) {
    HandshakeMsg m;
    try {
      m = HandshakeMsg::from_bytes(bytes);
    } catch (const Error& e) {
      log::warn("verbs: dropped a handshake message on {}: {}", dev_.name, e.what());
      return;
    }
    if (m.to_nonce != me_.nonce) return;  // meant for an earlier process at this QP number
    std::string key = m.from.to_bytes();
    auto it = peer_ids_.find(key);
    Peer* pp;
    if (it != peer_ids_.end()) {
      pp = find(it->second);
    } else {
      try {
        pp = &add_peer(m.from, key);  // the peer connects first: accept it
      } catch (const Error& e) {
        log::warn("verbs: refused a connection on {}: {}", dev_.name, e.what());
        return;
      }
    }
    Peer& p = *pp;
    auto now = Handshake::Clock::now();
    bool live = p.msg != nullptr;
    bool consistent =
        live && (!p.hs.connected() || (m.msg_qpn == p.remote_msg_qpn && m.write_qpn == p.remote_write_qpn)) &&
        (!(m.flags & HandshakeMsg::kConnected) ||
         (m.to_msg_qpn == p.msg->qp->qp_num && m.to_write_qpn == p.write->qp->qp_num));
    try {
      switch (epoch_step(p.epoch, live, m.epoch, m.flags, consistent)) {
        case EpochStep::kCurrent:
          break;
        case EpochStep::kStale:  // tell the peer where we are
          send_handshake(p, now);
          return;
        case EpochStep::kAdopt:
          drop_connection(p, fmt::format("verbs: peer {} on {} reconnected (epoch {} after {})", p.addr.describe(),
                                         dev_.name, m.epoch, p.epoch));
          begin_connection(p, m.epoch, now);
          break;  // and the message opens the new connection
        case EpochStep::kSupersede:
          drop_connection(p, fmt::format("verbs: peer {} on {} reconnected (its epoch {} and queue pairs do not "
                                         "match ours at epoch {})",
                                         p.addr.describe(), dev_.name, m.epoch, p.epoch));
          begin_connection(p, superseding_epoch(p.epoch, m.epoch), now);
          send_handshake(p, now);
          return;
      }
    } catch (const Error& e) {
      fail_connection(p, e.what());
      return;
    }
    Handshake::Actions a = p.hs.on_message(m.flags);
    if (a.connect) {
      p.remote_msg_qpn = m.msg_qpn;
      p.remote_write_qpn = m.write_qpn;
      auto mtu = static_cast<ibv_mtu>(std::min<int>(m.mtu, dev_.port_attr.active_mtu));
      try {
        connect(*p.msg, m.msg_qpn, m.msg_psn, mtu, p.addr);
        connect(*p.write, m.write_qpn, m.write_psn, mtu, p.addr);
      } catch (const Error& e) {
        fail_connection(p, e.what());
        return;
      }
    }
    if (p.hs.ready() && p.state == PeerState::kConnecting) {
      p.state = PeerState::kReady;
      p.error.clear();
      if (p.connections > 1)
        log::info("verbs: reconnected to peer {} on {} (epoch {})", p.addr.describe(), dev_.name, p.epoch);
    }
    if (a.reply) send_handshake(p, now);
  }

  void connect(SendQueue& q, uint32_t remote_qpn, uint32_t remote_psn, ibv_mtu mtu, const VerbsAddress& to) {
    ibv_gid dgid;
    std::memcpy(dgid.raw, to.gid.data(), 16);
    ibv_qp_attr m{};
    m.qp_state = IBV_QPS_RTR;
    m.path_mtu = mtu;
    m.dest_qp_num = remote_qpn;
    m.rq_psn = remote_psn;
    m.max_dest_rd_atomic = 1;
    m.min_rnr_timer = cfg_.min_rnr_timer;
    m.ah_attr = dev_.ah_attr(dgid, to.lid);
    int rc = ibv_modify_qp(q.qp, &m, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc) fail("ibv_modify_qp(RTR)", rc, dev_.name);
    m = {};
    m.qp_state = IBV_QPS_RTS;
    m.sq_psn = q.psn;
    m.timeout = cfg_.ack_timeout;
    m.retry_cnt = cfg_.retry_count;
    m.rnr_retry = 7;  // infinite: a receiver out of buffers is not dead
    m.max_rd_atomic = 1;
    rc = ibv_modify_qp(q.qp, &m, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc) fail("ibv_modify_qp(RTS)", rc, dev_.name);
    if (log::level() >= log::Level::kDebug) log_connected(q);
  }

  // What the device holds for a connected queue pair, read back (is the traffic class applied?).
  void log_connected(SendQueue& q) {
    ibv_qp_attr a{};
    ibv_qp_init_attr init{};
    if (ibv_query_qp(q.qp, &a, IBV_QP_AV | IBV_QP_MIN_RNR_TIMER | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT, &init) != 0) return;
    log::debug("verbs: queue pair {} on {} connected to qp {}: traffic class {}, service level {}, min_rnr_timer {}, "
               "ack_timeout {}, retry_count {}",
               q.qp->qp_num, dev_.name, a.dest_qp_num, a.ah_attr.grh.traffic_class, a.ah_attr.sl, a.min_rnr_timer,
               a.timeout, a.retry_cnt);
  }

  // Our current message to `p` (which has queue pairs).
  void send_handshake(Peer& p, Handshake::Clock::time_point now) {
    p.hs.sent(now);  // a message that cannot go now is a lost one: the retransmission recovers it
    if (drops_left_ > 0) {
      drops_left_--;
      return;
    }
    if (free_ud_sends_.empty()) return;
    uint32_t slot = free_ud_sends_.back();
    HandshakeMsg m;
    m.flags = p.hs.flags();
    m.mtu = static_cast<uint8_t>(dev_.port_attr.active_mtu);
    m.from = me_;
    m.to_nonce = p.addr.nonce;
    m.msg_qpn = p.msg->qp->qp_num;
    m.write_qpn = p.write->qp->qp_num;
    m.msg_psn = p.msg->psn;
    m.write_psn = p.write->psn;
    m.epoch = p.epoch;
    if (p.hs.connected()) {
      m.to_msg_qpn = p.remote_msg_qpn;
      m.to_write_qpn = p.remote_write_qpn;
    }
    std::vector<uint8_t> bytes = m.to_bytes();
    uint8_t* buf = ud_slot(kUdRecvs + slot);
    std::memcpy(buf, bytes.data(), bytes.size());
    ibv_sge sge{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(bytes.size()), ud_mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = kUdSendTag | slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.ud.ah = p.ah;
    wr.wr.ud.remote_qpn = p.addr.ud_qpn;
    wr.wr.ud.remote_qkey = kQkey;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ud_qp_, &wr, &bad)) {
      log::warn("verbs: handshake send on {} failed: {}", dev_.name, errno_text(rc));
      return;
    }
    free_ud_sends_.pop_back();
  }

  // ---- posting -------------------------------------------------------------------------------

  // The send CQ is the domain's (kRetry when full), the queue pair the peer's (kRetryPeer).
  PostResult room(const SendQueue& q, uint64_t requests) const {
    if (send_outstanding_ + requests > send_cq_depth_) return PostResult::kRetry;
    if (q.outstanding + requests > q.depth) return PostResult::kRetryPeer;
    return PostResult::kPosted;
  }

  ibv_send_wr& next_request(SendQueue& q, OpContext* ctx, const void* src, uint64_t len, uint32_t lkey) {
    if (q.chained == kChain) flush(q);
    uint32_t i = q.chained;
    ibv_sge& sge = q.sge[i];
    sge = {reinterpret_cast<uint64_t>(src), static_cast<uint32_t>(len), lkey};
    ibv_send_wr& wr = q.wr[i];
    wr = {};
    wr.wr_id = reinterpret_cast<uint64_t>(ctx);
    wr.sg_list = &sge;
    wr.num_sge = len ? 1 : 0;
    wr.send_flags = IBV_SEND_SIGNALED | (len > 0 && len <= max_inline_ ? IBV_SEND_INLINE : 0);
    return wr;
  }

  void commit_request(SendQueue& q) {
    q.chained++;
    q.outstanding++;
    send_outstanding_++;
    if (!q.dirty) {
      q.dirty = true;
      dirty_.push_back(&q);
    }
  }

  void flush(SendQueue& q) {
    q.dirty = false;  // (poll() clears dirty_ after flushing every listed queue)
    if (q.chained == 0) return;
    for (uint32_t i = 0; i + 1 < q.chained; i++) q.wr[i].next = &q.wr[i + 1];
    q.wr[q.chained - 1].next = nullptr;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(q.qp, q.wr, &bad);
    if (rc) {  // requests from `bad` on never reached the NIC: they fail here, once each
      std::string why = fmt::format("verbs: ibv_post_send on {} failed: {}", dev_.name, errno_text(rc));
      for (ibv_send_wr* w = bad; w; w = w->next) {
        Completion c;
        if (request_done(reinterpret_cast<OpContext*>(w->wr_id), &why, c)) synthetic_.push_back(std::move(c));
      }
      q.chained = 0;
      if (q.peer) lose_connection(*q.peer, why);  // the queue pair is unusable (error state?)
      return;
    }
    q.chained = 0;
  }

  // One request of an operation ended; true (and `c` filled) when it was the operation's last.
  bool request_done(OpContext* ctx, const std::string* error, Completion& c) {
    OpState& s = op_state(ctx);
    s.queue->outstanding--;
    send_outstanding_--;
    if (error) {
      if (!s.failed) op_errors_[ctx] = *error;
      s.failed = 1;
    }
    if (--s.requests_left > 0) return false;
    c.context = ctx;
    c.error.clear();
    if (s.failed) {
      c.kind = Completion::Kind::kError;
      auto it = op_errors_.find(ctx);
      c.error = std::move(it->second);
      op_errors_.erase(it);
    } else {
      c.kind = Completion::Kind::kLocal;
    }
    return true;
  }

  size_t on_send_completion(const ibv_wc& wc, Completion& c) {
    auto* ctx = reinterpret_cast<OpContext*>(wc.wr_id);
    if (wc.status == IBV_WC_SUCCESS) return request_done(ctx, nullptr, c);
    SendQueue& q = *op_state(ctx).queue;
    if (q.error.empty()) {  // the first failure says why; the requests flushed after it repeat it
      q.error = fmt::format("verbs: peer {} on {} failed: {} (vendor error 0x{:x})",
                            q.peer ? q.peer->addr.describe() : "?", dev_.name, ibv_wc_status_str(wc.status),
                            wc.vendor_err);
    }
    if (q.peer) lose_connection(*q.peer, q.error);  // retires q (it stays valid until drained)
    return request_done(ctx, &q.error, c);
  }

  size_t on_recv_completion(const ibv_wc& wc, Completion& c) {
    if (wc.wr_id == kImmRecvId) {
      imm_reposts_++;
      if (wc.status != IBV_WC_SUCCESS) {
        log::warn("verbs: immediate receive on {} failed: {}", dev_.name, ibv_wc_status_str(wc.status));
        return 0;
      }
      c.kind = Completion::Kind::kRemoteImm;
      c.context = nullptr;
      c.imm = ntohl(wc.imm_data);
      c.error.clear();
      return 1;
    }
    c.context = reinterpret_cast<OpContext*>(wc.wr_id);
    c.error.clear();
    if (wc.status == IBV_WC_SUCCESS) {
      c.kind = Completion::Kind::kRecv;
      c.len = wc.byte_len;
    } else {
      c.kind = Completion::Kind::kError;
      c.error = fmt::format("verbs: receive on {} failed: {}", dev_.name, ibv_wc_status_str(wc.status));
    }
    return 1;
  }

  void repost_imm_recvs() {
    ibv_recv_wr wrs[64];
    while (imm_reposts_ > 0) {
      uint32_t n = std::min<uint32_t>(imm_reposts_, std::size(wrs));
      for (uint32_t i = 0; i < n; i++) {
        wrs[i] = {};
        wrs[i].wr_id = kImmRecvId;
        wrs[i].num_sge = 0;  // WRITE_WITH_IMM carries no payload into the receive
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
      }
      ibv_recv_wr* bad = nullptr;
      if (int rc = ibv_post_srq_recv(imm_srq_, wrs, &bad)) {
        log::error("verbs: refilling immediate receives on {} failed: {}", dev_.name, errno_text(rc));
        return;
      }
      imm_reposts_ -= n;
    }
  }

  VerbsConfig cfg_;
  DeviceContext dev_;
  Handshake::Timing timing_;
  uint32_t drops_left_ = 0;
  std::string provider_ = "verbs";
  std::string address_;
  DomainCaps caps_;
  VerbsAddress me_;
  std::mt19937_64 rng_;
  uint64_t max_msg_ = 0;
  uint32_t qp_depth_ = 0, msg_srq_depth_ = 0, imm_srq_depth_ = 0, send_cq_depth_ = 0;
  uint32_t max_inline_ = 0;
  uint32_t send_outstanding_ = 0;
  uint32_t imm_reposts_ = 0;
  uint32_t polls_ = 0;
  std::chrono::steady_clock::time_point next_low_warning_{};

  ibv_cq* send_cq_ = nullptr;
  ibv_cq* recv_cq_ = nullptr;
  ibv_cq* ud_cq_ = nullptr;
  ibv_srq* msg_srq_ = nullptr;
  ibv_srq* imm_srq_ = nullptr;
  ibv_qp* ud_qp_ = nullptr;
  ibv_mr* ud_mr_ = nullptr;
  std::vector<uint8_t> ud_buf_;
  std::vector<uint32_t> free_ud_sends_;
  void* scratch_ = nullptr;
  DomainRegion scratch_region_;

  std::vector<std::unique_ptr<Peer>> slots_;  // by id_slot(PeerId); null: free
  std::vector<uint32_t> generations_;         // per slot
  std::vector<uint32_t> free_slots_;
  size_t peer_count_ = 0;
  std::unordered_map<std::string, PeerId> peer_ids_;
  std::vector<Peer*> handshaking_;
  std::vector<std::unique_ptr<SendQueue>> retired_;  // error state, waiting for their last requests
  std::vector<SendQueue*> dirty_;
  std::deque<Completion> synthetic_;
  std::unordered_map<OpContext*, std::string> op_errors_;
  std::string last_error_;
};

}  // namespace
}  // namespace verbs

std::unique_ptr<Domain> open_verbs_domain(const EngineConfig& config, size_t nic_index) {
  return std::make_unique<verbs::VerbsDomain>(config, nic_index);
}

}  // namespace fabric
