// Callback thread: pops events, runs them, reports exceptions thrown by user callbacks.
#include "engine/callback_thread.h"

#include <exception>

#include "util/idle.h"
#include "util/log.h"

namespace fabric {

CallbackThread::CallbackThread(size_t capacity, PollMode mode)
    : queue_(capacity), mode_(mode), thread_([this] { run(); }) {}

CallbackThread::~CallbackThread() {
  if (thread_.joinable()) thread_.join();
}

void CallbackThread::push(Event&& event, std::deque<Event>& overflow) {
  if (!overflow.empty() || !queue_.try_push(event)) overflow.push_back(std::move(event));
}

bool CallbackThread::flush(std::deque<Event>& overflow) {
  while (!overflow.empty() && queue_.try_push(overflow.front())) overflow.pop_front();
  return overflow.empty();
}

void CallbackThread::stop() {
  Event e;
  e.stop = true;
  while (!queue_.try_push(e)) std::this_thread::yield();
}

void CallbackThread::run() {
  util::Idle idle(mode_);
  for (;;) {
    std::optional<Event> e = queue_.try_pop();
    if (!e) {
      idle.wait();
      continue;
    }
    idle.reset();
    if (e->stop) return;
    try {
      if (e->done) e->done(e->status);
      if (e->on_recv) (*e->on_recv)(std::span<const std::byte>(e->data));
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
