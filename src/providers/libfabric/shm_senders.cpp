// The sending side of a shm domain, replaced when a dead peer blocks it (see shm_senders.h).
#include "providers/libfabric/shm_senders.h"

#include <fmt/format.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sys/stat.h>

#include "fabric/error.h"
#include "providers/libfabric/libfabric_core.h"
#include "providers/libfabric/shm_dead_lock.h"
#include "providers/libfabric/shm_names.h"
#include "util/log.h"

namespace fabric {
namespace {

// OpContext::provider_words: the endpoint an operation is outstanding on, its neighbours in that
// endpoint's list and its peer.
constexpr size_t kOwner = 0, kPrev = 1, kNext = 2, kPeer = 3;
static_assert(sizeof(OpContext::provider_words) / sizeof(void*) > kPeer);

void*& word(OpContext* ctx, size_t i) { return ctx->provider_words[i]; }
OpContext* link(OpContext* ctx, size_t i) { return static_cast<OpContext*>(word(ctx, i)); }

}  // namespace

bool shm_endpoint_exists(const std::string& address) {
  struct stat st{};
  return ::stat(("/dev/shm/" + shm_names::file_name(address)).c_str(), &st) == 0;
}

bool shm_process_alive(int pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child its parent has not reaped yet still answers kill(): read its state.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

// One sending endpoint with its own address vector (the peers it has posted to).
struct ShmSenders::Endpoint {
  fid_ep* ep = nullptr;
  fid_av* av = nullptr;
  std::vector<fi_addr_t> addr;        // by PeerId; FI_ADDR_NOTAVAIL until first used here
  std::vector<uint32_t> outstanding;  // by PeerId
  uint64_t total = 0;                 // operations posted here and not yet completed
  uint64_t completions = 0;
  OpContext* head = nullptr;          // those operations, linked through provider_words
  bool closed = false;                // fi_close'd; its operations are reported at cq_drained
  std::chrono::steady_clock::time_point close_at{};
};

ShmSenders::ShmSenders(fid_domain* domain, fid_cq* cq, const fi_info* info)
    : domain_(domain), cq_(cq), info_(fi_dupinfo(info)) {
  if (!info_) throw Error(ErrorCode::kProvider, "fi_dupinfo failed for shm's sending endpoint");
  // Nobody sends to a sending endpoint: its receive queue (and shm's inject pool, sized by it)
  // can be small. Its response queue is sized by tx_attr->size, as the main endpoint's.
  if (info_->rx_attr) info_->rx_attr->size = 16;
  try {
    watch_ = std::make_unique<util::ProcessWatch>();
  } catch (const Error& e) {
    log::warn("shm: {}; dead peers are found only when their WRITEs stall", e.what());
  }
  try {
    current_ = open_endpoint();
  } catch (...) {
    fi_freeinfo(info_);
    throw;
  }
}

ShmSenders::~ShmSenders() {
  for (auto& e : retired_) close_endpoint(*e);
  if (current_) close_endpoint(*current_);
  fi_freeinfo(info_);
}

std::unique_ptr<ShmSenders::Endpoint> ShmSenders::open_endpoint() {
  auto e = std::make_unique<Endpoint>();
  auto fail = [&](const char* call, long rc) {
    close_endpoint(*e);
    throw Error(ErrorCode::kProvider, fi_message(call, rc) + " (shm sending endpoint)");
  };
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  if (long rc = fi_av_open(domain_, &av_attr, &e->av, nullptr)) fail("fi_av_open", rc);
  if (long rc = fi_endpoint(domain_, info_, &e->ep, nullptr)) fail("fi_endpoint", rc);
  if (long rc = fi_ep_bind(e->ep, &cq_->fid, FI_TRANSMIT | FI_RECV)) fail("fi_ep_bind(cq)", rc);
  if (long rc = fi_ep_bind(e->ep, &e->av->fid, 0)) fail("fi_ep_bind(av)", rc);
  // Our own name, so that the process's leftovers are found by its pid (shm_names.h).
  const std::string name = shm_names::next_endpoint_name();
  if (long rc = fi_setname(&e->ep->fid, const_cast<char*>(name.c_str()), name.size() + 1))
    fail("fi_setname", rc);
  if (long rc = fi_enable(e->ep)) fail("fi_enable", rc);
  e->addr.assign(peers_.size(), FI_ADDR_NOTAVAIL);
  e->outstanding.assign(peers_.size(), 0);
  return e;
}

void ShmSenders::close_endpoint(Endpoint& e) {
  if (e.closed) return;
  if (e.ep) fi_close(&e.ep->fid);
  if (e.av) fi_close(&e.av->fid);
  e.ep = nullptr;
  e.av = nullptr;
  e.closed = true;
}

PeerId ShmSenders::insert_peer(const std::string& address) {
  auto it = by_address_.find(address);
  if (it != by_address_.end()) return it->second;
  const int pid = shm_names::pid_of(address);
  if (!shm_process_alive(pid))
    throw Error(ErrorCode::kProvider,
                fmt::format("shm: the peer's process ({}) has exited; its endpoint is a leftover. "
                            "A restarted peer has a new address: fetch it again",
                            pid));
  // A live process whose engine closed has removed its endpoint's file: libfabric 1.17's
  // fi_av_insert would map the missing region and crash, so such a peer is refused here.
  if (!shm_endpoint_exists(address))
    throw Error(ErrorCode::kProvider,
                fmt::format("shm: the peer's endpoint {} no longer exists (its engine was closed); "
                            "a new engine has a new address: fetch it again",
                            shm_names::file_name(address)));
  PeerId id;
  if (free_peers_.empty() && peers_.size() >= util::ProcessWatch::kSlots)
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("shm: more than {} peers at once on one domain (shm itself takes 256)",
                            util::ProcessWatch::kSlots));
  if (!free_peers_.empty()) {
    id = free_peers_.back();
    free_peers_.pop_back();
  } else {
    id = peers_.size();
    peers_.emplace_back();
  }
  peers_[id] = Peer{.address = address, .pid = pid,
                    .keys = ShmKeyBoard::open(pid, shm_names::board_fd_of(address))};
  // A peer killed while it held its region lock would leave our worker spinning in its next
  // post to it: the watch frees that lock when the peer dies (shm_dead_lock.h).
  auto on_exit = [address, pid] { release_dead_owner_lock(address, pid); };
  if (watch_ && !watch_->watch(static_cast<uint32_t>(id), pid, on_exit) &&
      watch_->exited(static_cast<uint32_t>(id))) {
    peers_[id].removed = true;
    free_peers_.push_back(id);
    throw Error(ErrorCode::kProvider, fmt::format("shm: the peer's process ({}) has exited", pid));
  }
  if (address_in(*current_, id) == FI_ADDR_NOTAVAIL) {
    peers_[id].removed = true;
    free_peers_.push_back(id);
    throw Error(ErrorCode::kProvider,
                fmt::format("fi_av_insert of a peer address ({} bytes) failed: is the peer using "
                            "the same provider (shm)?",
                            address.size()));
  }
  by_address_.emplace(address, id);
  return id;
}

fi_addr_t ShmSenders::address_in(Endpoint& e, PeerId peer) {
  if (peer >= e.addr.size()) {
    e.addr.resize(peers_.size(), FI_ADDR_NOTAVAIL);
    e.outstanding.resize(peers_.size(), 0);
  }
  fi_addr_t& a = e.addr[peer];
  if (a == FI_ADDR_NOTAVAIL &&
      fi_av_insert(e.av, peers_[peer].address.data(), 1, &a, 0, nullptr) != 1)
    a = FI_ADDR_NOTAVAIL;
  return a;
}

void ShmSenders::remove_peer(PeerId peer) {
  if (peer >= peers_.size() || peers_[peer].removed) return;
  auto forget = [&](Endpoint& e) {
    if (e.closed || peer >= e.addr.size() || e.addr[peer] == FI_ADDR_NOTAVAIL) return;
    fi_addr_t a = e.addr[peer];
    if (int rc = fi_av_remove(e.av, &a, 1, 0)) log::warn("fi_av_remove failed: {}", fi_strerror(-rc));
    e.addr[peer] = FI_ADDR_NOTAVAIL;
  };
  forget(*current_);
  for (auto& e : retired_) forget(*e);
  by_address_.erase(peers_[peer].address);
  peers_[peer].removed = true;
  maybe_free(peer);
}

void ShmSenders::maybe_free(PeerId peer) {
  Peer& p = peers_[peer];
  if (!p.removed || p.ops > 0) return;
  if (watch_) watch_->unwatch(static_cast<uint32_t>(peer));
  p = Peer{};
  p.removed = true;  // stays refused until reused
  free_peers_.push_back(peer);
}

bool ShmSenders::gone(PeerId peer) {
  Peer& p = peers_[peer];
  if (!p.dead && watch_ && watch_->exited(static_cast<uint32_t>(peer))) p.dead = true;
  return p.dead;
}

PostResult ShmSenders::write(const WriteOp& op, OpContext* ctx, std::string& error) {
  if (gone(op.peer)) {
    error = fmt::format("shm: the peer's process ({}) has exited", peers_[op.peer].pid);
    return PostResult::kFailed;
  }
  // shm would drop it silently (shm_key_board.h).
  if (const auto& keys = peers_[op.peer].keys; keys && !keys->live(op.rkey)) {
    error = fmt::format("shm: the destination region was deregistered by its owner (process {}); "
                        "fetch its new descriptor, or stop writing it before it deregisters",
                        peers_[op.peer].pid);
    return PostResult::kFailed;
  }
  const fi_addr_t a = address_in(*current_, op.peer);
  if (a == FI_ADDR_NOTAVAIL) {
    error = "shm: fi_av_insert failed on the sending endpoint";
    return PostResult::kFailed;
  }
  ssize_t rc = op.has_imm ? fi_writedata(current_->ep, op.src, op.len, op.desc, op.imm, a,
                                         op.remote_addr, op.rkey, ctx)
                          : fi_write(current_->ep, op.src, op.len, op.desc, a, op.remote_addr,
                                     op.rkey, ctx);
  if (rc == 0) {
    track(*current_, ctx, op.peer);
    return PostResult::kPosted;
  }
  if (rc == -FI_EAGAIN) return PostResult::kRetry;
  error = fi_message(op.has_imm ? "fi_writedata" : "fi_write", rc);
  return PostResult::kFailed;
}

PostResult ShmSenders::send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx,
                            std::string& error) {
  if (gone(peer)) {
    error = fmt::format("shm: the peer's process ({}) has exited", peers_[peer].pid);
    return PostResult::kFailed;
  }
  const fi_addr_t a = address_in(*current_, peer);
  if (a == FI_ADDR_NOTAVAIL) {
    error = "shm: fi_av_insert failed on the sending endpoint";
    return PostResult::kFailed;
  }
  ssize_t rc = fi_send(current_->ep, buf, len, desc, a, ctx);
  if (rc == 0) {
    track(*current_, ctx, peer);
    return PostResult::kPosted;
  }
  if (rc == -FI_EAGAIN) return PostResult::kRetry;
  error = fi_message("fi_send", rc);
  return PostResult::kFailed;
}

void ShmSenders::track(Endpoint& e, OpContext* ctx, PeerId peer) {
  word(ctx, kOwner) = &e;
  word(ctx, kPrev) = nullptr;
  word(ctx, kNext) = e.head;
  word(ctx, kPeer) = reinterpret_cast<void*>(static_cast<uintptr_t>(peer));
  if (e.head) word(e.head, kPrev) = ctx;
  e.head = ctx;
  e.total++;
  e.outstanding[peer]++;
  peers_[peer].ops++;
}

void ShmSenders::untrack(OpContext* ctx) {
  auto& e = *static_cast<Endpoint*>(word(ctx, kOwner));
  const auto peer = static_cast<PeerId>(reinterpret_cast<uintptr_t>(word(ctx, kPeer)));
  OpContext* prev = link(ctx, kPrev);
  OpContext* next = link(ctx, kNext);
  if (prev) word(prev, kNext) = next;
  else e.head = next;
  if (next) word(next, kPrev) = prev;
  word(ctx, kOwner) = nullptr;
  e.total--;
  e.outstanding[peer]--;
  peers_[peer].ops--;
  maybe_free(peer);
}

bool ShmSenders::completed(OpContext* ctx) {
  if (!ctx || !word(ctx, kOwner)) return false;
  static_cast<Endpoint*>(word(ctx, kOwner))->completions++;
  untrack(ctx);
  return true;
}

size_t ShmSenders::maintain(std::span<Completion> out) {
  size_t n = 0;
  while (n < out.size() && !lost_.empty()) {
    out[n++] = std::move(lost_.back());
    lost_.pop_back();
  }
  if (retired_.empty() && current_->total == 0) return n;
  if ((++polls_ & 63) != 0) return n;  // the clock, every 64 polls of a busy domain
  const auto now = std::chrono::steady_clock::now();
  if (current_->total == 0 || current_->completions != seen_completions_ ||
      last_progress_ == std::chrono::steady_clock::time_point{}) {
    seen_completions_ = current_->completions;
    last_progress_ = now;
  } else if (now - last_progress_ >= kStallCheck && now - last_check_ >= kStallCheck) {
    // Nothing completed for a while: slow peers, or one that died holding the queue's head.
    last_check_ = now;
    if (check_peers(*current_)) replace_current(now);
  }
  for (auto& e : retired_)
    if (!e->closed && (e->total == 0 || now >= e->close_at)) close_endpoint(*e);
  return n;
}

bool ShmSenders::check_peers(Endpoint& e) {
  bool any = false;
  for (PeerId i = 0; i < e.outstanding.size(); i++) {
    if (e.outstanding[i] == 0) continue;
    Peer& p = peers_[i];
    const bool seen = p.dead;
    if (!gone(i) && !shm_process_alive(p.pid)) p.dead = true;
    if (p.dead && !seen) {
      log::warn("shm: peer process {} died with {} operations of ours outstanding; they and every "
                "later completion of this sending endpoint are lost (libfabric shm completes in "
                "posting order), so a fresh endpoint takes the next posts",
                p.pid, e.outstanding[i]);
      if (!dead_names_.empty()) dead_names_ += ", ";
      dead_names_ += std::to_string(p.pid);
    }
    any |= p.dead;
  }
  return any;
}

void ShmSenders::replace_current(std::chrono::steady_clock::time_point now) {
  std::unique_ptr<Endpoint> fresh;
  try {
    fresh = open_endpoint();
  } catch (const Error& e) {
    log::error("shm: could not open a fresh sending endpoint ({}); retried at the next stall "
               "check", e.what());
    return;
  }
  current_->close_at = now + kRetireGrace;  // what completes before then still counts
  retired_.push_back(std::move(current_));
  current_ = std::move(fresh);
  seen_completions_ = 0;
  last_progress_ = {};
  replacements_++;
}

void ShmSenders::cq_drained() {
  for (size_t i = 0; i < retired_.size();) {
    Endpoint& e = *retired_[i];
    if (!e.closed) {
      i++;
      continue;
    }
    while (OpContext* ctx = e.head) {
      const auto peer = static_cast<PeerId>(reinterpret_cast<uintptr_t>(word(ctx, kPeer)));
      Completion c;
      c.kind = Completion::Kind::kError;
      c.context = ctx;
      c.peer_lost = peers_[peer].dead;
      c.error = c.peer_lost
                    ? fmt::format("shm: the peer's process ({}) died with this operation outstanding",
                                  peers_[peer].pid)
                    : fmt::format("shm: this operation's completion was lost behind a dead peer's "
                                  "(process {}) on the sending endpoint it was posted on, which was "
                                  "replaced (libfabric shm completes in posting order); its data "
                                  "may or may not have landed",
                                  dead_names_);
      untrack(ctx);
      lost_.push_back(std::move(c));
    }
    retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

}  // namespace fabric
