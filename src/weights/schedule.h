// What every rank of a weight update derives from the UpdatePlan and the window, once: which unit
// goes into which staging slot, the WRITEs of the gather and of the send with their offsets moved
// into the slots, who contributes to each unit, and which WRITEs wait for which unit. Both sides
// build the same Schedule, so senders and receivers agree on counts without talking.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fabric/transfer_engine.h"
#include "fabric/weights/plan.h"

namespace fabric::weights::detail {

// The sender's or receiver's immediate range: held and wide enough for update_imm, or
// kInvalidArgument naming `who`.
ImmReservation& checked_imms(ImmReservation* imms, const char* who);

inline constexpr uint32_t kNoUnit = UINT32_MAX;

struct ScheduledWrite {
  uint32_t src_rank = 0, dst_rank = 0;
  uint64_t src_offset = 0, dst_offset = 0, len = 0;
  uint32_t unit = kNoUnit;  // the source's unit (send: it waits for the unit's quantizing) or
                            // the destination's (gather: it fills that unit's slot)
};

// One unit a training rank quantizes: the plan's task with its offsets in the rank's slots.
struct ScheduledUnit {
  QuantizeTask task;  // in_offset (when gathered), out_offset, scale_offset moved into the slot
  std::vector<Copy> local_copies{};       // its own part of a gathered unit, dst in the slot
  std::vector<uint32_t> contributors{};   // other ranks whose gather WRITEs fill the slot
  std::vector<uint32_t> gather_writes{};  // indices into Schedule::gather landing in it
  std::vector<uint32_t> send_writes{};    // indices into Schedule::send reading from it
};

struct RankSchedule {
  std::vector<ScheduledUnit> units;  // in the order the rank quantizes them
  uint64_t slot_bytes = 0, in_bytes = 0;  // a slot: the gathered input, then FP8 bytes and scales
  std::vector<uint32_t> gather_out;  // gather WRITEs this rank posts (indices into Schedule::gather)
  std::vector<uint32_t> bf16_out;    // send WRITEs straight from its shards
};

struct Schedule {
  std::shared_ptr<const UpdatePlan> plan;
  uint32_t window = 0;
  std::vector<RankSchedule> ranks;       // per training rank
  std::vector<ScheduledWrite> gather;    // ordered by (src_rank, dst_rank, unit, dst_offset)
  std::vector<ScheduledWrite> send;      // ordered by (src_rank, dst_rank, src_offset)
  uint64_t slot_offset(uint32_t rank, uint32_t unit) const {
    return plan->staging_base[rank] + uint64_t{unit % window} * ranks[rank].slot_bytes;
  }
};

// WRITEs i = 0 .. count-1 of len bytes each, from src_offset + i * src_stride to dst_offset +
// i * dst_stride on dst_rank: one request (a PagedWrites when count > 1), where the schedule had
// `count` WRITEs (a column split's rows, say). Indices into the list it came from: [first, +count).
struct WriteRun {
  uint32_t dst_rank = 0, count = 1, first = 0;
  uint64_t len = 0, src_offset = 0, src_stride = 0, dst_offset = 0, dst_stride = 0;
};

// The WRITEs writes[idx[k]], in that order, merged into runs: consecutive WRITEs to one rank, of
// one length, whose source and destination both advance by a constant stride. Only WRITEs that
// deliver one immediate each as single WRITEs are merged (single_write_imm_count(len, nics) == 1),
// so a run delivers, one per page, exactly the immediates its WRITEs would have.
std::vector<WriteRun> merge_runs(const std::vector<ScheduledWrite>& writes, const std::vector<uint32_t>& idx,
                                 size_t nics);

// What training rank `rank` submits in a step, as runs (merge_runs over `nics` NICs per GPU); the
// executor posts these and the cost model counts them.
struct UnitRuns {
  uint32_t unit = 0;
  std::vector<WriteRun> runs;
};
struct RankRuns {
  std::vector<std::vector<UnitRuns>> gather_to;  // per quantizer: the units of it this rank fills, in its order
  std::vector<std::vector<WriteRun>> unit_sends;  // per own unit: its FP8 bytes and scales
  std::vector<std::vector<WriteRun>> bf16_to;     // per inference rank: BF16 pieces from the shards
  uint32_t longest = 1;                           // the most pages of any run
  size_t runs() const;                            // requests for WRITEs (credit barriers aside)
};
RankRuns rank_runs(const Schedule& s, uint32_t rank, size_t nics);

// Throws fabric::Error(kInvalidArgument) for a window of 0 or more than 2^16 units on one rank.
Schedule schedule_update(std::shared_ptr<const UpdatePlan> plan, uint32_t window);

}  // namespace fabric::weights::detail
