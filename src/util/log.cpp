// Log level from the environment, read once (tests may change it); one line per message so threads do not interleave.
#include "util/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fabric::log {

static Level parse_level() {
  const char* v = std::getenv("FABRIC_LOG");
  if (!v) return Level::kWarn;
  if (!std::strcmp(v, "error")) return Level::kError;
  if (!std::strcmp(v, "info")) return Level::kInfo;
  if (!std::strcmp(v, "debug")) return Level::kDebug;
  return Level::kWarn;
}

namespace {
std::atomic<int>& current() {
  static std::atomic<int> lvl{static_cast<int>(parse_level())};
  return lvl;
}
}  // namespace

Level level() { return static_cast<Level>(current().load(std::memory_order_relaxed)); }
void set_level(Level lvl) { current().store(static_cast<int>(lvl), std::memory_order_relaxed); }

void write(Level lvl, std::string_view message) {
  static constexpr const char* kNames[] = {"error", "warn", "info", "debug"};
  // Debug lines carry the time (steady clock, seconds) and the process: they are read side by
  // side from several processes to see who waited for whom.
  std::string line =
      lvl == Level::kDebug
          ? fmt::format("[fabric debug {:.6f} pid {}] {}\n",
                        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
                        getpid(), message)
          : fmt::format("[fabric {}] {}\n", kNames[static_cast<int>(lvl)], message);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace fabric::log
