// Worker-side state of one transfer: the validated request, its resolved peers, and progress.
// Lives in an object pool; its address is the completion context of its WRITEs.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "shared_state/resolved_target.h"
#include "worker/request.h"

namespace fabric {

struct RegionSlot;

// A peer group as the worker holds it: per member, its route (peer and key per domain), which is
// the WRITE template a group scatter or barrier patches (length, offsets, immediate) and posts.
struct GroupMember {
  ResolvedTarget target;  // holds the member's peer record for the group's lifetime
  MrDesc desc;            // to resolve the owner again after its connection failed
};
struct GroupState {
  std::vector<GroupMember> members;
};

// OpContext::kind: what a completion of the context means to the worker.
enum OpKind : uint32_t { kOpWrite = 1, kOpSend = 2, kOpRecv = 3 };

struct Transfer {
  TransferRequest req;
  const RegionSlot* src = nullptr;
  GroupState* group = nullptr;          // group scatter and barrier: targets are the members'
  std::vector<ResolvedTarget> targets;  // otherwise one per destination (one for single/paged/send)
  uint32_t total_ops = 0;
  uint32_t next_op = 0;       // next WRITE to post
  uint32_t outstanding = 0;   // posted, not completed
  std::array<uint32_t, kMaxDomains> outstanding_on{};  // the same, per domain
  uint32_t batch = 0;         // paged over a batching domain: pages per post (0: one per post)
  uint32_t send_slot = UINT32_MAX;
  bool failed = false;        // stop posting
  bool reported = false;      // on_done has fired
  bool queued = false;        // in the worker's pending list
  bool peer_lost = false;     // its first failure: an operation whose peer's connection is gone
  Status error;
  uint64_t first_post_ns = 0;  // record_post_timings only
  Transfer* prev = nullptr;   // the worker's list of unreported transfers, by deadline
  Transfer* next = nullptr;

  // Stops posting; the first failure is the one reported.
  void fail(Status status) {
    if (!failed) {
      failed = true;
      error = std::move(status);
    }
  }
  // Room for a scatter to a few destinations, made when the pool creates the object.
  void prepare() { targets.reserve(8); }
  // Back to a fresh state for the pool, keeping the targets' capacity (no allocation on reuse).
  // Field by field: a fresh Transfer moved in would cost more than the WRITE it carried.
  void reuse() {
    req.on_done.reset();  // lets go of a callback and what it kept alive
    req.buf = nullptr;
    src = nullptr;
    group = nullptr;
    targets.clear();
    total_ops = next_op = outstanding = 0;
    outstanding_on = {};
    batch = 0;
    send_slot = UINT32_MAX;
    failed = reported = queued = peer_lost = false;
    if (!error.ok()) error = Status{};
    first_post_ns = 0;
    prev = next = nullptr;
  }
};

}  // namespace fabric
