// What the two local domains (cuda_ipc, host_ipc) share: the domain's own endpoint (its segment,
// its region slots, the inboxes it reads), the peers' endpoints it opens and their table, the
// completions both make, and LocalDomain, the Domain glue over them. Each domain adds only how it
// copies. One worker thread owns a domain: nothing here locks.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "domain/domain.h"
#include "providers/ipc/ipc_shared.h"
#include "providers/ipc/shm_segment.h"
#include "util/free_slots.h"
#include "util/log.h"
#include "util/slot_map.h"

namespace fabric::ipc {

inline Completion local_completion(OpContext* ctx) {
  Completion c;
  c.kind = Completion::Kind::kLocal;
  c.context = ctx;
  return c;
}

inline Completion error_completion(OpContext* ctx, std::string why) {
  Completion c;
  c.kind = Completion::Kind::kError;
  c.context = ctx;
  c.error = std::move(why);
  return c;
}

// The peer's process has ended or its endpoint closed: the engine releases the peer (its
// mappings close, its memory can go).
inline Completion lost_completion(OpContext* ctx, std::string_view provider) {
  Completion c = error_completion(
      ctx, fmt::format("{}: the peer's process has ended or its endpoint closed (a "
                       "restarted peer has a new address)",
                       provider));
  c.peer_lost = true;
  return c;
}

// A peer's endpoint, opened and checked.
struct PeerEndpoint {
  std::string address;
  ShmSegment shm;
  Endpoint inbox;
  bool same_process = false;  // one of this process's own domains
  bool lost = false;          // its process has ended (its segment's lock is free) or it closed
  const Header& header() const { return *static_cast<const Header*>(shm.data()); }
};

// Opens the endpoint at `address` for a domain of `kind` in host scope `scope`. Throws
// kUnsupported whenever it cannot be reached that way (another host scope, a segment this process
// cannot see or that has no live owner, another version or kind, truncated, closed): the engine
// then uses its NICs for that peer.
inline void open_peer(PeerEndpoint& p, std::string_view provider, EndpointKind kind,
                      const std::string& scope, const std::string& address) {
  shm::AddressParts parts = shm::split_address(address);
  if (parts.segment_name.empty() || parts.scope != scope)
    throw Error(ErrorCode::kUnsupported, fmt::format("{}: peer endpoint '{}' is not in this host "
                                                     "scope ({}: boot id, IPC and PID namespaces, "
                                                     "/dev/shm); use the NICs",
                                                     provider, address, scope));
  p.address = address;
  p.shm = ShmSegment::open_endpoint(std::string(parts.segment_name));
  const auto* h = static_cast<const Header*>(p.shm.data());
  if (p.shm.size() < sizeof(Header) || h->magic != kMagic)
    throw Error(
        ErrorCode::kUnsupported,
        fmt::format("{}: {} is not an endpoint of this fabric-lib version", provider, address));
  if (h->kind != kind)
    throw Error(
        ErrorCode::kUnsupported,
        fmt::format("{}: {} is an endpoint of the other local domain ({}); use the NICs", provider,
                    address, h->kind == EndpointKind::kCuda ? "cuda_ipc" : "host_ipc"));
  if (h->nonce != p.shm.nonce())
    throw Error(ErrorCode::kUnsupported,
                fmt::format("{}: {} carries nonce {:016x}, not the one in its name", provider,
                            address, h->nonce));
  p.inbox = Endpoint(p.shm.data());
  if (p.inbox.size() > p.shm.size())
    throw Error(ErrorCode::kUnsupported, fmt::format("{}: {} is truncated", provider, address));
  if (p.inbox.closed())
    throw Error(ErrorCode::kUnsupported, fmt::format("{}: {} has closed", provider, address));
  p.same_process = shm::LocalEndpoints::contains(h->nonce);
}

// The peers a domain has opened. PeerId = epoch << 32 | slot: a removed peer's id stays unknown
// after its slot is reused.
template <class Peer>
class PeerSlots {
 public:
  Peer* live(PeerId id) {
    Slot* s = slots_.find(static_cast<uint32_t>(id));
    if (!s || s->epoch != static_cast<uint32_t>(id >> 32)) return nullptr;
    return s->peer.get();
  }
  std::optional<PeerId> find(const std::string& address) const {
    auto it = by_address_.find(address);
    return it == by_address_.end() ? std::nullopt : std::optional<PeerId>(it->second);
  }
  PeerId add(std::unique_ptr<Peer> p) {
    const uint32_t slot = *slots_.take();  // unbounded: always a slot
    Slot& s = slots_[slot];
    s.epoch++;
    const PeerId id = static_cast<PeerId>(s.epoch) << 32 | slot;
    by_address_.emplace(p->address, id);
    s.peer = std::move(p);
    return id;
  }
  // `id` is unknown from here on (its peer stays until release()).
  void forget(PeerId id) { slots_[static_cast<uint32_t>(id)].epoch++; }
  // Frees a forgotten peer's slot and its record.
  void release(PeerId id) {
    Slot& s = slots_[static_cast<uint32_t>(id)];
    by_address_.erase(s.peer->address);
    s.peer.reset();
    slots_.give(static_cast<uint32_t>(id));
  }
  template <class F>
  void for_each(F&& f) {
    for (uint32_t i = 0; i < slots_.size(); i++)
      if (slots_[i].peer) f(*slots_[i].peer);
  }

 private:
  struct Slot {
    uint32_t epoch = 0;
    std::unique_ptr<Peer> peer;
  };
  util::SlotMap<Slot> slots_;
  std::unordered_map<std::string, PeerId> by_address_;
};

// A domain's own endpoint: the segment peers open, its region slots, and the inboxes it reads.
class OwnEndpoint {
 public:
  OwnEndpoint(std::string_view provider, EndpointKind kind, size_t max_message_size)
      : provider_(provider) {
    ShmSegment::remove_stale();
    Layout layout(max_message_size);
    shm_ = ShmSegment::create_endpoint(layout.total);
    Endpoint::format(shm_.data(), shm_.nonce(), static_cast<uint32_t>(getpid()), max_message_size,
                     kind);
    inbox_ = Endpoint(shm_.data());
    scope_ = shm::host_scope();
    address_ = shm::endpoint_address(scope_, shm_.name());
    shm::LocalEndpoints::add(shm_.nonce());
  }
  ~OwnEndpoint() { close(); }
  OwnEndpoint(const OwnEndpoint&) = delete;
  OwnEndpoint& operator=(const OwnEndpoint&) = delete;

  // Peers' new posts fail at once from here on.
  void close() {
    if (closed_) return;
    closed_ = true;
    inbox_.header().closed.store(1, std::memory_order_release);
    shm::LocalEndpoints::remove(shm_.nonce());
  }

  const std::string& address() const { return address_; }
  const std::string& scope() const { return scope_; }
  uint64_t nonce() const { return shm_.nonce(); }
  Endpoint& inbox() { return inbox_; }
  RegionEntry& region(uint32_t slot) { return inbox_.region(slot); }

  uint32_t take_slot() {
    if (auto slot = free_slots_.take()) return *slot;
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("{}: all {} exported regions are in use", provider_, kMaxRegions));
  }

  // After revoke() of the region in `slot`: waits until no writer holds it, calling `progress`
  // meanwhile (our own copies into ourselves may hold it until they complete). The slot is
  // reused only when they all let go; a writer that died holding it retires it.
  template <class Progress>
  void retire(uint32_t slot, std::chrono::milliseconds timeout, Progress&& progress) {
    if (wait_for_writers(slot, std::chrono::steady_clock::now() + timeout, timeout, progress))
      free_slots_.give(slot);
  }

  // Revokes every region still published and waits for their writers (one deadline for all):
  // the memory may be freed once the domain is gone.
  template <class Progress>
  void revoke_all(std::chrono::milliseconds timeout, Progress&& progress) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (uint32_t slot = 0; slot < kMaxRegions; slot++) {
      RegionEntry& e = inbox_.region(slot);
      if (e.generation.load(std::memory_order_relaxed) & 1) {
        e.revoke();
        wait_for_writers(slot, deadline, timeout, progress);
      }
    }
  }

  void post_recv(void* buf, size_t len, OpContext* ctx) { recvs_.push_back({buf, len, ctx}); }

  // Moves the domain's own completions (`ready`), then arrived immediates, then messages (into
  // the posted receives, in order), into out; returns how many.
  size_t drain(std::span<Completion> out, std::deque<Completion>& ready) {
    size_t n = 0;
    while (n < out.size() && !ready.empty()) {
      out[n++] = std::move(ready.front());
      ready.pop_front();
    }
    uint32_t imm;
    while (n < out.size() && inbox_.pop_imm(imm)) {
      Completion& c = out[n++];
      c = Completion{};
      c.kind = Completion::Kind::kRemoteImm;
      c.imm = imm;
    }
    while (n < out.size() && !recvs_.empty()) {
      const MsgCellHeader* m = inbox_.peek_msg();
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
        c.error = fmt::format("{}: message of {} bytes dropped: the receive buffers hold {}",
                              provider_, m->len, r.len);
      }
      inbox_.pop_msg();
    }
    return n;
  }

 private:
  struct PostedRecv {
    void* buf;
    size_t len;
    OpContext* ctx;
  };

  template <class Progress>
  bool wait_for_writers(uint32_t slot, std::chrono::steady_clock::time_point deadline,
                        std::chrono::milliseconds timeout, Progress& progress) {
    RegionEntry& e = inbox_.region(slot);
    while (e.has_writers()) {
      progress();
      if (std::chrono::steady_clock::now() > deadline) {
        log::error(
            "{}: region {} is still held by a writer after waiting up to {} ms "
            "(EngineConfig::transfer_timeout) since its deregistration: a writer process "
            "that died while copying? Carrying on; the slot is retired",
            provider_, slot, timeout.count());
        return false;
      }
      std::this_thread::yield();
    }
    return true;
  }

  std::string provider_;
  ShmSegment shm_;
  Endpoint inbox_;
  util::FreeSlots free_slots_{kMaxRegions};
  std::string scope_;
  std::string address_;
  bool closed_ = false;
  std::deque<PostedRecv> recvs_;
};

// Immediates of a completed WRITE or batch that did not all fit into the peer's inbox yet: the
// rest goes on a later poll, and ctx completes once they are all in.
struct HeldImms {
  OpContext* ctx;
  PeerId peer;
  std::vector<uint32_t> imms;
  size_t next = 0;  // the first immediate not delivered yet
};

// Pushes up to n immediates into `inbox` (all at once where it has room); how many went in.
inline size_t push_imms(Endpoint& inbox, const uint32_t* imms, size_t n) {
  size_t done = 0;
  while (done < n) {
    const size_t k = inbox.push_imms(imms + done, n - done);
    if (k == 0) break;
    done += k;
  }
  return done;
}

// Pushes what is left of h's immediates; true, with h.ctx's completion queued, once they are all
// in; false when the inbox filled up first.
inline bool push_held(Endpoint& inbox, HeldImms& h, std::deque<Completion>& ready) {
  h.next += push_imms(inbox, h.imms.data() + h.next, h.imms.size() - h.next);
  if (h.next < h.imms.size()) return false;
  ready.push_back(local_completion(h.ctx));
  return true;
}

// An operation for a lost peer completes at once with peer_lost (true); false: carry on.
inline bool report_if_lost(PeerEndpoint& peer, std::string_view provider, OpContext* ctx,
                           std::deque<Completion>& ready) {
  if (!peer.lost && peer.inbox.closed()) peer.lost = true;
  if (!peer.lost) return false;
  ready.push_back(lost_completion(ctx, provider));
  return true;
}

// post_send into a peer's message inbox: completes at once (the bytes are in its slot), kRetry
// while the inbox is full, kFailed (why in last_error) for an unknown peer or a message larger
// than its slots; a lost peer's completes with peer_lost.
template <class Peer>
PostResult post_message(PeerSlots<Peer>& peers, PeerId id, std::string_view provider,
                        const void* buf, size_t len, OpContext* ctx, std::deque<Completion>& ready,
                        std::string& last_error) {
  Peer* peer = peers.live(id);
  if (!peer) {
    last_error = fmt::format("{}: unknown or removed peer", provider);
    return PostResult::kFailed;
  }
  if (report_if_lost(*peer, provider, ctx, ready)) return PostResult::kPosted;
  if (len > peer->inbox.msg_capacity()) {
    last_error = fmt::format(
        "{}: message of {} bytes exceeds the peer's slots of {} bytes "
        "(its EngineConfig::max_message_size)",
        provider, len, peer->inbox.msg_capacity());
    return PostResult::kFailed;
  }
  if (!peer->inbox.push_msg(buf, len)) return PostResult::kRetry;
  ready.push_back(local_completion(ctx));
  return PostResult::kPosted;
}

// About every 100 ms (call it every poll): which peers' processes have ended (one flock test each).
class PeerWatch {
 public:
  template <class Peer>
  void check(PeerSlots<Peer>& peers, std::string_view provider) {
    if ((++polls_ & 1023) != 0) return;
    auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    peers.for_each([&](Peer& p) {
      if (!p.lost && (p.inbox.closed() || !p.shm.owner_alive())) {
        p.lost = true;
        log::info("{}: peer {} has ended", provider, p.address);
      }
    });
  }

 private:
  uint32_t polls_ = 0;
  std::chrono::steady_clock::time_point last_{};
};

// What differs between the local domains' capabilities; LocalDomain fills in the rest.
struct LocalCaps {
  bool gpu_memory = false;
  size_t max_in_flight = 0;
  size_t max_write_batch = 0;
};

// The Domain glue of a local domain: its name and caps, its own endpoint (address, receives, the
// completions poll() drains), its regions' records, its peers (insert_peer, messages, the liveness
// sweep), immediates held back by a full inbox, and the checks every WRITE starts with. A local
// domain derives from it with its Peer (a PeerEndpoint) and Region (its record of a registration,
// the region's descriptor) and adds how it copies: what a registration takes (register_region,
// deregister_region), WRITEs and batches, remove_peer, and progress(), what poll() moves first.
template <class Peer, class Region>
class LocalDomain : public Domain {
 public:
  const std::string& provider_name() const final { return name_; }
  const std::string& address() const final { return own_.address(); }
  const DomainCaps& caps() const final { return caps_; }
  void* scratch_desc() const final { return nullptr; }
  void* scratch_buffer() const final { return const_cast<uint8_t*>(scratch_); }
  const std::string& last_error() const final { return last_error_; }

  DomainRegion register_memory(void* ptr, size_t len, Device device) final {
    auto region = std::make_unique<Region>();
    DomainRegion r = register_region(*region, ptr, len, device);
    r.desc = region.get();
    r.provider = region.release();
    return r;
  }

  void deregister_memory(DomainRegion& r) final {
    auto* region = static_cast<Region*>(r.provider);
    if (!region) return;
    deregister_region(*region);
    delete region;
    r = {};
  }

  // Throws kUnsupported whenever the peer cannot be reached through this domain (another host
  // scope, a segment this process cannot see or that has no live owner, another kind or format,
  // or what admit_peer refuses): the engine then uses its NICs for that peer.
  PeerId insert_peer(const std::string& address) final {
    if (auto id = peers_.find(address)) return *id;
    auto p = std::make_unique<Peer>();
    open_peer(*p, name_, kind_, own_.scope(), address);
    admit_peer(*p);
    return peers_.add(std::move(p));
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void*, OpContext* ctx) final {
    return post_message(peers_, peer, name_, buf, len, ctx, ready_, last_error_);
  }

  PostResult post_recv(void* buf, size_t len, void*, OpContext* ctx) final {
    own_.post_recv(buf, len, ctx);
    return PostResult::kPosted;
  }

  size_t poll(std::span<Completion> out) final {
    watch_.check(peers_, name_);
    progress();
    deliver_held_imms();
    return own_.drain(out, ready_);
  }

 protected:
  // Caps both share: a WRITE bounded only by its destination region; nothing inline; no link of
  // its own; work and immediates that move at poll(); registration on the worker, like every call.
  LocalDomain(std::string name, EndpointKind kind, const EngineConfig& config, LocalCaps local)
      : name_(std::move(name)),
        kind_(kind),
        caps_{.nic_name = name_,
              .gpu_memory = local.gpu_memory,
              .max_message = SIZE_MAX,
              .inject_size = 0,
              .link_gbps = 0.0,
              .manual_progress = true,
              .concurrent_registration = false,
              .max_in_flight = local.max_in_flight,
              .max_write_batch = local.max_write_batch},
        drain_timeout_(config.transfer_timeout),
        own_(name_, kind, config.max_message_size) {}

  // Fills a new region's record; what register_memory returns, but for its descriptor and handle
  // (the record). Undone by deregister_region, which must let the memory go when it returns.
  virtual DomainRegion register_region(Region& region, void* ptr, size_t len, Device device) = 0;
  virtual void deregister_region(Region& region) = 0;
  // A newly opened peer, before it is added: throw kUnsupported to refuse it.
  virtual void admit_peer(Peer&) {}
  // poll()'s work before the held immediates and the endpoint's completions: copies to hand on,
  // copies that completed.
  virtual void progress() = 0;

  PostResult refuse(std::string why) {
    last_error_ = std::move(why);
    return PostResult::kFailed;
  }

  // The peer a WRITE to `id` goes to; null with `result` set where it goes nowhere: kFailed for
  // an unknown or removed peer, kPosted for a lost one (ctx completes with peer_lost).
  Peer* writable_peer(PeerId id, OpContext* ctx, PostResult& result) {
    Peer* peer = peers_.live(id);
    if (!peer) {
      result = refuse(fmt::format("{}: unknown or removed peer", name_));
      return nullptr;
    }
    result = PostResult::kPosted;
    return report_if_lost(*peer, name_, ctx, ready_) ? nullptr : peer;
  }

  // The checks a write batch starts with: at most caps().max_write_batch WRITEs (else kFailed),
  // an empty batch completes at once (kPosted), then writable_peer of the first WRITE's peer.
  Peer* batch_peer(std::span<const WriteOp> ops, OpContext* ctx, PostResult& result) {
    if (ops.size() > caps_.max_write_batch) {
      result =
          refuse(fmt::format("{}: a write batch of {} WRITEs exceeds caps().max_write_batch = {}",
                             name_, ops.size(), caps_.max_write_batch));
      return nullptr;
    }
    if (ops.empty()) {
      ready_.push_back(local_completion(ctx));
      result = PostResult::kPosted;
      return nullptr;
    }
    return writable_peer(ops[0].peer, ctx, result);
  }

  // Publishes a region in a free slot of our table (`slot`, kResourceExhausted where there is
  // none); its remote key, the slot and the generation it was published at (odd: published).
  uint64_t publish(uint32_t& slot, const RegionFields& f) {
    slot = own_.take_slot();
    return (static_cast<uint64_t>(slot) << 32) | own_.region(slot).publish(f);
  }

  // Revokes the region in `slot`: no writer starts a copy into it from now on, and those copying
  // are waited for (`progress` called meanwhile), so once this returns the memory may be freed or
  // reused.
  template <class Progress>
  void unpublish(uint32_t slot, Progress&& progress) {
    own_.region(slot).revoke();
    own_.retire(slot, drain_timeout_, progress);
  }

  // A remote key's slot and generation; false (last_error_) when it cannot be one of ours.
  bool split_key(uint64_t rkey, uint32_t& slot, uint32_t& generation) {
    slot = static_cast<uint32_t>(rkey >> 32);
    generation = static_cast<uint32_t>(rkey);
    if (slot < kMaxRegions && (generation & 1) != 0) return true;
    last_error_ = fmt::format("{}: invalid remote key {:#x}", name_, rkey);
    return false;
  }

  // The peer whose inbox an operation's immediates go to, or null with the operation's error
  // completion queued: removed (`what` delivered too late), or lost (its inbox has no reader).
  Peer* receiving_peer(PeerId id, OpContext* ctx, std::string_view what) {
    Peer* peer = peers_.live(id);
    if (!peer) {
      ready_.push_back(error_completion(
          ctx, fmt::format("{}: the peer was removed before {} delivered", name_, what)));
      return nullptr;
    }
    if (report_if_lost(*peer, name_, ctx, ready_)) return nullptr;
    return peer;
  }

  // Delivers what is left of h's immediates (all at once where the inbox has room) and completes
  // h once they are all in; false when the inbox filled up first.
  bool deliver(HeldImms& h) {
    Peer* peer = receiving_peer(h.peer, h.ctx, "the immediates were");
    return !peer || push_held(peer->inbox, h, ready_);
  }

  // Held immediates, in order, until an inbox is full.
  void deliver_held_imms() {
    while (!held_imms_.empty() && deliver(held_imms_.front())) held_imms_.pop_front();
  }

  const std::string name_;
  const EndpointKind kind_;
  const DomainCaps caps_;
  const std::chrono::milliseconds drain_timeout_;  // how long deregistration waits for writers
  OwnEndpoint own_;
  PeerSlots<Peer> peers_;
  PeerWatch watch_;
  std::string last_error_;
  std::deque<HeldImms> held_imms_;  // completed WRITEs and batches whose peer's inbox was full
  std::deque<Completion> ready_;    // completions for the next poll()
  uint8_t scratch_[64] = {};
};

}  // namespace fabric::ipc
