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
// it cannot cover. With FP8 destinations (plan_update) the plan has three steps: training ranks
// gather the row ranges they quantize (only where their own shard does not hold them whole),
// quantize them into a staging area, and write the FP8 bytes and block scales to the inference
// ranks. The executor comes next.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fabric::weights {

struct TensorSpec {
  std::string name;
  uint64_t rows = 0, cols = 0;
  uint32_t elem_bytes = 2;
  // plan_update: the inference side holds this tensor as FP8 e4m3 (1 byte per element, pieces
  // given in elements as usual) with one fp32 scale per 128 x 128 block (Manifest::dest_scales);
  // the training side holds BF16 (elem_bytes 2).
  bool fp8_blocks = false;
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
  std::vector<TensorSpec> tensors{};
  uint32_t src_ranks = 0, dst_ranks = 0;
  std::vector<Placement> sources{};  // what each training rank holds
  std::vector<Placement> dests{};    // what each inference rank needs
  // plan_update: where inference ranks keep the block scales of fp8_blocks tensors; `tensor` names
  // the FP8 tensor, the box is in blocks (rows and columns of the ceil(rows/128) x ceil(cols/128)
  // scale matrix), elements are 4-byte floats.
  std::vector<Placement> dest_scales{};
  // plan(): sources and destinations are the same processes (a gather among training ranks): a
  // cell the destination rank holds itself is copied locally, counted in neither src_bytes nor
  // dst_writes.
  bool same_ranks = false;
};

// One strided copy: `rows` rows of `row_bytes`, source row i at src_offset + i * src_stride of the
// source rank's buffer, destination row i at dst_offset + i * dst_stride of the destination's. A
// copy whose rows are contiguous on both sides is one WRITE; otherwise one WRITE per row (as
// PagedWrites takes them: page_len = row_bytes).
struct Copy {
  uint32_t tensor = 0, src_rank = 0, dst_rank = 0;
  bool local = false;  // same_ranks and src_rank == dst_rank: a memcpy, not a WRITE
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

// A WRITE as the executor posts it: bytes [src_offset, src_offset + len) of the source rank's
// buffer (or address space) to [dst_offset, dst_offset + len) of the destination rank's.
struct Write {
  uint32_t src_rank = 0, dst_rank = 0;
  uint64_t src_offset = 0, dst_offset = 0, len = 0;
};

// The WRITEs of a plan's non-local copies (a strided copy is one per row), with writes that
// continue each other on both sides merged into one (an FP8 tensor and the scales placed right
// after it on both sides go as one WRITE). Ordered by (src_rank, dst_rank, src_offset). Each
// carries one immediate: a destination counts the writes naming it.
std::vector<Write> writes_of(const Plan& p);

// Throws fabric::Error(kInvalidArgument) naming the first problem: a placement outside its tensor
// or rank range, a destination byte no source holds, or destination pieces that overlap.
Plan plan(const Manifest& m);

// An independent check of a plan against its manifest: every destination byte written exactly
// once, from a source that holds it, at the right place. Returns "" or what is wrong.
std::string check(const Manifest& m, const Plan& p);

// ---- updates with FP8 destinations ---------------------------------------------------------

// One unit (UpdateOptions::owner_rows rows, all columns) of an fp8_blocks tensor, quantized by one
// training rank: BF16 rows read at in_offset + i * in_stride of that rank's address space (its own
// shard, or the unit gathered into its staging), FP8 rows written packed at out_offset, the
// unit's scale rows (ceil(rows/128) x ceil(cols/128) floats) packed at scale_offset.
struct QuantizeTask {
  uint32_t tensor = 0, rank = 0;
  uint64_t r0 = 0, r1 = 0;
  uint64_t in_offset = 0, in_stride = 0;
  bool gathered = false;  // the input is a staging range that gather copies fill first
  uint64_t out_offset = 0, scale_offset = 0;
};

// A training rank's address space: its shards at the offsets its source placements give, then
// its staging area from staging_base (gathered BF16 units, then FP8 units and their scales).
struct UpdatePlan {
  uint64_t owner_rows = 0;  // the options' unit (0: whole tensors)
  Manifest gather_manifest;  // training -> training: BF16 units into quantizers' staging
  Plan gather;
  std::vector<QuantizeTask> quantize;  // by (rank, tensor, r0)
  // training -> inference: tensors as in the manifest (fp8_blocks ones with 1-byte elements read
  // from staging), then one scale tensor per fp8_blocks tensor, at index tensors.size() + k.
  Manifest send_manifest;
  Plan send;
  std::vector<uint64_t> staging_base, staging_bytes;  // per training rank
};

struct UpdateOptions {
  // Rows one rank quantizes and sends as a unit, a multiple of 128; 0: the whole tensor. Small
  // units let block-aligned FSDP shards quantize in place with no gather, but every unit is a
  // WRITE per destination (a 2048-row expert over FSDP 16 is 16 units); whole tensors gather
  // 15/16 of each tensor to its owner over the training fabric and post a WRITE per tensor.
  uint64_t owner_rows = 0;
};

// Chooses for each unit an owner among the ranks holding it: one that holds the whole unit if
// any (no gather), the one holding most of it otherwise; among equals the one with the fewest
// bytes to send so far, then the lowest rank. Throws fabric::Error(kInvalidArgument) as plan()
// does, for owner_rows not a multiple of 128, and for an FP8 piece not aligned to 128 x 128 blocks.
UpdatePlan plan_update(const Manifest& m, const UpdateOptions& options = {});

// Checks both halves with check() and that every unit a destination needs is quantized exactly
// once, by a rank its gather (or its own shard) gives the whole unit. "" or what is wrong.
std::string check_update(const Manifest& m, const UpdatePlan& p);

}  // namespace fabric::weights
