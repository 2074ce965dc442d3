// The one thread that runs user callbacks, so that no callback ever runs on (or stalls) a worker.
#pragma once

#include <atomic>
#include <deque>
#include <thread>

#include "fabric/config.h"
#include "shared_state/event.h"
#include "util/mpsc_queue.h"
#include "util/shared_pool.h"

namespace fabric {

class CallbackThread {
 public:
  CallbackThread(size_t capacity, PollMode mode);
  ~CallbackThread();  // runs every queued event, then joins (after stop() was pushed)

  // Called by workers. Never blocks: if the queue is full the event waits in the caller's
  // overflow list (the callback thread may itself be waiting for the worker).
  void push(Event&& event, std::deque<Event>& overflow);
  // Retries a worker's overflow list; returns true when it is empty.
  bool flush(std::deque<Event>& overflow);
  void stop();  // queues the final event; the thread exits after running all before it
  // A buffer for an event's data (a received message), given back once its callback ran: reused,
  // so receiving allocates nothing after warm-up.
  std::vector<std::byte>* take_buffer() { return buffers_.take(); }
  // Adds `count` buffers of `len` bytes' capacity to that pool.
  void prepare_buffers(size_t count, size_t len) {
    std::vector<std::vector<std::byte>*> taken;
    for (size_t i = 0; i < count; i++) {
      taken.push_back(buffers_.fresh());
      taken.back()->reserve(len);
    }
    for (auto* b : taken) buffers_.give(b);
  }
  void join() {  // waits for the thread after stop(); the object itself may then be kept
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run();
  void wake();
  util::MpscQueue<Event> queue_;
  util::SharedPool<std::vector<std::byte>> buffers_;
  // In kAdaptive mode an idle callback thread blocks on `doorbell_` (atomic wait) instead of
  // waking up periodically; producers bump it on every push and notify only while `sleeping_`.
  std::atomic<uint32_t> doorbell_{0};
  std::atomic<bool> sleeping_{false};
  PollMode mode_;
  std::thread thread_;
};

}  // namespace fabric
