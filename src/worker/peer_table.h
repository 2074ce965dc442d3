// PeerTable: a worker's peer records (what its domains hold for one remote worker, shared by every
// route that names it), the routes to remote regions and peer groups built on them, and releasing
// a peer whose connection failed or that the application removed. Worker thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "shared_state/remote_table.h"
#include "util/counter.h"
#include "util/slot_map.h"
#include "worker/domain_group.h"
#include "worker/request.h"
#include "worker/transfer.h"

namespace fabric {

// Hash of an engine address, so peers are looked up by NetAddr without building a key.
struct NetAddrHash {
  size_t operator()(const NetAddr& a) const {
    size_t h = std::hash<std::string>{}(a.local());
    for (size_t i = 0; i < a.nic_count(); i++)
      h = h * 1099511628211ull ^ std::hash<std::string>{}(a.nic(i));
    return h;
  }
};

// One peer's counters as metrics_text shows them (records of the same address summed).
struct PeerMetrics {
  std::string peer;  // metrics_peer_label
  uint64_t writes = 0, bytes = 0, sends = 0, errors = 0, in_flight = 0;
};

class PeerTable {
 public:
  // `worker`: this worker's index, i.e. its route in each RemoteTable slot.
  PeerTable(DomainGroup& domains, RemoteTable& remotes, size_t worker)
      : domains_(domains), remotes_(remotes), worker_(worker) {}

  // The route to a peer through every domain: its live record's, or the peer inserted into
  // every domain under a new record.
  ResolvedTarget resolve(const NetAddr& peer);
  // The route to one destination region: the local domain where both ends offer it, else NICs.
  ResolvedTarget route(const MrDesc& dst);
  // Destination i of a scatter or barrier, or the one destination of the other kinds (not for
  // group kinds: their targets are the group's). Throws (kNotFound, kCancelled) when none.
  ResolvedTarget target_of(const TransferRequest& q, size_t destination);
  // An interned remote region's route in this worker (it holds the owner's peer record), set from
  // the slot's descriptor while the engine interns it / dropped once the engine made it stale.
  void attach_remote(uint32_t slot);
  void detach_remote(uint32_t slot);
  // A peer group of interned regions; returns its id. group(): nullptr for an unknown id.
  uint32_t add_group(std::span<const RemoteMr> members);
  GroupState* group(uint32_t id) { return id < groups_.size() ? groups_[id].get() : nullptr; }
  // The peer (one worker of it) is gone for good: the domains forget it, transfers still naming
  // it fail with kCancelled at their next post; returns the interned regions that route to it.
  std::vector<RemoteMr> remove_peer(const NetAddr& peer);
  size_t peer_count() const { return index_.size(); }
  // Every record in use, summed per peer label. Peer records failed so far: any thread.
  std::vector<PeerMetrics> metrics() const;
  const util::Counter& peers_lost() const { return peers_lost_; }

  // A transfer's route whose record is not live: false when the transfer failed (removed peer,
  // or no route any more), true when it may post (the route was resolved again if need be).
  bool usable(Transfer& t, ResolvedTarget& target, uint32_t op);
  // An operation to the peer failed in a way that says its connection is gone (or a transfer to
  // it timed out): it is released once nothing of it is in flight.
  void peer_failed(uint32_t r);

  // Per operation and per transfer (inline: every WRITE passes here).
  bool live(uint32_t r) const { return records_[r].state == State::kLive; }
  void hold(uint32_t r) { records_[r].holders++; }
  void unhold(uint32_t r) {
    PeerRecord& p = records_[r];
    if (p.holders > 0) p.holders--;
    if (p.state != State::kLive) maybe_free(r);  // live: nothing to free
  }
  void posted(uint32_t r) { records_[r].outstanding++; }
  // What completed on record r (successful WRITEs and bytes, SENDs; failed operations).
  void count_writes(uint32_t r, uint64_t writes, uint64_t bytes) {
    records_[r].writes += writes;
    records_[r].bytes += bytes;
  }
  void count_send(uint32_t r) { records_[r].sends++; }
  void count_error(uint32_t r) { records_[r].errors++; }
  // An operation to record r completed; `peer_lost`: with an error that says the connection is
  // gone. A failed or released record may have waited for this last completion.
  void completed(uint32_t r, bool peer_lost) {
    PeerRecord& p = records_[r];
    p.outstanding--;
    if (peer_lost) peer_failed(r);
    else if (p.state != State::kLive) settle(r);
  }

 private:
  enum class State : uint8_t { kFree, kLive, kFailed, kReleased, kRemoved };
  struct PeerRecord {
    State state = State::kFree;
    ResolvedTarget target;
    NetAddr addr;
    uint32_t holders = 0;      // transfers, remote slots and groups whose routes name this record
    uint32_t outstanding = 0;  // operations posted to it, not completed
    // Its metrics (worker thread only: metrics_text asks the worker). They go with the record.
    std::string label;
    uint64_t writes = 0, bytes = 0, sends = 0, errors = 0;
  };

  uint32_t new_record(const NetAddr& addr, const ResolvedTarget& t);
  void release(uint32_t r);     // the domains forget the peer (the record may stay held)
  void maybe_free(uint32_t r);  // reused once released, unheld and with nothing in flight
  void settle(uint32_t r);      // after a completion to a record that is not live
  // A live route for an interned region or a group member, resolved again if its peer was
  // released; throws (kNotFound, kCancelled) when there is none.
  const ResolvedTarget& current(const RemoteMr& remote);
  const ResolvedTarget& refresh(ResolvedTarget& held, const MrDesc& desc);
  void rehold(ResolvedTarget& held, const ResolvedTarget& fresh);

  DomainGroup& domains_;
  RemoteTable& remotes_;
  const size_t worker_;
  util::SlotMap<PeerRecord> records_;  // a freed record (kFree) is taken again before it grows
  std::unordered_map<NetAddr, uint32_t, NetAddrHash> index_;  // live and failed records
  std::vector<std::unique_ptr<GroupState>> groups_;
  util::Counter peers_lost_;
};

}  // namespace fabric
