// ImmRegistry: which ranges of an engine's immediate space are reserved, and by whom
// (TransferEngine::reserve_imms). Control path only: a mutex, and a short list.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fabric/imm_range.h"

namespace fabric {

class EngineImpl;

class ImmRegistry {
 public:
  explicit ImmRegistry(EngineImpl* engine) : engine_(engine) {}

  // Throws kInvalidArgument for a bad request or one that overlaps a held range (naming its
  // holder), kResourceExhausted when no block of that size is free.
  std::pair<uint64_t, ImmRange> reserve(const ImmReserveRequest& request);
  void release(uint64_t id);
  // The holder of the range that contains `imm`, if any (lock-free when nothing is reserved).
  std::optional<std::string> holder_of(uint32_t imm) const;
  // The engine, or kShutdown once it is closing (a reservation that outlived it).
  EngineImpl& engine() const;
  void close();  // the engine is going

 private:
  struct Held {
    uint64_t id;
    ImmRange range;
    std::string holder;
  };
  mutable std::mutex mu_;
  std::vector<Held> held_;
  std::atomic<size_t> count_{0};
  uint64_t next_id_ = 1;
  EngineImpl* engine_;
};

}  // namespace fabric
