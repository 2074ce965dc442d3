// Weight updates with FP8 destinations (include/fabric/weights/plan.h, plan_update): each unit of rows
// of an FP8 tensor gets one quantizing training rank; the unit is gathered into its staging
// where its own shard does not hold it whole; the FP8 bytes and scales then go out as an ordinary
// plan from the staging areas. Both transfers are plain plan() results, so check() verifies them.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "fabric/error.h"
#include "fabric/weights/fp8.h"
#include "fabric/weights/plan.h"
#include "plan_support.h"

namespace fabric::weights {

namespace {

constexpr uint64_t kB = fp8::kBlock;
constexpr uint64_t kStagingAlign = 4096;

using detail::invalid;
using detail::overlapping;
using detail::stride_of;

uint64_t area(const Box& b) { return b.empty() ? 0 : b.rows() * b.cols(); }
uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
// Rows per unit for a tensor: the option, or the whole tensor.
uint64_t unit_rows(const TensorSpec& t, uint64_t owner_rows) { return owner_rows ? owner_rows : round_up(t.rows, kB); }
Box unit_of(const TensorSpec& t, uint64_t u, uint64_t k) { return Box{k * u, std::min(t.rows, (k + 1) * u), 0, t.cols}; }
// The scale rows (in blocks, all block columns) of rows [r0, r1) of a tensor.
Box scale_box_of(const TensorSpec& t, uint64_t r0, uint64_t r1) {
  return Box{r0 / kB, fp8::scale_rows(r1), 0, fp8::scale_cols(t.cols)};
}

bool aligned(uint64_t lo, uint64_t hi, uint64_t end) { return lo % kB == 0 && (hi % kB == 0 || hi == end); }

// The units of each FP8 tensor that some destination needs, with the bytes they send (FP8 bytes
// of every piece that overlaps the unit, and its scale rows).
std::vector<std::map<uint64_t, uint64_t>> needed_units(const Manifest& m, uint64_t owner_rows) {
  std::vector<std::map<uint64_t, uint64_t>> need(m.tensors.size());
  for (const Placement& d : m.dests) {
    if (d.tensor >= m.tensors.size()) throw invalid(fmt::format("a destination names tensor {}", d.tensor));
    const TensorSpec& t = m.tensors[d.tensor];
    if (!t.fp8_blocks) continue;
    if (!aligned(d.box.r0, d.box.r1, t.rows) || !aligned(d.box.c0, d.box.c1, t.cols))
      throw invalid(fmt::format("destination rank {}: the FP8 piece rows [{}, {}) x cols [{}, {}) of {} is not "
                                "aligned to 128 x 128 blocks",
                                d.rank, d.box.r0, d.box.r1, d.box.c0, d.box.c1, t.name));
    const uint64_t u = unit_rows(t, owner_rows);
    for (uint64_t k = d.box.r0 / u; k * u < d.box.r1; k++) need[d.tensor][k] += area(intersect(d.box, unit_of(t, u, k)));
  }
  for (const Placement& s : m.dest_scales) {
    if (s.tensor >= m.tensors.size() || !m.tensors[s.tensor].fp8_blocks)
      throw invalid(fmt::format("a scale placement of rank {} names tensor {}, which is not an FP8 tensor", s.rank,
                                s.tensor));
    const uint64_t u = unit_rows(m.tensors[s.tensor], owner_rows);
    for (uint64_t k = s.box.r0; k < s.box.r1; k++) need[s.tensor][k * kB / u] += s.box.cols() * sizeof(float);
  }
  return need;
}

}  // namespace

UpdatePlan plan_update(const Manifest& m, const UpdateOptions& options) {
  if (options.owner_rows % kB != 0)
    throw invalid(fmt::format("owner_rows {} is not a multiple of 128", options.owner_rows));
  UpdatePlan up;
  up.owner_rows = options.owner_rows;
  const size_t n = m.tensors.size();
  up.staging_base.assign(m.src_ranks, 0);
  up.staging_bytes.assign(m.src_ranks, 0);
  for (const Placement& s : m.sources) {
    if (s.rank >= m.src_ranks || s.tensor >= n || s.box.empty())
      throw invalid(fmt::format("a source placement names rank {} and tensor {}", s.rank, s.tensor));
    const TensorSpec& t = m.tensors[s.tensor];
    const uint64_t end = s.offset + (s.box.rows() - 1) * stride_of(s, t) + s.box.cols() * t.elem_bytes;
    up.staging_base[s.rank] = std::max(up.staging_base[s.rank], end);
  }
  for (auto& b : up.staging_base) b = round_up(b, kStagingAlign);
  std::vector<uint64_t> cursor = up.staging_base;
  std::vector<std::map<uint64_t, uint64_t>> need = needed_units(m, options.owner_rows);

  up.gather_manifest = Manifest{.tensors = m.tensors, .src_ranks = m.src_ranks, .dst_ranks = m.src_ranks,
                                .sources = m.sources, .dests = {}, .dest_scales = {}, .same_ranks = true};
  for (auto& t : up.gather_manifest.tensors) t.fp8_blocks = false;
  Manifest& send = up.send_manifest;
  send = Manifest{.tensors = m.tensors, .src_ranks = m.src_ranks, .dst_ranks = m.dst_ranks,
                  .sources = {}, .dests = m.dests, .dest_scales = {}, .same_ranks = false};
  std::vector<uint32_t> scale_tensor(n, UINT32_MAX);
  for (uint32_t t = 0; t < n; t++) {
    send.tensors[t].fp8_blocks = false;
    if (!m.tensors[t].fp8_blocks) continue;
    send.tensors[t].elem_bytes = 1;
    scale_tensor[t] = static_cast<uint32_t>(send.tensors.size());
    send.tensors.push_back({m.tensors[t].name + ".scale", fp8::scale_rows(m.tensors[t].rows),
                            fp8::scale_cols(m.tensors[t].cols), sizeof(float), false});
  }
  for (const Placement& s : m.sources)
    if (!m.tensors[s.tensor].fp8_blocks) send.sources.push_back(s);
  for (Placement s : m.dest_scales) {
    s.tensor = scale_tensor[s.tensor];
    send.dests.push_back(s);
  }

  std::vector<std::vector<const Placement*>> holders(n);
  for (const Placement& s : m.sources) holders[s.tensor].push_back(&s);
  std::vector<uint64_t> load(m.src_ranks, 0);  // bytes each rank will send
  for (uint32_t t = 0; t < n; t++) {
    const TensorSpec& spec = m.tensors[t];
    const uint64_t u = unit_rows(spec, options.owner_rows);
    for (const auto& [k, bytes] : need[t]) {
      const Box unit = unit_of(spec, u, k);
      // The owner: whole unit held first, then most of it held, then least to send, then rank.
      const Placement* owner = nullptr;
      uint64_t owner_held = 0;
      for (const Placement* s : holders[t]) {
        const uint64_t held = area(intersect(s->box, unit));
        if (held == 0) continue;
        auto key = [&](const Placement* p, uint64_t h) {
          return std::make_tuple(h != area(unit), h == area(unit) ? 0 : ~h, load[p->rank], p->rank);
        };
        if (!owner || key(s, held) < key(owner, owner_held)) {
          owner = s;
          owner_held = held;
        }
      }
      if (!owner)
        throw invalid(fmt::format("no training rank holds any of rows [{}, {}) of {}", unit.r0, unit.r1, spec.name));
      const uint32_t r = owner->rank;
      QuantizeTask q{.tensor = t, .rank = r, .r0 = unit.r0, .r1 = unit.r1};
      if (owner_held == area(unit)) {
        const uint64_t ss = stride_of(*owner, spec);
        q.in_offset = owner->offset + (unit.r0 - owner->box.r0) * ss;  // the unit spans every column
        q.in_stride = ss;
      } else {
        q.gathered = true;
        q.in_offset = cursor[r];
        q.in_stride = spec.cols * spec.elem_bytes;
        cursor[r] = round_up(cursor[r] + area(unit) * spec.elem_bytes, 64);
        up.gather_manifest.dests.push_back({.tensor = t, .rank = r, .box = unit, .offset = q.in_offset, .row_stride = 0});
      }
      q.out_offset = cursor[r];
      cursor[r] = round_up(cursor[r] + area(unit), 64);
      q.scale_offset = cursor[r];
      const Box scale_box = scale_box_of(spec, unit.r0, unit.r1);
      cursor[r] = round_up(cursor[r] + area(scale_box) * sizeof(float), 64);
      send.sources.push_back({.tensor = t, .rank = r, .box = unit, .offset = q.out_offset, .row_stride = 0});
      send.sources.push_back({.tensor = scale_tensor[t], .rank = r, .box = scale_box, .offset = q.scale_offset,
                              .row_stride = 0});
      load[r] += bytes;
      up.quantize.push_back(q);
    }
  }
  for (uint32_t r = 0; r < m.src_ranks; r++) up.staging_bytes[r] = cursor[r] - up.staging_base[r];
  std::sort(up.quantize.begin(), up.quantize.end(), [](const QuantizeTask& a, const QuantizeTask& b) {
    return std::tie(a.rank, a.tensor, a.r0) < std::tie(b.rank, b.tensor, b.r0);
  });
  up.gather = plan(up.gather_manifest);
  up.send = plan(send);
  return up;
}

std::string check_update(const Manifest& m, const UpdatePlan& p) {
  if (std::string e = check(p.gather_manifest, p.gather); !e.empty()) return "gather: " + e;
  if (std::string e = check(p.send_manifest, p.send); !e.empty()) return "send: " + e;
  // Every needed unit quantized once, from an input that holds the whole unit.
  std::map<std::pair<uint32_t, uint64_t>, int> seen;
  for (const QuantizeTask& q : p.quantize) {
    if (q.tensor >= m.tensors.size() || !m.tensors[q.tensor].fp8_blocks) return "a quantize task names a non-FP8 tensor";
    const TensorSpec& t = m.tensors[q.tensor];
    const uint64_t u = unit_rows(t, p.owner_rows);
    if (q.r0 % u != 0 || q.r1 != std::min(t.rows, q.r0 + u)) return fmt::format("{}: a task is not one unit", t.name);
    seen[{q.tensor, q.r0 / u}]++;
    const Box unit{q.r0, q.r1, 0, t.cols};
    bool input_ok = false;
    const std::vector<Placement>& inputs = q.gathered ? p.gather_manifest.dests : m.sources;
    for (const Placement& s : inputs) {
      if (s.rank != q.rank || s.tensor != q.tensor || intersect(s.box, unit) != unit) continue;
      const uint64_t ss = stride_of(s, t);
      input_ok |= q.in_stride == ss && q.in_offset == s.offset + (q.r0 - s.box.r0) * ss;  // the unit spans every column: c0 is 0
    }
    if (!input_ok)
      return fmt::format("{} rows [{}, {}) on rank {}: the quantizer's input is not the whole unit", t.name, q.r0, q.r1,
                         q.rank);
    const uint64_t scale_bytes = area(scale_box_of(t, q.r0, q.r1)) * sizeof(float);
    if (q.out_offset < p.staging_base[q.rank] ||
        q.scale_offset + scale_bytes > p.staging_base[q.rank] + p.staging_bytes[q.rank])
      return fmt::format("{} rows [{}, {}): output outside rank {}'s staging", t.name, q.r0, q.r1, q.rank);
  }
  for (const auto& [key, count] : seen)
    if (count != 1) return fmt::format("{} unit {} quantized {} times", m.tensors[key.first].name, key.second, count);
  // The staging ranges of a rank's tasks (gathered input, FP8 output, scales) never overlap.
  std::vector<std::vector<detail::Interval>> staging(m.src_ranks);
  for (const QuantizeTask& q : p.quantize) {
    const TensorSpec& t = m.tensors[q.tensor];
    const uint64_t unit = (q.r1 - q.r0) * t.cols;
    if (q.gathered) staging[q.rank].emplace_back(q.in_offset, q.in_offset + unit * t.elem_bytes);
    staging[q.rank].emplace_back(q.out_offset, q.out_offset + unit);
    staging[q.rank].emplace_back(q.scale_offset, q.scale_offset + area(scale_box_of(t, q.r0, q.r1)) * sizeof(float));
  }
  for (uint32_t r = 0; r < m.src_ranks; r++) {
    detail::Interval at;
    if (overlapping(staging[r], at))
      return fmt::format("rank {}: staging bytes from {} are used twice", r, at.first);
  }
  std::vector<std::map<uint64_t, uint64_t>> need = needed_units(m, p.owner_rows);
  for (uint32_t t = 0; t < need.size(); t++)
    for (const auto& [k, bytes] : need[t])
      if (!seen.count({t, k})) return fmt::format("{} unit {} is needed and never quantized", m.tensors[t].name, k);
  return "";
}

}  // namespace fabric::weights
