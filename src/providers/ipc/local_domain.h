// What the two local domains (cuda_ipc, host_ipc) share: the domain's own endpoint (its segment,
// its region slots, the inboxes it reads), the peers' endpoints it opens and their table, and the
// completions both make. Each domain adds only how it copies. One worker thread owns a domain:
// nothing here locks.
#pragma once

#include <unistd.h>

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "domain/domain.h"
#include "providers/ipc/ipc_shared.h"
#include "providers/ipc/shm_segment.h"
#include "util/log.h"

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
    auto slot = static_cast<uint32_t>(id);
    if (slot >= slots_.size() || slots_[slot].epoch != static_cast<uint32_t>(id >> 32))
      return nullptr;
    return slots_[slot].peer.get();
  }
  std::optional<PeerId> find(const std::string& address) const {
    auto it = by_address_.find(address);
    return it == by_address_.end() ? std::nullopt : std::optional<PeerId>(it->second);
  }
  PeerId add(std::unique_ptr<Peer> p) {
    uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = static_cast<uint32_t>(slots_.size());
      slots_.emplace_back();
    }
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
    free_.push_back(static_cast<uint32_t>(id));
  }
  template <class F>
  void for_each(F&& f) {
    for (Slot& s : slots_)
      if (s.peer) f(*s.peer);
  }

 private:
  struct Slot {
    uint32_t epoch = 0;
    std::unique_ptr<Peer> peer;
  };
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
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
    for (uint32_t s = kMaxRegions; s-- > 0;) free_slots_.push_back(s);
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
    if (free_slots_.empty())
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("{}: all {} exported regions are in use", provider_, kMaxRegions));
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }

  // After revoke() of the region in `slot`: waits until no writer holds it, calling `progress`
  // meanwhile (our own copies into ourselves may hold it until they complete). The slot is
  // reused only when they all let go; a writer that died holding it retires it.
  template <class Progress>
  void retire(uint32_t slot, std::chrono::milliseconds timeout, Progress&& progress) {
    if (wait_for_writers(slot, std::chrono::steady_clock::now() + timeout, timeout, progress))
      free_slots_.push_back(slot);
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
  std::vector<uint32_t> free_slots_;
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

}  // namespace fabric::ipc
