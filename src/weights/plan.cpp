// The weight-update planner (include/fabric/weights/plan.h): destination pieces cut along every source
// shard boundary into cells, each cell given to the least-loaded source rank that holds it, cells
// of one source merged back into strided copies.
#include "fabric/weights/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <tuple>

#include "fabric/error.h"
#include "plan_support.h"

namespace fabric::weights {

namespace {

using detail::invalid;
using detail::overlapping;
using detail::stride_of;

void check_placement(const Manifest& m, const Placement& p, uint32_t ranks, const char* side) {
  if (p.tensor >= m.tensors.size())
    throw invalid(fmt::format("a {} placement names tensor {} of {}", side, p.tensor, m.tensors.size()));
  const TensorSpec& t = m.tensors[p.tensor];
  if (p.rank >= ranks) throw invalid(fmt::format("a {} placement of {} names rank {} of {}", side, t.name, p.rank, ranks));
  if (p.box.empty() || p.box.r1 > t.rows || p.box.c1 > t.cols)
    throw invalid(fmt::format("{} rank {}: rows [{}, {}) x cols [{}, {}) is empty or outside {} ({} x {})", side,
                              p.rank, p.box.r0, p.box.r1, p.box.c0, p.box.c1, t.name, t.rows, t.cols));
  if (p.row_stride && p.row_stride < p.box.cols() * t.elem_bytes)
    throw invalid(fmt::format("{} rank {}: a row stride of {} bytes is shorter than a row of {} ({} bytes)", side,
                              p.rank, p.row_stride, t.name, p.box.cols() * t.elem_bytes));
}

// Byte intervals [begin, end) of one rank's buffer that a placement occupies: one for packed rows,
// else one per row.
void row_intervals(const Placement& p, const TensorSpec& t, std::vector<std::pair<uint64_t, uint64_t>>& out) {
  const uint64_t stride = stride_of(p, t), len = p.box.cols() * t.elem_bytes;
  if (stride == len) {
    out.emplace_back(p.offset, p.offset + p.box.rows() * len);
    return;
  }
  for (uint64_t i = 0; i < p.box.rows(); i++) out.emplace_back(p.offset + i * stride, p.offset + i * stride + len);
}

}  // namespace

Box intersect(const Box& a, const Box& b) {
  Box r{std::max(a.r0, b.r0), std::min(a.r1, b.r1), std::max(a.c0, b.c0), std::min(a.c1, b.c1)};
  if (r.empty()) return Box{};
  return r;
}

uint64_t Copy::writes() const {
  return rows <= 1 || (src_stride == row_bytes && dst_stride == row_bytes) ? 1 : rows;
}

double Plan::src_max_over_mean() const {
  if (src_bytes.empty()) return 1.0;
  const double total = static_cast<double>(std::accumulate(src_bytes.begin(), src_bytes.end(), uint64_t{0}));
  if (total == 0) return 1.0;
  return static_cast<double>(*std::max_element(src_bytes.begin(), src_bytes.end())) /
         (total / static_cast<double>(src_bytes.size()));
}

Plan plan(const Manifest& m) {
  for (const Placement& p : m.sources) check_placement(m, p, m.src_ranks, "source");
  for (const Placement& p : m.dests) check_placement(m, p, m.dst_ranks, "destination");
  {  // no destination byte may be wanted twice
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> per_rank(m.dst_ranks);
    for (const Placement& p : m.dests) row_intervals(p, m.tensors[p.tensor], per_rank[p.rank]);
    for (uint32_t r = 0; r < m.dst_ranks; r++) {
      std::pair<uint64_t, uint64_t> at;
      if (overlapping(per_rank[r], at))
        throw invalid(fmt::format("destination rank {}: pieces overlap at bytes [{}, {})", r, at.first, at.second));
    }
  }
  std::vector<std::vector<const Placement*>> holders(m.tensors.size());
  for (const Placement& p : m.sources) holders[p.tensor].push_back(&p);

  Plan out;
  out.src_bytes.assign(m.src_ranks, 0);
  out.dst_bytes.assign(m.dst_ranks, 0);
  out.dst_writes.assign(m.dst_ranks, 0);
  for (const Placement& d : m.dests) {
    const TensorSpec& t = m.tensors[d.tensor];
    // Cut the piece along every boundary of the shards that touch it.
    std::set<uint64_t> rows{d.box.r0, d.box.r1}, cols{d.box.c0, d.box.c1};
    std::vector<const Placement*> touching;
    for (const Placement* s : holders[d.tensor]) {
      Box x = intersect(s->box, d.box);
      if (x.empty()) continue;
      touching.push_back(s);
      rows.insert({x.r0, x.r1});
      cols.insert({x.c0, x.c1});
    }
    const std::vector<uint64_t> rv(rows.begin(), rows.end()), cv(cols.begin(), cols.end());
    // Column band by column band, top to bottom: a cell goes to the least-loaded holder (lowest
    // rank on ties), and runs of cells from one holder stay one copy.
    for (size_t ci = 0; ci + 1 < cv.size(); ci++) {
      Copy run;
      const Placement* run_src = nullptr;
      auto flush = [&] {
        if (!run_src) return;
        if (!run.local) {
          out.dst_bytes[run.dst_rank] += run.bytes();
          out.dst_writes[run.dst_rank] += run.writes();
        }
        out.copies.push_back(run);
        run_src = nullptr;
      };
      for (size_t ri = 0; ri + 1 < rv.size(); ri++) {
        const Box cell{rv[ri], rv[ri + 1], cv[ci], cv[ci + 1]};
        const Placement* best = nullptr;
        for (const Placement* s : touching) {
          if (intersect(s->box, cell) != cell) continue;
          if (m.same_ranks && s->rank == d.rank) {  // held where it is needed: a local copy
            best = s;
            break;
          }
          if (!best || out.src_bytes[s->rank] < out.src_bytes[best->rank] ||
              (out.src_bytes[s->rank] == out.src_bytes[best->rank] && s->rank < best->rank))
            best = s;
        }
        if (!best)
          throw invalid(fmt::format("no training rank holds rows [{}, {}) x cols [{}, {}) of {} (destination rank {})",
                                    cell.r0, cell.r1, cell.c0, cell.c1, t.name, d.rank));
        const uint64_t eb = t.elem_bytes, ss = stride_of(*best, t), ds = stride_of(d, t);
        const bool local = m.same_ranks && best->rank == d.rank;
        if (!local) out.src_bytes[best->rank] += cell.rows() * cell.cols() * eb;  // seen by the next choice
        if (run_src == best && run.rows > 0) {  // the next rows of the same holder
          run.rows += cell.rows();
          continue;
        }
        flush();
        run = Copy{.tensor = d.tensor,
                   .src_rank = best->rank,
                   .dst_rank = d.rank,
                   .local = local,
                   .rows = cell.rows(),
                   .row_bytes = cell.cols() * eb,
                   .src_offset = best->offset + (cell.r0 - best->box.r0) * ss + (cell.c0 - best->box.c0) * eb,
                   .src_stride = ss,
                   .dst_offset = d.offset + (cell.r0 - d.box.r0) * ds + (cell.c0 - d.box.c0) * eb,
                   .dst_stride = ds};
        run_src = best;
      }
      flush();
    }
  }
  std::sort(out.copies.begin(), out.copies.end(), [](const Copy& a, const Copy& b) {
    return std::tie(a.src_rank, a.dst_rank, a.tensor, a.dst_offset) <
           std::tie(b.src_rank, b.dst_rank, b.tensor, b.dst_offset);
  });
  return out;
}

std::vector<Write> writes_of(const Plan& p) {
  std::vector<Write> all;
  for (const Copy& c : p.copies) {
    if (c.local) continue;
    if (c.writes() == 1) {
      all.push_back({c.src_rank, c.dst_rank, c.src_offset, c.dst_offset, c.bytes()});
      continue;
    }
    for (uint64_t i = 0; i < c.rows; i++)
      all.push_back({c.src_rank, c.dst_rank, c.src_offset + i * c.src_stride, c.dst_offset + i * c.dst_stride,
                     c.row_bytes});
  }
  std::sort(all.begin(), all.end(), [](const Write& a, const Write& b) {
    return std::tie(a.src_rank, a.dst_rank, a.src_offset) < std::tie(b.src_rank, b.dst_rank, b.src_offset);
  });
  std::vector<Write> out;
  for (const Write& w : all) {
    if (!out.empty()) {
      Write& last = out.back();
      if (last.src_rank == w.src_rank && last.dst_rank == w.dst_rank && last.src_offset + last.len == w.src_offset &&
          last.dst_offset + last.len == w.dst_offset) {
        last.len += w.len;
        continue;
      }
    }
    out.push_back(w);
  }
  return out;
}

std::string check(const Manifest& m, const Plan& p) {
  // Placements by (rank, tensor), for each side.
  using Index = std::map<std::pair<uint32_t, uint32_t>, std::vector<const Placement*>>;
  Index sources, dests;
  for (const Placement& pl : m.sources) sources[{pl.rank, pl.tensor}].push_back(&pl);
  for (const Placement& pl : m.dests) dests[{pl.rank, pl.tensor}].push_back(&pl);
  // What a byte of a rank's buffer holds: (tensor, row, byte of the row), and the placement that
  // says so.
  struct Where {
    std::tuple<uint32_t, uint64_t, uint64_t> at;
    const Placement* in = nullptr;
  };
  auto locate = [&](const Index& side, uint32_t rank, uint64_t at, uint32_t tensor) -> std::optional<Where> {
    auto it = side.find({rank, tensor});
    if (it == side.end()) return std::nullopt;
    for (const Placement* pl : it->second) {
      const TensorSpec& t = m.tensors[pl->tensor];
      const uint64_t stride = stride_of(*pl, t), len = pl->box.cols() * t.elem_bytes;
      if (at < pl->offset) continue;
      const uint64_t i = (at - pl->offset) / stride, within = (at - pl->offset) % stride;
      if (i >= pl->box.rows() || within >= len) continue;
      return Where{{pl->tensor, pl->box.r0 + i, pl->box.c0 * t.elem_bytes + within}, pl};
    }
    return std::nullopt;
  };
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> written(m.dst_ranks);
  for (const Copy& c : p.copies) {
    if (c.src_rank >= m.src_ranks || c.dst_rank >= m.dst_ranks || c.tensor >= m.tensors.size())
      return "a copy names a rank or tensor outside the manifest";
    if (c.rows == 0 || c.row_bytes == 0) return "an empty copy";
    const TensorSpec& t = m.tensors[c.tensor];
    // Row i of the copy must read and land at the same place of the tensor, at both ends of the
    // row. When the first and last rows do and lie in one placement on each side whose stride is
    // the copy's, every row between does too (both sides are affine in i): two rows suffice.
    auto row_ok = [&](uint64_t i, const Placement** from_in, const Placement** to_in) -> std::string {
      const uint64_t s = c.src_offset + i * c.src_stride, d = c.dst_offset + i * c.dst_stride;
      for (uint64_t probe : {uint64_t{0}, c.row_bytes - 1}) {
        auto from = locate(sources, c.src_rank, s + probe, c.tensor);
        auto to = locate(dests, c.dst_rank, d + probe, c.tensor);
        if (!from || !to || from->at != to->at)
          return fmt::format("copy of {} from rank {} to rank {}, row {}: byte {} of the row reads {} and lands at {}",
                             t.name, c.src_rank, c.dst_rank, i, probe,
                             from ? "its tensor" : "outside what the source holds",
                             to ? (from && from->at == to->at ? "the same place" : "another place")
                                : "outside every piece");
        *from_in = from->in;
        *to_in = to->in;
      }
      return "";
    };
    const Placement *f0 = nullptr, *t0 = nullptr, *f1 = nullptr, *t1 = nullptr;
    if (std::string e = row_ok(0, &f0, &t0); !e.empty()) return e;
    if (std::string e = row_ok(c.rows - 1, &f1, &t1); !e.empty()) return e;
    const bool affine = f0 == f1 && t0 == t1 && stride_of(*f0, t) == c.src_stride && stride_of(*t0, t) == c.dst_stride;
    for (uint64_t i = 1; !affine && i + 1 < c.rows; i++)
      if (std::string e = row_ok(i, &f1, &t1); !e.empty()) return e;
    if (c.dst_stride == c.row_bytes) {
      written[c.dst_rank].emplace_back(c.dst_offset, c.dst_offset + c.rows * c.row_bytes);
    } else {
      for (uint64_t i = 0; i < c.rows; i++)
        written[c.dst_rank].emplace_back(c.dst_offset + i * c.dst_stride, c.dst_offset + i * c.dst_stride + c.row_bytes);
    }
  }
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> wanted(m.dst_ranks);
  for (const Placement& pl : m.dests) row_intervals(pl, m.tensors[pl.tensor], wanted[pl.rank]);
  for (uint32_t r = 0; r < m.dst_ranks; r++) {
    std::pair<uint64_t, uint64_t> at;
    if (overlapping(written[r], at)) return fmt::format("destination rank {}: bytes [{}, {}) written twice", r, at.first, at.second);
    uint64_t w = 0, n = 0;
    for (auto& [b, e] : written[r]) w += e - b;
    for (auto& [b, e] : wanted[r]) n += e - b;
    if (w != n) return fmt::format("destination rank {}: {} bytes written of the {} its pieces hold", r, w, n);
  }
  return "";
}

}  // namespace fabric::weights
