// Callback thread: pops events, runs them, reports exceptions thrown by user callbacks.
#include "shared_state/callback_thread.h"

#include <exception>

#include "util/log.h"

namespace fabric {

CallbackThread::CallbackThread(size_t capacity, PollMode mode)
    : queue_(capacity), mode_(mode), thread_([this] { run(); }) {}

CallbackThread::~CallbackThread() { join(); }

void CallbackThread::push(Event&& event, std::deque<Event>& overflow) {
  if (!overflow.empty() || !queue_.try_push(event)) overflow.push_back(std::move(event));
  wake();
}

bool CallbackThread::flush(std::deque<Event>& overflow) {
  while (!overflow.empty() && queue_.try_push(overflow.front())) overflow.pop_front();
  wake();
  return overflow.empty();
}

void CallbackThread::stop() {
  Event e;
  e.stop = true;
  while (!queue_.try_push(e)) std::this_thread::yield();
  wake();
}

void CallbackThread::wake() {
  // Bump the doorbell after every push: a sleeper that read the old value before our push sees
  // the new value in wait() and does not block; one that reads the new value also sees the push.
  // The syscall (notify) is paid only while the callback thread actually sleeps.
  doorbell_.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst)) doorbell_.notify_one();
}

void CallbackThread::run() {
  constexpr uint32_t kSpinRounds = 2000;
  uint32_t idle_rounds = 0;
  for (;;) {
    std::optional<Event> e = queue_.try_pop();
    if (!e) {
      if (mode_ == PollMode::kBusy || ++idle_rounds < kSpinRounds) continue;
      uint32_t ring = doorbell_.load(std::memory_order_seq_cst);
      sleeping_.store(true, std::memory_order_seq_cst);
      e = queue_.try_pop();  // recheck: a push before `ring` was read is visible now
      if (!e) doorbell_.wait(ring, std::memory_order_seq_cst);
      sleeping_.store(false, std::memory_order_seq_cst);
      if (!e) continue;
    }
    idle_rounds = 0;
    if (e->stop) return;
    struct GiveBack {  // the data buffer goes back to the pool even if the callback threw
      util::SharedPool<std::vector<std::byte>>& pool;
      std::vector<std::byte>* buf;
      ~GiveBack() { pool.give(buf); }
    } give_back{buffers_, e->data};
    try {
      if (e->done) e->done(e->status);
      if (e->on_recv) (*e->on_recv)(std::span<const std::byte>(*e->data));
    } catch (const std::exception& ex) {
      log::error("a completion callback threw: {} (callbacks must not throw; the exception was "
                 "dropped)",
                 ex.what());
    } catch (...) {
      log::error("a completion callback threw a non-std exception (dropped)");
    }
  }
}

}  // namespace fabric
