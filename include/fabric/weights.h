// RL weight updates (issue 17, first part): the static plan of which training rank writes which
// bytes of which tensor into which inference rank's weight buffer. Pure arithmetic, no engine: both
// sides derive from one plan what is written and how many WRITEs each destination receives, so the
// inference side needs no message to know an update is complete.
//
// A tensor is seen as a matrix: rows = its dim 0, columns = the product of its other dims, elements
// of `elem_bytes`. Each side says which rectangle (a Box) of which tensor each of its ranks holds
// or needs, and where in that rank's registered buffer it lives:
//   - training (source) ranks hold shards: FSDP rows of dim 0, TP/EP columns or rows, replicas
//     (HSDP, PP copies of tied weights) simply as several ranks holding the same box;
//   - inference (destination) ranks need pieces: TP splits, experts, and fused tensors (q/k/v,
//     gate/up), which are several tensors' boxes placed side by side in one buffer by giving each
//     piece its offset and a common row stride.
// The planner covers every destination byte exactly once from some holder, choosing among
// replicas to balance the bytes each source rank sends (deterministically), and rejects a manifest
// it cannot cover. Dtype changes (BF16 -> FP8 with block scales) and the executor come next.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fabric::weights {

struct TensorSpec {
  std::string name;
  uint64_t rows = 0, cols = 0;
  uint32_t elem_bytes = 2;
};

// Rows [r0, r1) x columns [c0, c1) of a tensor's matrix.
struct Box {
  uint64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  uint64_t rows() const { return r1 - r0; }
  uint64_t cols() const { return c1 - c0; }
  bool empty() const { return r0 >= r1 || c0 >= c1; }
  bool operator==(const Box&) const = default;
};
Box intersect(const Box& a, const Box& b);

// Where a box lives in a rank's buffer: its row i (of box.cols() elements) at offset + i * row_stride.
struct Placement {
  uint32_t tensor = 0;
  uint32_t rank = 0;
  Box box;
  uint64_t offset = 0;
  uint64_t row_stride = 0;  // bytes; 0: box.cols() * elem_bytes (rows packed)
};

struct Manifest {
  std::vector<TensorSpec> tensors;
  uint32_t src_ranks = 0, dst_ranks = 0;
  std::vector<Placement> sources;  // what each training rank holds
  std::vector<Placement> dests;    // what each inference rank needs
};

// One strided copy: `rows` rows of `row_bytes`, source row i at src_offset + i * src_stride of the
// source rank's buffer, destination row i at dst_offset + i * dst_stride of the destination's. A
// copy whose rows are contiguous on both sides is one WRITE; otherwise one WRITE per row (as
// PagedWrites takes them: page_len = row_bytes).
struct Copy {
  uint32_t tensor = 0, src_rank = 0, dst_rank = 0;
  uint64_t rows = 0, row_bytes = 0;
  uint64_t src_offset = 0, src_stride = 0, dst_offset = 0, dst_stride = 0;
  uint64_t bytes() const { return rows * row_bytes; }
  uint64_t writes() const;  // 1 when both sides are contiguous, else rows
};

struct Plan {
  std::vector<Copy> copies;           // ordered by (src_rank, dst_rank, tensor, dst_offset)
  std::vector<uint64_t> src_bytes;    // per source rank
  std::vector<uint64_t> dst_bytes;    // per destination rank
  std::vector<uint64_t> dst_writes;   // per destination rank: the immediates it counts
  double src_max_over_mean() const;   // balance of the source side (1.0: perfectly even)
};

// Throws fabric::Error(kInvalidArgument) naming the first problem: a placement outside its tensor
// or rank range, a destination byte no source holds, or destination pieces that overlap.
Plan plan(const Manifest& m);

// An independent check of a plan against its manifest: every destination byte written exactly
// once, from a source that holds it, at the right place. Returns "" or what is wrong.
std::string check(const Manifest& m, const Plan& p);

}  // namespace fabric::weights
