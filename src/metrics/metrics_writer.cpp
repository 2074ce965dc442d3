// MetricsWriter: samples gathered by family and rendered as Prometheus text 0.0.4 (names checked,
// label values and help texts escaped); DurationHistogram; the peer label.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <unordered_set>

#include "fabric/error.h"
#include "fabric/metrics.h"
#include "util/bytes.h"

namespace fabric {

namespace {

bool name_char(char c, bool first, bool colon) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') return true;
  if (colon && c == ':') return true;
  return !first && c >= '0' && c <= '9';
}

bool valid_name(std::string_view s, bool colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); i++)
    if (!name_char(s[i], i == 0, colon)) return false;
  return true;
}

[[noreturn]] void refuse(std::string message) {
  throw Error(ErrorCode::kInvalidArgument, "MetricsWriter: " + message);
}

// Label values: backslash, double quote and line feed escaped (the format's three).
void append_label_value(std::string& out, std::string_view v) {
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
}

// HELP text: backslash and line feed escaped.
std::string escape_help(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// `{a="x",b="y"` without the closing brace (a histogram adds its le), or "" for no labels.
std::string label_text(std::string_view metric, std::span<const MetricLabel> labels, bool histogram) {
  std::string out;
  for (size_t i = 0; i < labels.size(); i++) {
    const MetricLabel& l = labels[i];
    if (!valid_name(l.name, false) || l.name.starts_with("__"))
      refuse(fmt::format("{}: bad label name '{}' ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)",
                         metric, l.name));
    if (histogram && l.name == "le") refuse(fmt::format("{}: a histogram's label may not be 'le'", metric));
    for (size_t j = 0; j < i; j++)
      if (labels[j].name == l.name) refuse(fmt::format("{}: label '{}' given twice", metric, l.name));
    out += i == 0 ? "{" : ",";
    out += l.name;
    out += "=\"";
    append_label_value(out, l.value);
    out += '"';
  }
  return out;
}

constexpr std::string_view type_name(int t) {
  return t == 0 ? "counter" : t == 1 ? "gauge" : "histogram";
}

}  // namespace

struct MetricsWriter::Family {
  Type type;
  std::string name;
  std::string help;
  std::string samples;                 // rendered lines
  std::unordered_set<std::string> seen;  // label sets written, to refuse duplicates
};

MetricsWriter::MetricsWriter() = default;
MetricsWriter::~MetricsWriter() = default;

std::string MetricsWriter::format_double(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back the same
  return std::string(buf, r.ptr);
}
std::string MetricsWriter::format_signed(int64_t v) { return std::to_string(v); }
std::string MetricsWriter::format_unsigned(uint64_t v) { return std::to_string(v); }

MetricsWriter::Family& MetricsWriter::family(Type type, std::string_view name, std::string_view help) {
  for (auto& f : families_) {
    if (f->name != name) continue;
    if (f->type != type)
      refuse(fmt::format("{} written as a {} and as a {}", name, type_name(int(f->type)),
                         type_name(int(type))));
    if (f->help != help) refuse(fmt::format("{} written with two help texts", name));
    return *f;
  }
  if (!valid_name(name, true)) refuse(fmt::format("bad metric name '{}' ([a-zA-Z_:][a-zA-Z0-9_:]*)", name));
  if (type == Type::kCounter && !name.ends_with("_total"))
    refuse(fmt::format("counter {} must end in _total", name));
  if (type != Type::kCounter && name.ends_with("_total"))
    refuse(fmt::format("{} ends in _total but is not a counter", name));
  families_.push_back(std::make_unique<Family>(Family{type, std::string(name), std::string(help), {}, {}}));
  return *families_.back();
}

void MetricsWriter::sample(Type type, std::string_view name, std::string_view help, std::string value,
                           MetricLabels labels) {
  Family& f = family(type, name, help);
  std::string l = label_text(name, labels.span(), false);
  if (!f.seen.insert(l).second) refuse(fmt::format("{}{} written twice", name, l.empty() ? "" : l + "}"));
  f.samples += f.name;
  if (!l.empty()) f.samples += l + "}";
  f.samples += ' ';
  f.samples += value;
  f.samples += '\n';
}

void MetricsWriter::histogram(std::string_view name, std::string_view help,
                              std::span<const double> upper_bounds, std::span<const uint64_t> counts,
                              double sum, MetricLabels labels) {
  Family& f = family(Type::kHistogram, name, help);
  if (counts.size() != upper_bounds.size() + 1)
    refuse(fmt::format("{}: {} counts for {} bounds (one per bound, one for +Inf)", name,
                       counts.size(), upper_bounds.size()));
  for (size_t i = 1; i < upper_bounds.size(); i++)
    if (!(upper_bounds[i - 1] < upper_bounds[i])) refuse(fmt::format("{}: bounds not ascending", name));
  std::string l = label_text(name, labels.span(), true);
  if (!f.seen.insert(l).second) refuse(fmt::format("{}{} written twice", name, l.empty() ? "" : l + "}"));
  const std::string open = l.empty() ? "{" : l + ",";
  const std::string close = l.empty() ? "" : l + "}";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); i++) {
    cumulative += counts[i];
    std::string le = i < upper_bounds.size() ? format_double(upper_bounds[i]) : "+Inf";
    f.samples += fmt::format("{}_bucket{}le=\"{}\"}} {}\n", f.name, open, le, cumulative);
  }
  f.samples += fmt::format("{}_sum{} {}\n", f.name, close, format_double(sum));
  f.samples += fmt::format("{}_count{} {}\n", f.name, close, cumulative);
}

std::string MetricsWriter::text() const {
  std::string out;
  for (const auto& f : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f->name, escape_help(f->help), f->name,
                       type_name(int(f->type)));
    out += f->samples;
  }
  return out;
}

std::span<const double> DurationHistogram::upper_bounds() {
  static const std::array<double, kBounds> bounds = [] {
    std::array<double, kBounds> b{};
    for (size_t i = 0; i < kBounds; i++) b[i] = std::ldexp(1.0, static_cast<int>(10 + i)) / 1e9;
    return b;
  }();
  return bounds;
}

void DurationHistogram::observe(std::chrono::nanoseconds d) {
  const uint64_t ns = d.count() > 0 ? static_cast<uint64_t>(d.count()) : 0;
  counts_[bucket_of(ns)].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(ns, std::memory_order_relaxed);
}

void DurationHistogram::write(MetricsWriter& w, std::string_view name, std::string_view help,
                              MetricLabels labels) const {
  std::array<uint64_t, kBuckets> counts;
  for (size_t i = 0; i < kBuckets; i++) counts[i] = counts_[i].load(std::memory_order_relaxed);
  w.histogram(name, help, upper_bounds(), counts,
              static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9, labels);
}

std::string metrics_peer_label(const NetAddr& peer) {
  if (peer.nic_count() == 0) return peer.local();
  const std::string& a = peer.nic(0);
  const bool printable = !a.empty() && std::all_of(a.begin(), a.end(), [](char c) {
    return c >= 0x20 && c < 0x7f;
  });
  if (printable) return a;
  return util::to_hex(std::span(reinterpret_cast<const uint8_t*>(a.data()), a.size()));
}

}  // namespace fabric
