// Requests from application threads to the worker and events from the worker to the callback
// thread: plain data moved through lock-free queues.
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

enum class TransferKind : uint8_t { kSingle, kPaged, kScatter, kBarrier, kSend };

// Everything a transfer needs, validated at submit time (bounds, NIC counts, handles).
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
  MrDesc dst;                        // single, paged
  Pages src_pages, dst_pages;        // paged
  std::vector<ScatterDst> scatter;   // scatter
  std::vector<MrDesc> barrier;       // barrier
  NetAddr send_dst;                  // send
  std::vector<std::byte> payload;    // send
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

// Work for the callback thread.
struct Event {
  OnDone::Callback done;  // with status
  Status status;
  std::shared_ptr<TransferEngine::RecvCallback> on_recv;  // with data
  std::vector<std::byte> data;
  bool stop = false;
};

}  // namespace fabric
