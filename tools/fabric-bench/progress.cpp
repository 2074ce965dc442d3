// fabric-bench's progress line: see progress.h. Rates are differences of bytes moved over wall
// clock between refreshes (the last second), never bytes over summed transfer times.
#include "progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>

namespace fabric::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Decimal units, as the table's GB/s column (1e9 bytes).
std::string si(double v, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  size_t i = 0;
  while (v >= 1000 && i + 1 < std::size(prefixes)) {
    v /= 1000;
    i++;
  }
  std::string s =
      i == 0 ? fmt::format("{:.0f} {}", v, unit) : fmt::format("{:.2f} {}{}", v, prefixes[i], unit);
  if (s.back() == ' ') s.pop_back();  // a plain count: no prefix, no unit
  return s;
}

std::string clock_text(double s) {
  auto t = static_cast<uint64_t>(std::max(0.0, s) + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02}", t / 60, t % 60);
}

// A line longer than the terminal wraps, and the carriage return would then redraw only its last
// row: the line is cut to the width (80 where it cannot be read, e.g. a pipe in always mode).
size_t width_of(std::FILE* out) {
  winsize ws{};
  if (ioctl(fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1) return ws.ws_col - 1;
  return 79;
}

}  // namespace

Progress::Progress(ProgressMode mode, std::FILE* out) : out_(out), mode_(mode) {
  shown_ = mode == ProgressMode::kAlways ||
           (mode == ProgressMode::kAuto && isatty(fileno(stdout)) && isatty(fileno(out)));
  t0_ = Clock::now();
}

Progress::~Progress() { finish(); }

void Progress::start(size_t steps) {
  if (!shown_) return;
  {
    std::lock_guard lock(mu_);
    steps_ = steps;
    t0_ = Clock::now();
  }
  thread_ = std::jthread([this](std::stop_token stop) { draw_loop(stop); });
}

void Progress::next_step() {
  if (!shown_) return;
  std::lock_guard lock(mu_);
  step_++;
}

Progress::Pass Progress::pass(std::string name, uint64_t bytes_each, uint64_t total,
                              const std::atomic<uint64_t>& done) {
  if (!shown_) return Pass(nullptr);
  std::lock_guard lock(mu_);
  pass_name_ = std::move(name);
  pass_bytes_each_ = bytes_each;
  pass_total_ = total;
  pass_done_ = &done;
  pass_start_ = Clock::now();
  return Pass(this);
}

Progress::Pass::~Pass() {
  if (p_) p_->end_pass();
}

void Progress::end_pass() {
  std::lock_guard lock(mu_);
  uint64_t n = std::min(pass_done_->load(std::memory_order_relaxed), pass_total_);
  bytes_before_ += n * pass_bytes_each_;
  transfers_before_ += n;
  pass_done_ = nullptr;  // its counter may be gone once this returns
}

void Progress::finish() {
  if (!shown_ || !thread_.joinable()) return;
  thread_.request_stop();
  thread_.join();
  std::lock_guard lock(mu_);
  clear_locked();
  if (drew_) {
    double secs = seconds(Clock::now() - t0_);
    fmt::print(out_, "fabric-bench: {}/{} steps, {} moved in {} ({}, {} transfers)\n", step_,
               steps_, si(static_cast<double>(bytes_before_), "B"), clock_text(secs),
               si(secs > 0 ? bytes_before_ / secs : 0, "B/s"), transfers_before_);
    std::fflush(out_);
  }
}

void Progress::draw_loop(std::stop_token stop) {
  auto first =
      t0_ + (mode_ == ProgressMode::kAlways ? Clock::duration{} : Clock::duration{kQuietFor});
  std::unique_lock lock(mu_);
  wake_.wait_until(lock, stop, first, [] { return false; });
  while (!stop.stop_requested()) {
    draw_locked();
    wake_.wait_for(lock, stop, kRefresh, [] { return false; });
  }
}

void Progress::draw_locked() {
  auto now = Clock::now();
  uint64_t done =
      pass_done_ ? std::min(pass_done_->load(std::memory_order_relaxed), pass_total_) : 0;
  uint64_t bytes = bytes_before_ + done * pass_bytes_each_;
  uint64_t transfers = transfers_before_ + done;
  // The rate over about the last second: the oldest sample kept is the first within it.
  samples_.push_back({now, bytes, transfers});
  while (samples_.size() > 2 && now - samples_[1].at >= std::chrono::seconds(1))
    samples_.pop_front();
  const Sample& old = samples_.front();
  double dt = seconds(now - old.at);
  std::string line = fmt::format("[{}/{}]", step_, steps_);
  if (pass_done_) line += fmt::format(" {} {}/{}", pass_name_, done, pass_total_);
  if (dt > 0)
    line += fmt::format("  {}  {} xfer/s", si((bytes - old.bytes) / dt, "B/s"),
                        si((transfers - old.transfers) / dt, ""));
  // The pass's end is known (its transfer count): its ETA at the pass's average pace so far.
  if (pass_done_ && done > 0 && done < pass_total_)
    line += fmt::format("  ETA {}",
                        clock_text(seconds(now - pass_start_) * (pass_total_ - done) / done));
  line += fmt::format("  moved {}  {}", si(static_cast<double>(bytes), "B"),
                      clock_text(seconds(now - t0_)));
  line.resize(std::min(line.size(), width_of(out_)));
  fmt::print(out_, "\r{}\x1b[K", line);
  std::fflush(out_);
  on_screen_ = drew_ = true;
}

void Progress::clear_locked() {
  if (!on_screen_) return;
  fmt::print(out_, "\r\x1b[K");
  std::fflush(out_);
  on_screen_ = false;
}

}  // namespace fabric::bench
