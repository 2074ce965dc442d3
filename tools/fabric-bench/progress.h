// fabric-bench's progress line for a person at a terminal: step, pass, rate, bytes moved, elapsed
// time and the pass's ETA, redrawn in place on stderr by its own thread. The measuring loops only
// publish a counter they already keep (or bump a relaxed atomic between round trips), so a pass
// pays nothing for it; stdout (the table, the JSON) is never touched.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace fabric::bench {

// auto: shown when stdout and stderr are both terminals and the run has lasted kQuietFor; always:
// from the start, terminal or not (what the tests use); never: not at all.
enum class ProgressMode { kAuto, kAlways, kNever };

class Progress {
 public:
  // Runs shorter than this show nothing in auto mode: the line would only flicker.
  static constexpr std::chrono::milliseconds kQuietFor{2000};
  static constexpr std::chrono::milliseconds kRefresh{250};

  explicit Progress(ProgressMode mode, std::FILE* out = stderr);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // The run has `steps` measurements; starts the drawing thread when the line can show.
  void start(size_t steps);
  void next_step();  // the next measurement begins
  // Clears the line, writes the summary (when the line was shown) and stops the thread.
  void finish();

  // One pass of a measurement: `total` transfers of `bytes_each`, `done` counting those finished
  // (it may overshoot, as fabric-bench's failure relay makes it). Ends when the Pass is destroyed,
  // which must come before `done` is: declare the Pass after its counter.
  class Pass {
   public:
    Pass(Pass&&) = delete;
    ~Pass();

   private:
    friend class Progress;
    explicit Pass(Progress* p) : p_(p) {}
    Progress* p_;
  };
  [[nodiscard]] Pass pass(std::string name, uint64_t bytes_each, uint64_t total,
                          const std::atomic<uint64_t>& done);

  // Runs `print` (a table row to stdout) with the progress line out of its way, so a row never
  // lands in the middle of it on a shared terminal; the next refresh draws the line again.
  template <class F>
  void row(F&& print) {
    if (!shown_) {
      print();
      return;
    }
    std::lock_guard lock(mu_);
    clear_locked();
    print();
  }

 private:
  struct Sample {
    std::chrono::steady_clock::time_point at;
    uint64_t bytes, transfers;
  };
  void draw_loop(std::stop_token stop);
  void draw_locked();
  void clear_locked();
  void end_pass();

  std::FILE* out_;
  bool shown_ = false;  // the mode allows the line (decided once, at construction)
  ProgressMode mode_;
  std::mutex mu_;  // everything below, and the output stream's line
  std::condition_variable_any wake_;
  std::chrono::steady_clock::time_point t0_;
  size_t steps_ = 0, step_ = 0;
  std::string pass_name_;
  uint64_t pass_bytes_each_ = 0, pass_total_ = 0;
  const std::atomic<uint64_t>* pass_done_ = nullptr;
  std::chrono::steady_clock::time_point pass_start_;
  uint64_t bytes_before_ = 0, transfers_before_ = 0;  // of the passes that ended
  std::deque<Sample> samples_;                        // the last second, for the rate
  bool on_screen_ = false;                            // a line is drawn and not cleared
  bool drew_ = false;                                 // a line was ever drawn: summary at the end
  std::jthread thread_;
};

}  // namespace fabric::bench
