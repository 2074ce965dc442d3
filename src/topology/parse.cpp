// Parsing the values detect_topology reads: CPU lists, port rates and states, PCI paths.
#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "topology/inventory.h"
#include "topology/sysfs.h"

namespace fabric::topo {

namespace {
bool is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

bool all_hex(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), is_hex); }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

std::optional<int> to_int(std::string_view s) {
  s = trim(s);
  int v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}
}  // namespace

bool is_pci_address(std::string_view s) {
  // DDDD:BB:SS.F, the domain at least 4 hex digits (VMD domains have 5).
  size_t c1 = s.find(':');
  if (c1 == std::string_view::npos || c1 < 4) return false;
  std::string_view rest = s.substr(c1 + 1);
  return all_hex(s.substr(0, c1)) && rest.size() == 7 && all_hex(rest.substr(0, 2)) && rest[2] == ':' &&
         all_hex(rest.substr(3, 2)) && rest[5] == '.' && rest[6] >= '0' && rest[6] <= '7';
}

PciPath PciPath::parse(std::string_view resolved) {
  PciPath p;
  std::vector<std::string> parts = split_path(resolved);
  size_t first = 0;
  while (first < parts.size() && !is_pci_address(parts[first])) first++;
  if (first == parts.size()) return p;
  for (size_t i = 0; i < first; i++) {
    if (i) p.root += '/';
    p.root += parts[i];
  }
  // Inside a PCI hierarchy every level is a device; a nested host bridge (Intel VMD's
  // "pci10000:e0") is no bridge of the PCI bus above it and is skipped.
  for (size_t i = first; i < parts.size(); i++)
    if (is_pci_address(parts[i])) p.chain.push_back(parts[i]);
  return p;
}

size_t shared_bridges(const PciPath& a, const PciPath& b) {
  if (a.root != b.root || a.chain.empty() || b.chain.empty()) return 0;
  size_t n = std::min(a.chain.size(), b.chain.size()) - 1;  // bridges only, not the devices
  size_t i = 0;
  while (i < n && a.chain[i] == b.chain[i]) i++;
  return i;
}

std::vector<int> parse_cpulist(std::string_view list) {
  std::vector<int> cpus;
  size_t i = 0;
  while (i <= list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string_view::npos) j = list.size();
    std::string_view piece = trim(list.substr(i, j - i));
    size_t dash = piece.find('-');
    if (dash == std::string_view::npos) {
      if (auto v = to_int(piece)) cpus.push_back(*v);
    } else {
      auto lo = to_int(piece.substr(0, dash));
      auto hi = to_int(piece.substr(dash + 1));
      if (lo && hi && *lo <= *hi && *hi - *lo < (1 << 20))
        for (int c = *lo; c <= *hi; c++) cpus.push_back(c);
    }
    i = j + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpulist(const std::vector<int>& cpus) {
  std::vector<int> c = cpus;
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  std::string out;
  for (size_t i = 0; i < c.size();) {
    size_t j = i;
    while (j + 1 < c.size() && c[j + 1] == c[j] + 1) j++;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", c[i]) : fmt::format("{}-{}", c[i], c[j]);
    i = j + 1;
  }
  return out;
}

std::optional<double> parse_rate_gbps(std::string_view rate) {
  // The kernel writes "<rate> Gb/sec (<width>X<speed>)"; the rate may have a fraction ("2.5").
  rate = trim(rate);
  size_t n = 0;
  while (n < rate.size() && ((rate[n] >= '0' && rate[n] <= '9') || rate[n] == '.')) n++;
  if (n == 0 || rate.substr(n).find("Gb/s") == std::string_view::npos) return std::nullopt;
  std::string num(rate.substr(0, n));
  char* end = nullptr;
  double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || v < 0) return std::nullopt;
  return v;
}

bool parse_port_active(std::string_view state) {
  // "<number>: <name>", as the kernel's ib port state attribute writes it.
  size_t colon = state.find(':');
  std::string_view name = trim(colon == std::string_view::npos ? state : state.substr(colon + 1));
  return name == "ACTIVE";
}

}  // namespace fabric::topo
