// Poster: turns a transfer into posted operations, one at a time in order: each WRITE patched from
// its destination's route (or a batch of pages for a batching local domain, or a SEND from a
// registered send slot), with the contexts its completions come back with; and what a posted
// operation counts (post_next) and its completion uncounts (complete), side by side. Worker
// thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "fabric/config.h"
#include "shared_state/mr_table.h"
#include "util/free_slots.h"
#include "util/object_pool.h"
#include "util/round_clock.h"
#include "worker/domain_group.h"
#include "worker/peer_table.h"
#include "worker/request.h"
#include "worker/transfer.h"
#include "worker/worker_metrics.h"

namespace fabric {

// The worker's DomainGroup and PeerTable are passed to each call rather than kept as references:
// the posting path then reaches them as directly as when it was the worker's own code (no pointer
// loaded per WRITE; bench/callgrind_post.sh counts it).
class Poster {
 public:
  Poster(const EngineConfig& config, WorkerMetrics& metrics, util::RoundClock& clock)
      : metrics_(metrics),
        clock_(clock),
        max_message_size_(config.max_message_size),
        send_slots_(config.send_slots),
        transfer_timeout_(config.transfer_timeout),
        record_post_timings_(config.record_post_timings),
        free_send_slots_(config.send_slots) {}

  // Registers the send buffers on the message domain (once it is open); close() deregisters them.
  void open(DomainGroup& domains);
  void close(DomainGroup& domains);

  // Posts the transfer's next operations in order until all are posted or it failed (true), or
  // a domain pushed back or is full (false: the rest waits for its completions).
  bool pump(Transfer& t, DomainGroup& domains, PeerTable& peers) {
    while (t.next_op < t.total_ops && !t.failed) {
      if (!post_next(t, domains, peers)) return false;
    }
    return true;
  }
  // The mirror of post_next's accounting, for an operation that completed (or failed): what
  // posting counted comes off again (the transfer's, the domain's in-flight count, the peer
  // record's and the source region's) and the context goes back to the pool. `peer_lost`: it
  // failed with an error that says the peer's connection is gone. What the completion means to
  // the transfer (its statistics, its failure, its end) is the worker's.
  // Inline, as pump: every completion passes here (out of line, it cost 40 instructions per
  // WRITE in bench/callgrind_post.sh).
  void complete(OpContext* ctx, bool peer_lost, DomainGroup& domains, PeerTable& peers) {
    auto* t = static_cast<Transfer*>(ctx->owner);
    const uint32_t domain = ctx->nic;  // read before the context goes back to the pool
    const uint32_t record = ctx->peer;
    contexts_.release(ctx);
    // Reported with this operation outstanding means timed out: its budget was released then.
    if (!t->reported) domains.completed(domain);
    t->outstanding--;
    t->outstanding_on[domain]--;
    if (t->src) t->src->writes_in_flight--;
    peers.completed(record, peer_lost);
  }
  // A finished SEND gives its slot back.
  void free_send_slot(uint32_t slot) { free_send_slots_.give(slot); }
  std::vector<PostTiming> take_post_timings() { return std::exchange(post_timings_, {}); }

 private:
  bool post_next(Transfer& t, DomainGroup& domains, PeerTable& peers);
  void first_posted(const Transfer& t);  // its submit -> first WRITE histogram
  void record_post_timing(Transfer& t);

  // Only once per transfer (first_posted): no load per WRITE.
  WorkerMetrics& metrics_;
  util::RoundClock& clock_;  // the worker's
  const size_t max_message_size_;
  const size_t send_slots_;
  const std::chrono::milliseconds transfer_timeout_;  // submit time = deadline - timeout
  const bool record_post_timings_;
  util::ObjectPool<OpContext> contexts_{1024};
  std::vector<WriteOp> batch_ops_;  // a batch being posted (capacity kept)
  // Send buffers: a copy of each message waits in its slot until its SEND completes.
  std::vector<uint8_t> send_buffer_;
  DomainRegion send_region_;
  util::FreeSlots free_send_slots_;
  std::vector<PostTiming> post_timings_;
};

}  // namespace fabric
