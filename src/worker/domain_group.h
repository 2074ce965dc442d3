// A worker's domains as one multi-NIC unit: its NICs, then the optional local (cuda_ipc) domain.
// It decides which domain carries each operation of a transfer, keeps the per-domain flow control
// (in-flight limits, back-off after kRetry / kRetryPeer) and the per-domain statistics, and puts
// peers and regions into every domain at once. The worker keeps the loop, the queues, transfers
// and what their completions mean; its PeerTable the peer records. Worker thread only, except
// where said.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "util/counter.h"
#include "worker/sharding.h"
#include "worker/transfer.h"

namespace fabric {

// One domain's counters: written by the worker, read by any thread (nic_stats, metrics_text).
// writes, bytes and sends count operations that completed successfully.
struct NicCounters {
  util::Counter writes, bytes, sends, imms_received, messages_received, errors, imms_dropped,
      messages_dropped;
  util::Counter retries, peer_retries;  // posts answered kRetry / kRetryPeer (then backed off)
  util::Counter in_flight;              // posted, not completed: the in-flight limit's count
};

class DomainGroup {
 public:
  // SENDs go on NIC 0, and so receive buffers and the send buffers are registered there.
  static constexpr size_t kMessageDomain = 0;

  // One region registered with every domain (register_region).
  struct Registration {
    std::array<DomainRegion, kMaxDomains> regions{};  // NICs, then the local domain
    bool on_nics = true;      // false: the NICs refused it (GPU memory), the local domain took it
    std::string nic_refusal;  // the NIC provider's message when on_nics is false
  };

  // Opens the configured NICs, then the local domain where configured; throws what opening
  // raised. Call it on the worker thread once pinned, so NIC state lands on its NUMA node.
  void open(const EngineConfig& config);
  // Closes every domain (their endpoints): nothing refers to the worker's contexts any more.
  void close() { domains_.clear(); }

  // Any thread, once open: fixed for the group's life.
  const std::vector<std::string>& nic_addresses() const { return nic_addresses_; }
  const std::string& provider() const { return provider_; }
  size_t nic_count() const { return nic_count_; }
  // The local domain: its address ("" without one) and its index, after the NICs.
  const std::string& local_address() const { return local_address_; }
  bool has_local() const { return !local_address_.empty(); }
  size_t local_index() const { return nic_count_; }
  size_t domain_count() const { return nic_count_ + (has_local() ? 1 : 0); }
  NicCounters& stats(size_t d) { return stats_[d]; }
  const NicCounters& stats(size_t d) const { return stats_[d]; }
  // The worker's owner gave up on its thread (Worker::stop, wedged inside a provider): from now
  // on no post or poll goes into a provider. The thread may wake inside one while the process
  // exits and libfabric tears the provider down (shm frees its endpoint names at exit while a
  // close would still read them). Any thread.
  void abandon() { abandoned_.store(true, std::memory_order_release); }
  bool abandoned() const { return abandoned_.load(std::memory_order_acquire); }

  // The domains live as long as the group (until close()).
  // Faults a test wrapper injected into domain d, {total, duplicated immediates}; zeros for a
  // domain without one. Any thread. Not part of the Domain contract: the factory reads them.
  std::pair<uint64_t, uint64_t> injected_faults(size_t d) const;
  const DomainCaps& caps(size_t d) const { return domains_[d]->caps(); }

  // Which domain carries operation `op` of a transfer to `target`: SENDs NIC 0; a same-host GPU
  // peer the local domain (sharded writes keep their shard count there, so the receiver's
  // immediate count does not depend on the route); others NIC by NIC, round-robin unless pinned.
  size_t domain_for(const TransferRequest& q, const ResolvedTarget& target, uint32_t op) const {
    if (q.kind == TransferKind::kSend) return kMessageDomain;
    if (target.local) return local_index();
    return nic_for_op(op, nic_count_, q.pinned_nic);
  }
  // Shard `i` of a single write of `len` bytes in `shards` WRITEs (one WRITE: all of it).
  static Shard shard(uint64_t len, uint32_t shards, uint32_t i) {
    return shards == 1 ? Shard{0, len} : single_write_shard(len, shards, i);
  }
  // Largest batch of WRITEs the local domain takes in one post (0 or 1: it does not batch).
  size_t local_write_batch() const { return domains_[local_index()]->caps().max_write_batch; }

  // Whether domain d may take an operation for `peer` now: it is under its in-flight limit and
  // neither it nor that peer of it pushed back in the last polls.
  bool may_post(size_t d, PeerId peer) const {
    if (backoff_[d] > 0 || stats_[d].in_flight.read() >= max_in_flight_[d]) return false;
    for (const PeerBackoff& b : peer_backoff_)  // empty unless a peer pushed back
      if (b.domain == d && b.peer == peer) return false;
    return true;
  }
  // An operation that counted against d's in-flight limit completed.
  void completed(size_t d) { stats_[d].in_flight.sub(); }
  // A timed-out transfer's operations stop counting against the limits: a completion that never
  // comes (a stuck operation) must not take a domain's budget for good.
  void forget_in_flight(const std::array<uint32_t, kMaxDomains>& per_domain) {
    for (size_t d = 0; d < domains_.size(); d++) stats_[d].in_flight.sub(per_domain[d]);
  }

  // Posting: the result is booked before it is returned (kPosted: one more in flight; kRetry:
  // the domain backs off; kRetryPeer: that peer of it does; kFailed: an error counted, the
  // message in last_error(d)). The caller keeps its context on kPosted only.
  // Once abandoned, nothing is posted (kRetry, not booked).
  PostResult post_write(size_t d, const WriteOp& op, OpContext* ctx) {
    if (abandoned()) return PostResult::kRetry;
    return booked(d, op.peer, domains_[d]->post_write(op, ctx));
  }
  PostResult post_write_batch(size_t d, std::span<const WriteOp> ops, OpContext* ctx) {
    if (abandoned()) return PostResult::kRetry;
    return booked(d, ops.front().peer, domains_[d]->post_write_batch(ops, ctx));
  }
  PostResult post_send(size_t d, PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) {
    if (abandoned()) return PostResult::kRetry;
    return booked(d, peer, domains_[d]->post_send(peer, buf, len, desc, ctx));
  }
  // Receive buffers do not count against the limits: the caller offers them again later.
  PostResult post_recv(size_t d, void* buf, size_t len, void* desc, OpContext* ctx) {
    if (abandoned()) return PostResult::kRetry;
    return domains_[d]->post_recv(buf, len, desc, ctx);
  }
  const std::string& last_error(size_t d) const { return domains_[d]->last_error(); }
  // What a zero-byte (immediate-only) WRITE on domain d sends: EFA wants a valid descriptor.
  void* scratch_buffer(size_t d) const { return domains_[d]->scratch_buffer(); }
  void* scratch_desc(size_t d) const { return domains_[d]->scratch_desc(); }

  // Polls every domain once, handing each completion to on_completion(domain, Completion&), and
  // advances the back-offs: a domain that completed something may post again at once. True: any
  // completion. Once abandoned: nothing polled, nothing handed on.
  template <class F>
  bool poll(F&& on_completion) {
    bool any = false;
    if (!peer_backoff_.empty())
      std::erase_if(peer_backoff_, [](PeerBackoff& b) { return --b.polls == 0; });
    for (size_t d = 0; d < domains_.size(); d++) {
      if (abandoned()) return false;
      size_t n = domains_[d]->poll(completions_);
      if (abandoned()) return false;  // it woke inside this poll after its owner gave up
      for (size_t i = 0; i < n; i++) on_completion(d, completions_[i]);
      any |= n > 0;
      if (n > 0) {
        backoff_[d] = 0;
      } else if (backoff_[d] > 0) {
        backoff_[d]--;
      }
    }
    return any;
  }

  // A route to `peer` through every domain: its peer id in each NIC, and in the local domain
  // where both ends have one in the same host scope (`local`); no keys, no record. A NIC that
  // refuses the peer throws, the NICs that took it having forgotten it again.
  ResolvedTarget insert_peer(const NetAddr& peer);
  // Every domain of the route forgets the peer (and its back-off).
  void remove_peer(const ResolvedTarget& route);

  // A region is registered in two parts: the domains whose registration may run beside the
  // worker's posting (DomainCaps::concurrent_registration: verbs) on any thread, the others on
  // the worker thread.
  enum class Part : uint8_t { kBesideWorker, kOnWorker };
  bool registers_beside_worker(size_t d) const { return domains_[d]->caps().concurrent_registration; }
  // Registers a region with the part's domains, into r. A NIC provider that cannot reach GPU
  // memory (kUnsupported) is skipped when the local domain can serve it (r.nic_refusal says why,
  // r.on_nics turns false); any other failure throws, the part's domains that registered it
  // having deregistered it again (the other part's are the caller's to undo).
  void register_region(void* ptr, size_t len, Device device, Part part, Registration& r);
  // The part's domains (or every domain) forget the region.
  void deregister_region(std::array<DomainRegion, kMaxDomains>& regions, Part part);
  void deregister_region(std::array<DomainRegion, kMaxDomains>& regions);
  // One domain only (the message buffers, on kMessageDomain).
  DomainRegion register_on(size_t d, void* ptr, size_t len, Device device) {
    return domains_[d]->register_memory(ptr, len, device);
  }
  void deregister_on(size_t d, DomainRegion& region) { domains_[d]->deregister_memory(region); }

 private:
  // The posted case inline (every WRITE), the others out of line.
  PostResult booked(size_t d, PeerId peer, PostResult result) {
    if (result == PostResult::kPosted) [[likely]] {
      stats_[d].in_flight.add();
    } else {
      book_refusal(d, peer, result);
    }
    return result;
  }
  void book_refusal(size_t d, PeerId peer, PostResult result);

  std::vector<std::unique_ptr<Domain>> domains_;
  std::atomic<bool> abandoned_{false};
  std::vector<std::string> nic_addresses_;
  size_t nic_count_ = 0;
  std::string local_address_;
  std::string provider_;
  std::array<NicCounters, kMaxDomains> stats_;
  std::vector<Completion> completions_;  // one poll's worth, reused
  // Polls to wait before posting again on a domain that answered kRetry (-FI_EAGAIN; 0: post
  // freely). A completion on that domain resets it; the countdown covers back-pressure that no
  // completion of ours will lift (a connection still being set up).
  static constexpr uint32_t kRetryBackoffPolls = 16;
  std::array<uint32_t, kMaxDomains> backoff_{};
  // The same for one peer of one domain (PostResult::kRetryPeer): other peers keep posting.
  struct PeerBackoff {
    uint32_t domain;
    PeerId peer;
    uint32_t polls;
  };
  std::vector<PeerBackoff> peer_backoff_;
  std::array<size_t, kMaxDomains> max_in_flight_{};
};

}  // namespace fabric
