#include "topology/sysfs.h"

#include <algorithm>
#include <charconv>
#include <deque>
#include <filesystem>
#include <fstream>
#include <system_error>

namespace fabric::topo {

namespace fs = std::filesystem;

namespace {
// Symlinks followed while resolving one path before giving up (the kernel's limit is 40).
constexpr int kMaxLinks = 40;
// A sysfs attribute is at most a page; recorded fixtures hold nothing larger.
constexpr std::streamsize kMaxRead = 1 << 16;
}  // namespace

std::vector<std::string> split_path(std::string_view path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string_view::npos) j = path.size();
    if (j > i) parts.emplace_back(path.substr(i, j - i));
    i = j + 1;
  }
  return parts;
}

namespace {
// `prefix` is `path` or one of its parents.
bool is_under(std::string_view path, std::string_view prefix) {
  if (prefix == "/") return !path.empty() && path[0] == '/';
  return path.substr(0, prefix.size()) == prefix && (path.size() == prefix.size() || path[prefix.size()] == '/');
}
}  // namespace

SysfsTree::SysfsTree(std::string root) : root_(std::move(root)) {
  while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
  if (root_.empty()) root_.push_back('/');
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(fs::absolute(root_, ec), ec);
  canonical_root_ = ec ? root_ : canonical.string();
  while (canonical_root_.size() > 1 && canonical_root_.back() == '/') canonical_root_.pop_back();
}

std::string SysfsTree::absolute(const std::vector<std::string>& parts) const {
  std::string p = root_;
  for (const std::string& part : parts) {
    if (p.back() != '/') p += '/';
    p += part;
  }
  return p;
}

std::optional<std::vector<std::string>> SysfsTree::walk(std::string_view path, bool follow_last) const {
  std::deque<std::string> todo;
  for (std::string& part : split_path(path)) todo.push_back(std::move(part));
  std::vector<std::string> done;
  int links = 0;
  while (!todo.empty()) {
    std::string part = std::move(todo.front());
    todo.pop_front();
    if (part == ".") continue;
    if (part == "..") {
      if (!done.empty()) done.pop_back();  // never above the root
      continue;
    }
    done.push_back(std::move(part));
    if (todo.empty() && !follow_last) break;
    std::error_code ec;
    const std::string here = absolute(done);
    if (!fs::is_symlink(fs::symlink_status(here, ec))) continue;
    fs::path target = fs::read_symlink(here, ec);
    if (ec || ++links > kMaxLinks) return std::nullopt;
    done.pop_back();
    std::string t = target.string();
    if (target.is_absolute()) {
      // Followed only inside the root: a recorded tree must not reach into the live one.
      std::string_view rest;
      if (is_under(t, root_)) {
        rest = std::string_view(t).substr(root_ == "/" ? 0 : root_.size());
      } else if (is_under(t, canonical_root_)) {
        rest = std::string_view(t).substr(canonical_root_ == "/" ? 0 : canonical_root_.size());
      } else {
        return std::nullopt;
      }
      done.clear();
      std::vector<std::string> parts = split_path(rest);
      todo.insert(todo.begin(), parts.begin(), parts.end());
    } else {
      std::vector<std::string> parts = split_path(t);
      todo.insert(todo.begin(), parts.begin(), parts.end());
    }
  }
  return done;
}

std::optional<std::string> SysfsTree::read(std::string_view path) const {
  auto parts = walk(path, true);
  if (!parts) return std::nullopt;
  std::ifstream in(absolute(*parts), std::ios::binary);
  if (!in) return std::nullopt;
  std::string s(static_cast<size_t>(kMaxRead), '\0');
  in.read(s.data(), kMaxRead);
  if (in.bad()) return std::nullopt;  // e.g. EIO from an attribute the device cannot report
  s.resize(static_cast<size_t>(in.gcount()));
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.pop_back();
  return s;
}

std::optional<long> SysfsTree::read_int(std::string_view path) const {
  auto s = read(path);
  if (!s) return std::nullopt;
  std::string_view v = *s;
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  long value = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
  if (ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  return value;
}

std::optional<std::string> SysfsTree::link_target(std::string_view path) const {
  auto parts = walk(path, false);
  if (!parts || parts->empty()) return std::nullopt;
  std::error_code ec;
  fs::path target = fs::read_symlink(absolute(*parts), ec);
  if (ec) return std::nullopt;
  return target.string();
}

std::optional<std::string> SysfsTree::resolve(std::string_view path) const {
  auto parts = walk(path, true);
  if (!parts) return std::nullopt;
  std::error_code ec;
  if (!fs::exists(absolute(*parts), ec)) return std::nullopt;
  std::string out;
  for (const std::string& part : *parts) {
    if (!out.empty()) out += '/';
    out += part;
  }
  return out;
}

std::vector<std::string> SysfsTree::list(std::string_view path) const {
  std::vector<std::string> names;
  auto parts = walk(path, true);
  if (!parts) return names;
  std::error_code ec;
  fs::directory_iterator it(absolute(*parts), ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec))
    names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool SysfsTree::is_dir(std::string_view path) const {
  auto parts = walk(path, true);
  if (!parts) return false;
  std::error_code ec;
  return fs::is_directory(absolute(*parts), ec);
}

}  // namespace fabric::topo
