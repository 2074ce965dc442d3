// MetricsSources: the metrics sources added to one engine (TransferEngine::add_metrics_source),
// called in the order they were added each time the metrics are read. Shared by the engine and
// every MetricsRegistration, so a registration may outlive its engine.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "fabric/metrics.h"

namespace fabric {

class MetricsSources : public std::enable_shared_from_this<MetricsSources> {
 public:
  // Throws kShutdown once closed.
  MetricsRegistration add(MetricsSource source);
  // Once it returns the source is never called again: it waits for a collect() calling it on
  // another thread (the lock is held while sources run); from inside a source's own call (the
  // lock is recursive) the source still running finishes, then nothing more calls it.
  void remove(uint64_t id);
  // Calls every source with `w`. A source that throws ends the collection with its error.
  void collect(MetricsWriter& w);
  // The engine closes: every source is dropped (what it captured is released now).
  void close();

 private:
  std::recursive_mutex mu_;
  bool closed_ = false;
  uint64_t next_id_ = 1;
  // shared_ptr: a source that removes itself (or another) inside collect() is kept alive by the
  // caller's copy until its call returns.
  std::map<uint64_t, std::shared_ptr<MetricsSource>> sources_;
};

}  // namespace fabric
