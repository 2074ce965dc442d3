// MetricsSources and MetricsRegistration: adding, calling and removing metrics sources.
#include "metrics/metrics_sources.h"

#include <vector>

#include "fabric/error.h"

namespace fabric {

MetricsRegistration MetricsSources::add(MetricsSource source) {
  if (!source) throw Error(ErrorCode::kInvalidArgument, "add_metrics_source: the source is empty");
  std::lock_guard l(mu_);
  if (closed_) throw Error(ErrorCode::kShutdown, "add_metrics_source: the engine is closing");
  const uint64_t id = next_id_++;
  sources_.emplace(id, std::make_shared<MetricsSource>(std::move(source)));
  return MetricsRegistration(shared_from_this(), id);
}

void MetricsSources::remove(uint64_t id) {
  std::shared_ptr<MetricsSource> gone;  // destroyed after the lock is let go
  std::lock_guard l(mu_);
  auto it = sources_.find(id);
  if (it == sources_.end()) return;
  gone = std::move(it->second);
  sources_.erase(it);
}

void MetricsSources::collect(MetricsWriter& w) {
  std::lock_guard l(mu_);
  // Ids first: a source may add or remove sources (itself included) while it runs.
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : sources_) ids.push_back(id);
  for (uint64_t id : ids) {
    auto it = sources_.find(id);
    if (it == sources_.end()) continue;  // removed by a source called before it
    std::shared_ptr<MetricsSource> s = it->second;
    (*s)(w);
  }
}

void MetricsSources::close() {
  std::map<uint64_t, std::shared_ptr<MetricsSource>> gone;
  std::lock_guard l(mu_);
  closed_ = true;
  gone.swap(sources_);
}

MetricsRegistration::MetricsRegistration(MetricsRegistration&& o) noexcept
    : sources_(std::move(o.sources_)), id_(o.id_) {}

MetricsRegistration& MetricsRegistration::operator=(MetricsRegistration&& o) noexcept {
  if (this != &o) {
    remove();
    sources_ = std::move(o.sources_);
    id_ = o.id_;
  }
  return *this;
}

void MetricsRegistration::remove() {
  if (auto s = std::move(sources_)) s->remove(id_);
}

}  // namespace fabric
