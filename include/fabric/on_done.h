// How the engine reports that an asynchronous operation ended: a callback, or an atomic set in place.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "fabric/error.h"

namespace fabric {

// Values an OnDone::flag() takes.
enum DoneState : int { kDonePending = 0, kDoneSucceeded = 1, kDoneFailed = -1 };

// Where a flag or a counter keeps how its operation failed (a flag or a counter alone says only
// that it did). The first failure is kept; written before the flag or counter changes, so a
// thread that saw kDoneFailed or a failed count then reads it here.
class DoneStatus {
 public:
  void record(const Status& s) {
    std::lock_guard l(mu_);
    if (!first_failure_) first_failure_ = s;
  }
  std::optional<Status> first_failure() const {
    std::lock_guard l(mu_);
    return first_failure_;
  }
  void clear() {
    std::lock_guard l(mu_);
    first_failure_.reset();
  }

 private:
  mutable std::mutex mu_;  // failures only: never on the success path
  std::optional<Status> first_failure_;
};

// Completion of a transfer or an immediate expectation. Fires exactly once.
//
// - callback(fn): fn(status) runs on the engine's callback thread (never on a worker).
// - flag(f): the worker stores kDoneSucceeded or kDoneFailed into *f (release order) and
//   notifies it, so a thread may poll it or block in f->wait(kDonePending); no callback cost.
//   The failure message goes to the log, and to *status when given. A flag is one-shot: reset
//   it to kDonePending (and clear its status) before handing it to the next operation.
// - counter(done, failed): the worker increments *done on success, *failed (if given) on error,
//   and notifies the counter it changed (std::atomic::wait works on both); the first failure's
//   status goes to *status when given.
// - raise(word, value, failed): on success the worker raises *word to `value` unless it is
//   already there or above, and notifies it; on error as counter. For step-numbered signals a
//   waiter compares with >= (a step that never completes, or several finishing out of order,
//   cannot leave the word behind the way a count would).
// - none(): nothing is reported (errors are still logged).
class OnDone {
 public:
  using Callback = std::function<void(const Status&)>;
  enum class Kind { kNone, kCallback, kFlag, kCounter, kRaise };

  OnDone() = default;
  static OnDone none() { return {}; }
  static OnDone callback(Callback fn) {
    OnDone d;
    d.kind_ = Kind::kCallback;
    d.callback_ = std::move(fn);
    return d;
  }
  static OnDone flag(std::atomic<int>* f, DoneStatus* status = nullptr) {
    OnDone d;
    d.kind_ = Kind::kFlag;
    d.flag_ = f;
    d.status_ = status;
    return d;
  }
  static OnDone counter(std::atomic<uint64_t>* done, std::atomic<uint64_t>* failed = nullptr,
                        DoneStatus* status = nullptr) {
    OnDone d;
    d.kind_ = Kind::kCounter;
    d.done_ = done;
    d.failed_ = failed;
    d.status_ = status;
    return d;
  }

  static OnDone raise(std::atomic<uint64_t>* word, uint64_t value, std::atomic<uint64_t>* failed = nullptr,
                      DoneStatus* status = nullptr) {
    OnDone d = counter(word, failed, status);
    d.kind_ = Kind::kRaise;
    d.value_ = value;
    return d;
  }

  // Keeps `owner` alive until the engine is done with this OnDone (for flags and counters whose
  // storage belongs to someone else, e.g. a Python object). Released on an engine thread.
  OnDone&& keep_alive(std::shared_ptr<void> owner) && {
    keep_alive_ = std::move(owner);
    return std::move(*this);
  }

  // Completes it here, on the calling thread (a callback runs right away): for operations built
  // from several engine calls, such as a KV request, that report once when all of theirs ended.
  void fire(const Status& status) {
    if (!status.ok() && status_) status_->record(status);  // before the flag or counter changes
    switch (kind_) {
      case Kind::kNone: break;
      case Kind::kCallback:
        if (callback_) callback_(status);
        break;
      case Kind::kFlag:
        flag_->store(status.ok() ? kDoneSucceeded : kDoneFailed, std::memory_order_release);
        flag_->notify_all();
        break;
      case Kind::kCounter:
      case Kind::kRaise:
        if (status.ok()) {
          if (kind_ == Kind::kCounter) {
            done_->fetch_add(1, std::memory_order_release);
          } else {
            uint64_t seen = done_->load(std::memory_order_relaxed);
            while (seen < value_ && !done_->compare_exchange_weak(seen, value_, std::memory_order_release,
                                                                  std::memory_order_relaxed)) {
            }
          }
          done_->notify_all();
        } else if (failed_) {
          failed_->fetch_add(1, std::memory_order_release);
          failed_->notify_all();
        }
        break;
    }
    reset();
  }

  // Back to none, letting go of a callback and what it kept alive (cheap when there is neither).
  void reset() {
    if (callback_) callback_ = nullptr;
    if (keep_alive_) keep_alive_.reset();
    kind_ = Kind::kNone;
    flag_ = nullptr;
    done_ = failed_ = nullptr;
    status_ = nullptr;
  }

  Kind kind() const { return kind_; }
  Callback& callback_fn() { return callback_; }
  std::atomic<int>* flag_ptr() const { return flag_; }
  std::atomic<uint64_t>* done_counter() const { return done_; }
  std::atomic<uint64_t>* failed_counter() const { return failed_; }

 private:
  Kind kind_ = Kind::kNone;
  Callback callback_;
  std::atomic<int>* flag_ = nullptr;
  std::atomic<uint64_t>* done_ = nullptr;
  uint64_t value_ = 0;  // kRaise
  std::atomic<uint64_t>* failed_ = nullptr;
  DoneStatus* status_ = nullptr;
  std::shared_ptr<void> keep_alive_;
};

}  // namespace fabric
