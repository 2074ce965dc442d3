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
// descriptor is written, the host then writes descriptors and publishes how many it has written
// in `published` (release order, every few descriptors), and sets kFeedClosed in it once no more
// come. The GPU copies while the host is still building the batch, and one launch serves the
// whole batch. `feed` and `descs` in pinned, device-mapped host memory; at most max_count
// descriptors. A launch whose feed is never closed gives up after kFeedWaitNs without a new
// descriptor (a host bug; it then leaves the rest uncopied, never hangs the GPU).
struct alignas(64) CopyFeed {
  uint32_t published = 0;
};
inline constexpr uint32_t kFeedClosed = 1u << 31;
inline constexpr uint64_t kFeedWaitNs = 10'000'000'000ull;
cudaError_t launch_fed_gather_copy(const CopyDesc* descs, const CopyFeed* feed, uint32_t max_count, int sm_count,
                                   cudaStream_t stream);

}  // namespace fabric::cuda
