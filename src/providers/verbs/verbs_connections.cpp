#include "providers/verbs/verbs_connections.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "util/log.h"

namespace fabric::verbs {
namespace {

constexpr size_t kMaxPeers = 65536;  // peers a domain accepts (inserted or connecting to us)

// PeerId: the slot in the low 32 bits, the slot's generation above, so that the id of a removed
// peer never reaches the peer that takes its slot later.
constexpr PeerId make_id(uint32_t slot, uint32_t generation) {
  return (static_cast<PeerId>(generation) << 32) | slot;
}
constexpr uint32_t id_slot(PeerId id) { return static_cast<uint32_t>(id); }
constexpr uint32_t id_generation(PeerId id) { return static_cast<uint32_t>(id >> 32); }

ibv_gid gid_of(const VerbsAddress& a) {
  ibv_gid gid;
  std::memcpy(gid.raw, a.gid.data(), 16);
  return gid;
}

}  // namespace

Connections::Connections(const VerbsConfig& cfg, const DeviceContext& dev, SharedQueues& queues,
                         RequestPoster& poster)
    : cfg_(cfg),
      dev_(dev),
      queues_(queues),
      poster_(poster),
      channel_(dev, cfg.drop_handshake_packets) {
  timing_.timeout = cfg_.handshake_timeout;
  std::random_device rd;
  rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid()));
  std::memcpy(me_.gid.data(), dev_.gid.raw, 16);
  me_.lid = dev_.roce() ? 0 : dev_.port_attr.lid;
  me_.ud_qpn = channel_.qp_num();
  me_.nonce = rng_() | 1;  // never 0
}

Connections::~Connections() {
  for (uint32_t i = 0; i < slots_.size(); i++) {
    const std::unique_ptr<Peer>& p = slots_[i].peer;
    if (!p) continue;
    for (SendQueue* q : {p->msg.get(), p->write.get()})
      if (q) ibv_destroy_qp(q->qp);
    if (p->ah) ibv_destroy_ah(p->ah);
  }
}

PeerId Connections::insert_peer(const std::string& address) {
  auto it = peer_ids_.find(address);
  if (it != peer_ids_.end()) return it->second;
  VerbsAddress a = VerbsAddress::from_bytes(
      std::span(reinterpret_cast<const uint8_t*>(address.data()), address.size()));
  return add_peer(a, address).id;
}

void Connections::remove_peer(PeerId id) {
  Peer* p = find(id);
  if (!p) return;
  drop_connection(*p,
                  fmt::format("verbs: peer {} on {} was removed", p->addr.describe(), dev_.name));
  unlist_handshake(*p);
  peer_ids_.erase(p->key);
  if (p->ah) ibv_destroy_ah(p->ah);
  uint32_t slot = id_slot(id);
  slots_[slot].peer.reset();
  slots_[slot].generation++;
  slots_.give(slot);
  peer_count_--;
}

Peer* Connections::find(PeerId id) {
  const PeerSlot* s = slots_.find(id_slot(id));
  if (!s || !s->peer || s->generation != id_generation(id)) return nullptr;
  return s->peer.get();
}

// A known peer, not connected yet: its queue pairs are made by the first post to it or by its
// first message.
Peer& Connections::add_peer(const VerbsAddress& a, const std::string& key) {
  if (peer_count_ >= kMaxPeers)
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("verbs: {} peers on {} already", kMaxPeers, dev_.name));
  ibv_ah_attr ah = dev_.ah_attr(gid_of(a), a.lid);
  ibv_ah* handle = check_ptr(ibv_create_ah(dev_.pd, &ah), "ibv_create_ah", dev_.name);
  const uint32_t slot = *slots_.take();  // unbounded: always a slot
  auto p = std::make_unique<Peer>(Handshake::Clock::now(), timing_);
  p->addr = a;
  p->key = key;
  p->ah = handle;
  p->id = make_id(slot, slots_[slot].generation);
  Peer& ref = *p;
  slots_[slot].peer = std::move(p);
  peer_count_++;
  peer_ids_.emplace(key, ref.id);
  return ref;
}

PostResult Connections::check_peer(Peer* p, PeerId id, std::string& error) {
  if (!p) {
    error = fmt::format("verbs: peer id {:#x} is not known on {} (removed?)", id, dev_.name);
    return PostResult::kFailed;
  }
  switch (p->state) {
    case PeerState::kReady:
      return PostResult::kPosted;
    case PeerState::kConnecting:
      return PostResult::kRetryPeer;
    case PeerState::kFailed:
      if (Handshake::Clock::now() < p->retry_at) {
        error = p->error;
        return PostResult::kFailed;
      }
      [[fallthrough]];
    case PeerState::kDown:
      try {
        begin_connection(*p, p->epoch + 1, Handshake::Clock::now());
      } catch (const Error& e) {
        fail_connection(*p, e.what());
        error = p->error;
        return PostResult::kFailed;
      }
      return PostResult::kRetryPeer;
  }
  return PostResult::kFailed;
}

std::unique_ptr<SendQueue> Connections::new_queue(Peer& p, ibv_srq* srq, int remote_access) {
  auto q = std::make_unique<SendQueue>();
  q->qp = queues_.create_rc_qp(srq, remote_access);
  q->peer = &p;
  q->depth = queues_.sizes.qp_depth;
  q->psn = static_cast<uint32_t>(rng_()) & 0xFFFFFF;
  return q;
}

// New queue pairs (INIT) under `epoch` and a fresh handshake; the peer has none when called.
void Connections::begin_connection(Peer& p, uint32_t epoch, Handshake::Clock::time_point now) {
  p.msg = new_queue(p, queues_.msg_srq, 0);
  try {
    p.write = new_queue(p, queues_.imm_srq, IBV_ACCESS_REMOTE_WRITE);
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
    log::info("verbs: reconnecting to peer {} on {} (epoch {})", p.addr.describe(), dev_.name,
              epoch);
}

// Retires the peer's queue pairs, if any: every request on them fails with `why`.
void Connections::drop_connection(Peer& p, const std::string& why) {
  poster_.retire(std::move(p.msg), why);
  poster_.retire(std::move(p.write), why);
  if (p.state == PeerState::kConnecting || p.state == PeerState::kReady) p.state = PeerState::kDown;
}

// A connection that will not come (handshake unanswered, a queue pair that cannot be connected):
// posts fail at once for VerbsConfig::reconnect_backoff, then the next one tries again.
void Connections::fail_connection(Peer& p, const std::string& why) {
  drop_connection(p, why);
  p.state = PeerState::kFailed;
  p.error = why;
  p.retry_at = Handshake::Clock::now() + cfg_.reconnect_backoff;
}

void Connections::lose_connection(Peer& p, const std::string& why) {
  log::warn("{}; its queue pairs are retired, the next post reconnects", why);
  p.error = why;
  drop_connection(p, fmt::format("verbs: connection to peer {} on {} reset after an error: {}",
                                 p.addr.describe(), dev_.name, why));
}

void Connections::unlist_handshake(Peer& p) {
  if (!p.handshaking) return;
  std::erase(handshaking_, &p);
  p.handshaking = false;
}

void Connections::progress_handshakes() {
  // Off the hot path: with no handshake of ours under way, a new peer's first message waits
  // at most 64 polls (microseconds) to be read; a handshake in progress is served every poll.
  if (handshaking_.empty() && (++polls_ & 63) != 0) return;
  channel_.receive([this](std::span<const uint8_t> bytes) { on_handshake(bytes); });
  if (handshaking_.empty()) return;
  auto now = Handshake::Clock::now();
  for (size_t i = 0; i < handshaking_.size();) {
    Peer& p = *handshaking_[i];
    if (p.state == PeerState::kConnecting) {
      if (p.hs.due(now)) send_handshake(p, now);
      if (p.hs.failed())
        fail_connection(p, fmt::format("verbs: no connection to peer {} on {}: handshake "
                                       "unanswered after {} messages in {} ms (is the peer "
                                       "alive, on the same fabric, with the same GID type?)",
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

void Connections::on_handshake(std::span<const uint8_t> bytes) {
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
      live &&
      (!p.hs.connected() || (m.msg_qpn == p.remote_msg_qpn && m.write_qpn == p.remote_write_qpn)) &&
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
        drop_connection(p, fmt::format("verbs: peer {} on {} reconnected (epoch {} after {})",
                                       p.addr.describe(), dev_.name, m.epoch, p.epoch));
        begin_connection(p, m.epoch, now);
        break;  // and the message opens the new connection
      case EpochStep::kSupersede:
        drop_connection(p, fmt::format("verbs: peer {} on {} reconnected (its epoch {} and queue "
                                       "pairs do not match ours at epoch {})",
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
      log::info("verbs: reconnected to peer {} on {} (epoch {})", p.addr.describe(), dev_.name,
                p.epoch);
  }
  if (a.reply) send_handshake(p, now);
}

// Moves a queue pair of ours from INIT to RTS, pointed at the peer's queue pair `remote_qpn`.
void Connections::connect(SendQueue& q, uint32_t remote_qpn, uint32_t remote_psn, ibv_mtu mtu,
                          const VerbsAddress& to) {
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_RTR;
  m.path_mtu = mtu;
  m.dest_qp_num = remote_qpn;
  m.rq_psn = remote_psn;
  m.max_dest_rd_atomic = 1;
  m.min_rnr_timer = cfg_.min_rnr_timer;
  m.ah_attr = dev_.ah_attr(gid_of(to), to.lid);
  int rc = ibv_modify_qp(q.qp, &m,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) fail("ibv_modify_qp(RTR)", rc, dev_.name);
  m = {};
  m.qp_state = IBV_QPS_RTS;
  m.sq_psn = q.psn;
  m.timeout = cfg_.ack_timeout;
  m.retry_cnt = cfg_.retry_count;
  m.rnr_retry = 7;  // infinite: a receiver out of buffers is not dead
  m.max_rd_atomic = 1;
  rc = ibv_modify_qp(q.qp, &m,
                     IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) fail("ibv_modify_qp(RTS)", rc, dev_.name);
  if (log::level() >= log::Level::kDebug) log_connected(q);
}

// What the device holds for a connected queue pair, read back (is the traffic class applied?).
void Connections::log_connected(SendQueue& q) {
  ibv_qp_attr a{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(q.qp, &a, IBV_QP_AV | IBV_QP_MIN_RNR_TIMER | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT,
                   &init) != 0)
    return;
  log::debug(
      "verbs: queue pair {} on {} connected to qp {}: traffic class {}, service level {}, "
      "min_rnr_timer {}, ack_timeout {}, retry_count {}",
      q.qp->qp_num, dev_.name, a.dest_qp_num, a.ah_attr.grh.traffic_class, a.ah_attr.sl,
      a.min_rnr_timer, a.timeout, a.retry_cnt);
}

// Our current message to `p` (which has queue pairs).
void Connections::send_handshake(Peer& p, Handshake::Clock::time_point now) {
  p.hs.sent(now);  // a message that cannot go now is a lost one: the retransmission recovers it
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
  channel_.send(m, p.ah, p.addr.ud_qpn);
}

}  // namespace fabric::verbs
