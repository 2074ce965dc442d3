// Levelled logging to stderr, level from FABRIC_LOG (error|warn|info|debug; default warn).
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace fabric::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

Level level();
void set_level(Level lvl);  // for tests: FABRIC_LOG is read once, at the first message
void write(Level lvl, std::string_view message);

template <class... Args>
void at(Level lvl, fmt::format_string<Args...> f, Args&&... args) {
  if (lvl <= level()) write(lvl, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void error(fmt::format_string<Args...> f, Args&&... a) { at(Level::kError, f, std::forward<Args>(a)...); }
template <class... Args>
void warn(fmt::format_string<Args...> f, Args&&... a) { at(Level::kWarn, f, std::forward<Args>(a)...); }
template <class... Args>
void info(fmt::format_string<Args...> f, Args&&... a) { at(Level::kInfo, f, std::forward<Args>(a)...); }
template <class... Args>
void debug(fmt::format_string<Args...> f, Args&&... a) { at(Level::kDebug, f, std::forward<Args>(a)...); }

}  // namespace fabric::log
