// Metrics in the Prometheus text exposition format 0.0.4: what TransferEngine::metrics_text()
// renders, MetricsWriter (how a metrics source, e.g. an application built on the engine, adds its
// own samples to the same text) and DurationHistogram (a lock-free latency histogram for them).
// docs/api.md, "Metrics reference", lists every metric the engine exposes and what it means.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fabric/types.h"

namespace fabric {

struct MetricLabel {
  std::string_view name;   // [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__"
  std::string_view value;  // any UTF-8; escaped by the writer
};

// The labels of one sample: a braced list, {{"peer", p}, {"kind", "single"}}, an array or a span.
// Read during the call only. It refers to its labels: one built from a braced list must not be
// kept past the call it is written in (the list's array ends there); keep a MetricLabel array.
class MetricLabels {
 public:
  MetricLabels() = default;
  MetricLabels(std::initializer_list<MetricLabel> labels) : labels_(labels.begin(), labels.size()) {}
  MetricLabels(std::span<const MetricLabel> labels) : labels_(labels) {}
  template <size_t N>
  MetricLabels(const MetricLabel (&labels)[N]) : labels_(labels) {}
  std::span<const MetricLabel> span() const { return labels_; }

 private:
  std::span<const MetricLabel> labels_;
};

// Collects the samples of one metrics_text() call. A family (one metric name) gets its HELP and
// TYPE lines once and its samples together, whatever order they were written in; families come
// out in the order they were first written. Names follow Prometheus: [a-zA-Z_:][a-zA-Z0-9_:]*,
// base units (seconds, bytes), counters end in "_total". A mistake (a bad name, a counter without
// "_total", one name written as two types or with two helps, the same labels twice in a family,
// a histogram's counts not matching its bounds) throws fabric::Error(kInvalidArgument) naming it.
class MetricsWriter {
 public:
  MetricsWriter();
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // A count that only grows (restarting from 0 only when the process does).
  template <class T>
    requires std::is_arithmetic_v<T>
  void counter(std::string_view name, std::string_view help, T value, MetricLabels labels = {}) {
    sample(Type::kCounter, name, help, number(value), labels);
  }
  // A value that goes up and down (depths, sizes, a state as 0/1).
  template <class T>
    requires std::is_arithmetic_v<T>
  void gauge(std::string_view name, std::string_view help, T value, MetricLabels labels = {}) {
    sample(Type::kGauge, name, help, number(value), labels);
  }
  // A histogram: `upper_bounds` ascending (the +Inf bucket is implied), `counts` one per bound plus
  // one for the values above the last (per bucket, not cumulative: the writer accumulates them
  // into _bucket{le=...}), `sum` the sum of the observed values. _count is the sum of `counts`.
  void histogram(std::string_view name, std::string_view help, std::span<const double> upper_bounds,
                 std::span<const uint64_t> counts, double sum, MetricLabels labels = {});

  // The exposition so far.
  std::string text() const;

 private:
  enum class Type : uint8_t { kCounter, kGauge, kHistogram };
  struct Family;
  template <class T>
  static std::string number(T v) {
    if constexpr (std::is_same_v<T, bool>) return v ? "1" : "0";
    else if constexpr (std::is_floating_point_v<T>) return format_double(static_cast<double>(v));
    else if constexpr (std::is_signed_v<T>) return format_signed(static_cast<int64_t>(v));
    else return format_unsigned(static_cast<uint64_t>(v));
  }
  static std::string format_double(double v);
  static std::string format_signed(int64_t v);
  static std::string format_unsigned(uint64_t v);
  Family& family(Type type, std::string_view name, std::string_view help);
  void sample(Type type, std::string_view name, std::string_view help, std::string value,
              MetricLabels labels);

  std::vector<std::unique_ptr<Family>> families_;
};

// Adds a source's samples to each metrics_text(): called on the thread reading the metrics, one
// source at a time. Keep it short; it may call MetricsWriter only (not the engine that runs it).
using MetricsSource = std::function<void(MetricsWriter&)>;

class MetricsSources;  // the engine's list of sources

// A registered metrics source (TransferEngine::add_metrics_source). Destroying it, or remove(),
// removes the source: once that returns, the source is never called again (a metrics_text() that
// is calling it meanwhile is waited for, unless the source removes itself from inside its own
// call). It may outlive its engine (then it holds nothing). Move-only; hold it as a member of
// what the source reads, so that the source goes before the data it reads.
class MetricsRegistration {
 public:
  MetricsRegistration() = default;
  ~MetricsRegistration() { remove(); }
  MetricsRegistration(MetricsRegistration&& o) noexcept;
  MetricsRegistration& operator=(MetricsRegistration&& o) noexcept;
  MetricsRegistration(const MetricsRegistration&) = delete;
  MetricsRegistration& operator=(const MetricsRegistration&) = delete;

  bool registered() const { return sources_ != nullptr; }
  void remove();

 private:
  friend class MetricsSources;
  MetricsRegistration(std::shared_ptr<MetricsSources> sources, uint64_t id)
      : sources_(std::move(sources)), id_(id) {}
  std::shared_ptr<MetricsSources> sources_;
  uint64_t id_ = 0;
};

// Durations in log2 buckets, exposed in seconds: upper bounds 2^10 ns (1.024 us), 2^11 ns, ...
// 2^36 ns (68.7 s), then +Inf. observe() is lock-free (relaxed atomic adds) from any thread; a
// read beside observations may see one observation in its bucket and not yet in the sum.
class DurationHistogram {
 public:
  static constexpr size_t kBounds = 27;
  static constexpr size_t kBuckets = kBounds + 1;  // the last: above 2^36 ns
  // The bucket a duration of `ns` nanoseconds falls into (le is inclusive, as Prometheus has it).
  static size_t bucket_of(uint64_t ns) {
    if (ns <= (uint64_t{1} << 10)) return 0;
    const size_t b = static_cast<size_t>(std::bit_width(ns - 1)) - 10;
    return b < kBounds ? b : kBounds;
  }
  // The upper bounds in seconds (kBounds of them, ascending).
  static std::span<const double> upper_bounds();

  void observe(std::chrono::nanoseconds d);
  // One histogram sample set named `name` (ending "_seconds" by convention).
  void write(MetricsWriter& w, std::string_view name, std::string_view help,
             MetricLabels labels = {}) const;

 private:
  std::array<std::atomic<uint64_t>, kBuckets> counts_{};
  std::atomic<uint64_t> sum_ns_{0};
};

// The label value ("peer") the engine's per-peer metrics give a peer worker: its first NIC's
// endpoint name as text where it is printable, else in hex (a tcp sockaddr, an EFA address).
// `peer` is one worker's address (NetAddr::worker(w)); for a whole engine's address, its first
// worker's.
std::string metrics_peer_label(const NetAddr& peer);

}  // namespace fabric
