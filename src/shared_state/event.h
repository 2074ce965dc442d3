// Event: work a worker hands to the callback thread (a finished transfer's callback with its
// status, or a received message with its data). Plain data moved through a lock-free queue.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "fabric/on_done.h"
#include "fabric/transfer_engine.h"
#include "fabric/types.h"

namespace fabric {

struct Event {
  OnDone::Callback done;  // with status
  Status status;
  std::shared_ptr<TransferEngine::RecvCallback> on_recv;  // with data
  std::vector<std::byte>* data = nullptr;  // CallbackThread::take_buffer(); given back after the call
  bool stop = false;
};

}  // namespace fabric
