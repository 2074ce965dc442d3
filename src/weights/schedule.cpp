// schedule_update (schedule.h): the plan's staging ranges folded into `window` slots per rank.
#include "schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "fabric/weights/fp8.h"
#include "fabric/transfer_engine.h"
#include "fabric/weights/update.h"
#include "plan_support.h"

namespace fabric::weights::detail {

ImmReservation& checked_imms(ImmReservation* imms, const char* who) {
  if (!imms || !imms->held())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: no immediate reservation (imms): reserve one of {} bits on the engine "
                            "(reserve_imms) and register this rank's arenas under it",
                            who, kUpdateImmBits));
  if (imms->range().bits < kUpdateImmBits)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: an immediate reservation of {} bits; an update needs {}",
                                                         who, imms->range().bits, kUpdateImmBits));
  return *imms;
}

namespace {

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// A range of the plan's staging and the unit it belongs to.
struct Range {
  uint64_t begin = 0, end = 0;
  uint32_t unit = kNoUnit;
};

// The unit whose range holds `offset`, with its range's end, or kNoUnit.
std::pair<uint32_t, uint64_t> unit_at(const std::vector<Range>& ranges, uint64_t offset) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), offset, [](uint64_t o, const Range& r) { return o < r.begin; });
  if (it == ranges.begin() || offset >= std::prev(it)->end) return {kNoUnit, 0};
  return {std::prev(it)->unit, std::prev(it)->end};
}

// Calls emit(unit, skip, len) for each unit's piece of [offset, offset + len), in order (skip: the
// piece's distance from `offset`), or emit(kNoUnit, 0, len) once when `offset` is in no unit.
// writes_of merges WRITEs contiguous on both sides across tensors too, so a merged WRITE can span
// several units (experts whose FP8 bytes and scales lie back to back in the staging area and at
// the destination alike); each unit's WRITEs are counted apart, so it is split again here. A
// piece that starts in no unit after the first would be a planner bug.
template <typename Emit>
void for_each_unit_piece(const std::vector<Range>& ranges, uint64_t offset, uint64_t len, Emit emit) {
  for (uint64_t skip = 0; skip < len;) {
    const auto [unit, end] = unit_at(ranges, offset + skip);
    if (unit == kNoUnit) {
      if (skip != 0)
        throw invalid(fmt::format("a WRITE of {} bytes at {} leaves its staging range at {}", len, offset, offset + skip));
      emit(kNoUnit, uint64_t{0}, len);
      return;
    }
    const uint64_t piece = std::min(len - skip, end - (offset + skip));
    emit(unit, skip, piece);
    skip += piece;
  }
}

struct RankRanges {
  std::vector<Range> in, out;  // the plan's gathered inputs; FP8 bytes and scales together (sorted)
  std::vector<uint64_t> in_begin, out_begin;  // per unit: where the plan put them
};

}  // namespace

std::vector<WriteRun> merge_runs(const std::vector<ScheduledWrite>& writes, const std::vector<uint32_t>& idx,
                                 size_t nics) {
  std::vector<WriteRun> runs;
  for (uint32_t k = 0; k < idx.size(); k++) {
    const ScheduledWrite& w = writes[idx[k]];
    if (!runs.empty()) {
      WriteRun& r = runs.back();
      const bool one_imm = single_write_imm_count(w.len, nics, false) == 1;
      // The next WRITE of r, if it goes on: the second one fixes the strides.
      if (one_imm && w.dst_rank == r.dst_rank && w.len == r.len && w.src_offset > r.src_offset &&
          w.dst_offset > r.dst_offset && single_write_imm_count(r.len, nics, false) == 1 &&
          (r.count == 1 || (w.src_offset == r.src_offset + r.count * r.src_stride &&
                            w.dst_offset == r.dst_offset + r.count * r.dst_stride))) {
        if (r.count == 1) {
          r.src_stride = w.src_offset - r.src_offset;
          r.dst_stride = w.dst_offset - r.dst_offset;
        }
        r.count++;
        continue;
      }
    }
    runs.push_back({.dst_rank = w.dst_rank, .count = 1, .first = k, .len = w.len, .src_offset = w.src_offset,
                    .dst_offset = w.dst_offset});
  }
  return runs;
}

RankRuns rank_runs(const Schedule& s, uint32_t rank, size_t nics) {
  const RankSchedule& me = s.ranks.at(rank);
  RankRuns out;
  auto runs = [&](const std::vector<ScheduledWrite>& writes, const std::vector<uint32_t>& idx) {
    std::vector<WriteRun> merged = merge_runs(writes, idx, nics);
    for (const WriteRun& r : merged) out.longest = std::max(out.longest, r.count);
    return merged;
  };
  // gather_out is ordered by (quantizer, unit, offset): runs never span units.
  out.gather_to.resize(s.ranks.size());
  for (size_t k = 0; k < me.gather_out.size();) {
    const ScheduledWrite& first = s.gather[me.gather_out[k]];
    std::vector<uint32_t> idx;
    for (; k < me.gather_out.size(); k++) {
      const ScheduledWrite& w = s.gather[me.gather_out[k]];
      if (w.dst_rank != first.dst_rank || w.unit != first.unit) break;
      idx.push_back(me.gather_out[k]);
    }
    out.gather_to[first.dst_rank].push_back({first.unit, runs(s.gather, idx)});
  }
  // send_writes and bf16_out are ordered by (destination, source offset).
  for (const ScheduledUnit& u : me.units) out.unit_sends.push_back(runs(s.send, u.send_writes));
  std::vector<std::vector<uint32_t>> bf16(s.plan->send_manifest.dst_ranks);
  for (uint32_t i : me.bf16_out) bf16[s.send[i].dst_rank].push_back(i);
  for (const std::vector<uint32_t>& idx : bf16) out.bf16_to.push_back(runs(s.send, idx));
  return out;
}

size_t RankRuns::runs() const {
  size_t n = 0;
  for (const auto& units : gather_to)
    for (const UnitRuns& u : units) n += u.runs.size();
  for (const auto& v : unit_sends) n += v.size();
  for (const auto& v : bf16_to) n += v.size();
  return n;
}

Schedule schedule_update(std::shared_ptr<const UpdatePlan> plan, uint32_t window) {
  if (window == 0) throw invalid("the window must hold at least one unit");
  const UpdatePlan& p = *plan;
  const auto& tensors = p.gather_manifest.tensors;
  const uint32_t n = p.gather_manifest.src_ranks;
  Schedule s;
  s.plan = plan;
  s.window = window;
  s.ranks.resize(n);
  std::vector<RankRanges> ranges(n);
  for (const QuantizeTask& q : p.quantize) s.ranks[q.rank].units.push_back({.task = q});

  for (uint32_t r = 0; r < n; r++) {
    RankSchedule& rs = s.ranks[r];
    if (rs.units.size() > kMaxUpdateRanks)
      throw invalid(fmt::format("rank {} quantizes {} units; at most {} fit the immediates", r, rs.units.size(),
                                kMaxUpdateRanks));
    uint64_t in_max = 0, out_max = 0;
    ranges[r].in_begin.assign(rs.units.size(), 0);
    ranges[r].out_begin.assign(rs.units.size(), 0);
    for (uint32_t u = 0; u < rs.units.size(); u++) {
      const QuantizeTask& q = rs.units[u].task;
      const TensorSpec& t = tensors[q.tensor];
      const uint64_t rows = q.r1 - q.r0;
      const uint64_t scale_end = q.scale_offset + fp8::scale_rows(rows) * fp8::scale_cols(t.cols) * sizeof(float);
      if (q.gathered) {
        in_max = std::max(in_max, rows * t.cols * t.elem_bytes);
        ranges[r].in.push_back({q.in_offset, q.in_offset + rows * t.cols * t.elem_bytes, u});
      }
      ranges[r].in_begin[u] = q.in_offset;
      ranges[r].out_begin[u] = q.out_offset;
      out_max = std::max(out_max, scale_end - q.out_offset);
      ranges[r].out.push_back({q.out_offset, scale_end, u});
    }
    rs.in_bytes = round_up(in_max, 64);
    rs.slot_bytes = round_up(rs.in_bytes + out_max, 64);
    for (auto* v : {&ranges[r].in, &ranges[r].out})
      std::sort(v->begin(), v->end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  }
  // Each unit's offsets moved into its slot (after the ranges above were taken from the plan's).
  for (uint32_t r = 0; r < n; r++)
    for (uint32_t u = 0; u < s.ranks[r].units.size(); u++) {
      QuantizeTask& q = s.ranks[r].units[u].task;
      const uint64_t slot = s.slot_offset(r, u);
      if (q.gathered) q.in_offset = slot;
      const uint64_t scale_rel = q.scale_offset - q.out_offset;
      q.out_offset = slot + s.ranks[r].in_bytes;
      q.scale_offset = q.out_offset + scale_rel;
    }

  // Gather WRITEs land in the destination's slot of their unit; local copies likewise.
  for (const Write& w : writes_of(p.gather))
    for_each_unit_piece(ranges[w.dst_rank].in, w.dst_offset, w.len, [&](uint32_t unit, uint64_t skip, uint64_t len) {
      if (unit == kNoUnit)
        throw invalid(fmt::format("a gather WRITE to rank {} at {} lands in no unit", w.dst_rank, w.dst_offset));
      const uint64_t dst = s.slot_offset(w.dst_rank, unit) + (w.dst_offset + skip - ranges[w.dst_rank].in_begin[unit]);
      s.gather.push_back({w.src_rank, w.dst_rank, w.src_offset + skip, dst, len, unit});
    });
  std::sort(s.gather.begin(), s.gather.end(), [](const ScheduledWrite& a, const ScheduledWrite& b) {
    return std::tie(a.src_rank, a.dst_rank, a.unit, a.dst_offset) < std::tie(b.src_rank, b.dst_rank, b.unit, b.dst_offset);
  });
  for (uint32_t i = 0; i < s.gather.size(); i++) {
    const ScheduledWrite& w = s.gather[i];
    ScheduledUnit& u = s.ranks[w.dst_rank].units[w.unit];
    u.gather_writes.push_back(i);
    if (u.contributors.empty() || u.contributors.back() != w.src_rank) u.contributors.push_back(w.src_rank);
    s.ranks[w.src_rank].gather_out.push_back(i);
  }
  for (const Copy& c : p.gather.copies) {
    if (!c.local) continue;
    const uint32_t unit = unit_at(ranges[c.dst_rank].in, c.dst_offset).first;
    if (unit == kNoUnit) throw invalid(fmt::format("a local copy on rank {} at {} lands in no unit", c.dst_rank, c.dst_offset));
    Copy moved = c;
    moved.dst_offset = s.slot_offset(c.dst_rank, unit) + (c.dst_offset - ranges[c.dst_rank].in_begin[unit]);
    s.ranks[c.dst_rank].units[unit].local_copies.push_back(moved);
  }
  // Send WRITEs read a unit's slot (FP8 bytes and scales) or the shards (BF16 tensors).
  for (const Write& w : writes_of(p.send)) {
    if (w.src_offset < p.staging_base[w.src_rank]) {
      s.send.push_back({w.src_rank, w.dst_rank, w.src_offset, w.dst_offset, w.len, kNoUnit});
      continue;
    }
    for_each_unit_piece(ranges[w.src_rank].out, w.src_offset, w.len, [&](uint32_t unit, uint64_t skip, uint64_t len) {
      if (unit == kNoUnit)
        throw invalid(fmt::format("a send WRITE of rank {} at {} reads no unit", w.src_rank, w.src_offset));
      const uint64_t src = s.ranks[w.src_rank].units[unit].task.out_offset +
                           (w.src_offset + skip - ranges[w.src_rank].out_begin[unit]);
      s.send.push_back({w.src_rank, w.dst_rank, src, w.dst_offset + skip, len, unit});
    });
  }
  for (uint32_t i = 0; i < s.send.size(); i++) {
    const ScheduledWrite& w = s.send[i];
    if (w.unit == kNoUnit) s.ranks[w.src_rank].bf16_out.push_back(i);
    else s.ranks[w.src_rank].units[w.unit].send_writes.push_back(i);
  }
  return s;
}

}  // namespace fabric::weights::detail
