// Requests from application threads to the worker: plain data moved through a lock-free queue
// (the events going back to the callback thread are in shared_state/event.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <variant>
#include <vector>

#include "fabric/on_done.h"
#include "fabric/transfer_engine.h"
#include "fabric/types.h"

namespace fabric {

using Clock = std::chrono::steady_clock;

enum class TransferKind : uint8_t { kSingle, kPaged, kScatter, kGroupScatter, kBarrier, kGroupBarrier, kSend };

// Scatters and barriers have one destination per WRITE; the other kinds one in all.
inline bool per_destination(TransferKind k) {
  return k == TransferKind::kScatter || k == TransferKind::kBarrier ||
         k == TransferKind::kGroupScatter || k == TransferKind::kGroupBarrier;
}
inline bool grouped(TransferKind k) {
  return k == TransferKind::kGroupScatter || k == TransferKind::kGroupBarrier;
}
inline bool reads_source(TransferKind k) {
  return k != TransferKind::kSend && k != TransferKind::kBarrier &&
         k != TransferKind::kGroupBarrier;
}

// What a request carries beyond its fixed fields, copied from the caller's spans at submit.
// Pooled (RequestBufferPool): vectors keep their capacity, so after warm-up nothing allocates.
struct RequestBuffer {
  std::vector<uint32_t> src_pages, dst_pages;  // paged
  std::vector<ScatterSlice> slices;            // scatter
  std::vector<GroupSlice> group_slices;        // group scatter
  std::vector<RemoteMr> remotes;               // barrier
  std::vector<std::byte> payload;              // send
  NetAddr send_dst;                            // send
};

// Everything a transfer needs, validated at submit time (bounds, NIC counts, handles). Fixed
// size and heap-free: regions and groups are named by handles, variable parts live in `buf`.
struct TransferRequest {
  TransferKind kind = TransferKind::kSingle;
  OnDone on_done;
  bool has_imm = false;
  uint32_t imm = 0;
  int pinned_nic = -1;
  Clock::time_point deadline;

  MrHandle src;
  uint64_t len = 0;  // single: bytes; paged: page length
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint32_t shards = 1;           // single: WRITEs
  RemoteMr dst;                  // single, paged
  uint64_t src_stride = 0, dst_stride = 0;  // paged (offsets: src_offset, dst_offset)
  uint32_t group = UINT32_MAX;   // group scatter, group barrier
  uint32_t count = 0;            // pages, slices or destinations
  RequestBuffer* buf = nullptr;  // owned by the request, returned to its pool when it ends
};

struct ExpectRequest {
  uint32_t imm = 0;
  uint64_t count = 0;
  uint64_t id = 0;
  std::optional<Clock::time_point> deadline;
  OnDone on_done;
};

// Runs on the worker (registration, peer groups, queries); the caller waits for it.
struct ControlRequest {
  std::function<void()> run;
};

struct StopRequest {};

using Request = std::variant<TransferRequest, ExpectRequest, ControlRequest, StopRequest>;

}  // namespace fabric
