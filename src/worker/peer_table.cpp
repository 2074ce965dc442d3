// PeerTable (peer_table.h): peer records, the routes and groups that hold them, and their release.
#include "worker/peer_table.h"

#include <algorithm>

#include "fabric/metrics.h"
#include "util/log.h"

namespace fabric {

namespace {
RemoteSlot& live_remote(RemoteTable& table, const RemoteMr& r) {
  RemoteSlot* s = table.live(r);
  if (!s)
    throw Error(ErrorCode::kNotFound,
                "the destination remote region was removed (remove_remote) before the transfer ran");
  return *s;
}
}  // namespace

ResolvedTarget PeerTable::resolve(const NetAddr& peer) {
  auto it = index_.find(peer);
  if (it != index_.end()) return records_[it->second].target;
  ResolvedTarget t = domains_.insert_peer(peer);
  t.record = new_record(peer, t);
  return records_[t.record].target;
}

uint32_t PeerTable::new_record(const NetAddr& addr, const ResolvedTarget& t) {
  const uint32_t r = *records_.take();  // unbounded: always a slot
  PeerRecord& p = records_[r];
  p.state = State::kLive;
  p.target = t;
  p.target.record = r;
  p.addr = addr;
  p.holders = p.outstanding = 0;
  p.label = metrics_peer_label(addr);
  p.writes = p.bytes = p.sends = p.errors = 0;
  index_.emplace(addr, r);
  return r;
}

// The domains forget the peer now; transfers still naming the record see its state at their
// next post (kReleased: re-resolve; kRemoved: fail). The record is reused once none holds it.
void PeerTable::release(uint32_t r) {
  PeerRecord& p = records_[r];
  domains_.remove_peer(p.target);
  auto it = index_.find(p.addr);
  if (it != index_.end() && it->second == r) index_.erase(it);
  if (p.state != State::kRemoved) p.state = State::kReleased;
  maybe_free(r);
}

void PeerTable::maybe_free(uint32_t r) {
  PeerRecord& p = records_[r];
  bool gone = p.state == State::kReleased || p.state == State::kRemoved;
  if (gone && p.holders == 0 && p.outstanding == 0) {
    p.state = State::kFree;
    p.addr = NetAddr{};
    p.label.clear();
    records_.give(r);
  }
}

void PeerTable::settle(uint32_t r) {
  if (records_[r].state == State::kFailed && records_[r].outstanding == 0) release(r);
  else maybe_free(r);  // a released one may have waited for its last completion
}

void PeerTable::peer_failed(uint32_t r) {
  PeerRecord& p = records_[r];
  if (p.state != State::kLive) return;
  p.state = State::kFailed;
  peers_lost_.add();
  log::info("a peer's connection failed; its resources go once nothing of it is in flight");
  if (p.outstanding == 0) release(r);
}

std::vector<RemoteMr> PeerTable::remove_peer(const NetAddr& peer) {
  std::vector<RemoteMr> removed;
  auto it = index_.find(peer);
  if (it == index_.end()) return removed;
  uint32_t r = it->second;
  records_[r].state = State::kRemoved;
  release(r);  // first: the record must not be freed while the domains still hold it
  // Its interned regions go with it (a process at the same address later is another peer,
  // with other keys). Groups keep their member, which fails with kCancelled from now on.
  for (uint32_t s = 0; s < remotes_.allocated(); s++) {
    RemoteSlot& slot = remotes_.slot(s);
    uint32_t gen = slot.generation.load(std::memory_order_relaxed);
    if ((gen & 1) && slot.target(worker_).record == r) removed.push_back(RemoteMr{s, gen});
  }
  return removed;
}

// A transfer's target whose peer record is no longer live: a released one (its connection
// failed) is resolved afresh, a removed one fails the transfer.
bool PeerTable::usable(Transfer& t, ResolvedTarget& target, uint32_t op) {
  State s = records_[target.record].state;
  if (s == State::kLive || s == State::kFailed) return true;
  if (s == State::kRemoved) {
    t.fail(Status(ErrorCode::kCancelled, "the destination peer was removed (remove_peer)"));
    return false;
  }
  try {
    if (t.group) {  // `target` is the member's own: refreshed in place, held by the group
      GroupMember& m = t.group->members[op];
      refresh(m.target, m.desc);
      return true;
    }
    rehold(target, target_of(t.req, per_destination(t.req.kind) ? op : 0));
  } catch (const Error& e) {
    t.fail(e.status());
    return false;
  }
  return true;
}

ResolvedTarget PeerTable::target_of(const TransferRequest& q, size_t i) {
  switch (q.kind) {
    case TransferKind::kSend: return resolve(q.buf->send_dst);
    case TransferKind::kScatter: return current(q.buf->slices[i].dst.mr);
    case TransferKind::kBarrier: return current(q.buf->remotes[i]);
    default: return current(q.dst);
  }
}

const ResolvedTarget& PeerTable::current(const RemoteMr& remote) {
  RemoteSlot& slot = live_remote(remotes_, remote);
  return refresh(slot.target(worker_), slot.desc);
}

// Moves a hold from the record `held` names to the one `fresh` names.
void PeerTable::rehold(ResolvedTarget& held, const ResolvedTarget& fresh) {
  records_[fresh.record].holders++;
  uint32_t old = held.record;
  held = fresh;
  unhold(old);
}

// A held route whose peer was released (its connection failed) is resolved again, the hold
// moving to the new record; one whose peer was removed cannot be.
const ResolvedTarget& PeerTable::refresh(ResolvedTarget& held, const MrDesc& desc) {
  State s = records_[held.record].state;
  if (s == State::kRemoved)
    throw Error(ErrorCode::kCancelled, "the destination peer was removed (remove_peer)");
  if (s != State::kLive && s != State::kFailed) rehold(held, route(desc));
  return held;
}

ResolvedTarget PeerTable::route(const MrDesc& d) {
  ResolvedTarget t = resolve(d.endpoint());
  t.imm_base = d.imms().base;
  if (t.local && d.local_key()) {
    t.key[domains_.local_index()] = *d.local_key();
    return t;
  }
  t.local = false;
  if (d.keys().empty())
    throw Error(ErrorCode::kUnsupported,
                "the destination region has no NIC keys (its owner's NICs cannot reach that memory) "
                "and is not reachable through cuda_ipc from this engine");
  for (size_t i = 0; i < d.keys().size(); i++) t.key[i] = d.keys()[i];
  return t;
}

void PeerTable::attach_remote(uint32_t s) {
  RemoteSlot& slot = remotes_.slot(s);
  ResolvedTarget& target = slot.target(worker_);
  target = route(slot.desc);
  hold(target.record);
}

void PeerTable::detach_remote(uint32_t s) {
  ResolvedTarget& target = remotes_.slot(s).target(worker_);
  const uint32_t record = target.record;
  target = {};
  if (record != UINT32_MAX) unhold(record);
}

std::vector<PeerMetrics> PeerTable::metrics() const {
  std::vector<PeerMetrics> out;
  for (uint32_t r = 0; r < records_.size(); r++) {
    const PeerRecord& p = records_[r];
    if (p.state == State::kFree) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const PeerMetrics& m) { return m.peer == p.label; });
    if (it == out.end()) it = out.insert(out.end(), PeerMetrics{p.label});
    it->writes += p.writes;
    it->bytes += p.bytes;
    it->sends += p.sends;
    it->errors += p.errors;
    it->in_flight += p.outstanding;
  }
  return out;
}

uint32_t PeerTable::add_group(std::span<const RemoteMr> members) {
  auto g = std::make_unique<GroupState>();
  for (const RemoteMr& m : members) {
    RemoteSlot& slot = live_remote(remotes_, m);
    g->members.push_back({refresh(slot.target(worker_), slot.desc), slot.desc});
  }
  for (auto& m : g->members) hold(m.target.record);
  groups_.push_back(std::move(g));
  return static_cast<uint32_t>(groups_.size() - 1);
}

}  // namespace fabric
