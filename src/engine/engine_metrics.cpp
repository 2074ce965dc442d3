// EngineImpl::metrics_text: the engine's metrics gathered from where the workers keep them, then
// every metrics source's, rendered by one MetricsWriter.
#include "engine/engine_impl.h"

namespace fabric {

std::string EngineImpl::metrics_text() {
  MetricsWriter w;
  w.gauge("fabric_engine_info", "The engine: its provider, workers and NICs per worker (always 1)", 1,
          {{"provider", address_.provider()},
           {"workers", std::to_string(workers_.size())},
           {"nics", std::to_string(nic_count_)}});
  metrics_sources_->collect(w);
  return w.text();
}

}  // namespace fabric
