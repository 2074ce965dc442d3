// One kernel launch that performs many independent copies (the pages of a paged write): a copy
// call per 64 KiB page costs ~6 us on an H200 (11 GB/s); one gather launch moves ~1.8 TB/s.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fabric::cuda {

struct CopyDesc {
  const void* src;
  void* dst;
  uint64_t len;
};

// `descs` must be readable by the device (pinned mapped host memory) until the launch completes.
// Any lengths and alignments; as many blocks as the device keeps resident (at most one per copy).
cudaError_t launch_gather_copy(const CopyDesc* descs, uint32_t count, int sm_count,
                               cudaStream_t stream);

// A gather launch fed while it runs (cuda_ipc's post_write_batch): it is launched before the first
// descriptor is written; the host then writes descriptors and publishes, every few, how many it
// has written in `feed` (release order), with kFeedClosed set once no more come. Each publication
// carries the batch's sequence number (the high 32 bits), so a word left from an earlier batch of
// the same descriptor block is never taken for this one's. The copying blocks read the feed
// through `mirror` (device memory): a block that needs more than the mirror says takes the
// mirror's lock, reads the host word once and updates the mirror, while the others wait on the
// mirror; so the host's cache line has one reader at a time, not one per block. The GPU copies
// while the host is still building the batch, and one launch serves the whole batch. `feed` and
// `descs` in pinned, device-mapped host memory; at most max_count descriptors. A block that sees
// nothing new for kFeedWaitNs (a host that never closes: a bug) stops and sets gave_up to the
// batch's sequence number, which fails the batch: it never hangs the GPU and never reports
// uncopied pages as done.
struct alignas(64) CopyFeed {
  uint64_t published = 0;  // seq << 32 | kFeedClosed? | descriptors written
  uint32_t gave_up = 0;    // the GPU's: the sequence number of a batch it stopped waiting for
};
struct FeedMirror {  // device memory, zeroed once
  uint64_t word = 0;
  uint32_t busy = 0;
  uint32_t pad = 0;
};
inline constexpr uint64_t kFeedClosed = 1u << 31;
inline constexpr uint64_t kFeedWaitNs = 10'000'000'000ull;
inline uint64_t feed_word(uint32_t seq, uint32_t written, bool closed) {
  return (uint64_t{seq} << 32) | (closed ? kFeedClosed : 0) | written;
}
cudaError_t launch_fed_gather_copy(const CopyDesc* descs, CopyFeed* feed, FeedMirror* mirror, uint32_t seq,
                                   uint32_t max_count, int sm_count, cudaStream_t stream);

}  // namespace fabric::cuda
