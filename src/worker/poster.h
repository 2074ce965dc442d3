// Poster: turns a transfer into posted operations, one at a time in order: each WRITE patched from
// its destination's route (or a batch of pages for a batching local domain, or a SEND from a
// registered send slot), with the contexts its completions come back with. Worker thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "fabric/config.h"
#include "util/object_pool.h"
#include "worker/domain_group.h"
#include "worker/peer_table.h"
#include "worker/request.h"
#include "worker/transfer.h"

namespace fabric {

// The worker's DomainGroup and PeerTable are passed to each call rather than kept as references:
// the posting path then reaches them as directly as when it was the worker's own code (no pointer
// loaded per WRITE; bench/callgrind_post.sh counts it).
class Poster {
 public:
  explicit Poster(const EngineConfig& config)
      : max_message_size_(config.max_message_size),
        send_slots_(config.send_slots),
        transfer_timeout_(config.transfer_timeout),
        record_post_timings_(config.record_post_timings) {}

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
  // A completed (or failed) operation's context goes back to the pool.
  void release(OpContext* ctx) { contexts_.release(ctx); }
  // A finished SEND gives its slot back.
  void free_send_slot(uint32_t slot) { free_send_slots_.push_back(slot); }
  std::vector<PostTiming> take_post_timings() { return std::exchange(post_timings_, {}); }

 private:
  bool post_next(Transfer& t, DomainGroup& domains, PeerTable& peers);
  void record_post_timing(Transfer& t);

  const size_t max_message_size_;
  const size_t send_slots_;
  const std::chrono::milliseconds transfer_timeout_;  // submit time = deadline - timeout
  const bool record_post_timings_;
  util::ObjectPool<OpContext> contexts_{1024};
  std::vector<WriteOp> batch_ops_;  // a batch being posted (capacity kept)
  // Send buffers: a copy of each message waits in its slot until its SEND completes.
  std::vector<uint8_t> send_buffer_;
  DomainRegion send_region_;
  std::vector<uint32_t> free_send_slots_;
  std::vector<PostTiming> post_timings_;
};

}  // namespace fabric
