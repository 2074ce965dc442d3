// engine_config_for: a detected topology as an engine's workers (one per GPU, its rail, its cores).
#include <algorithm>

#include <fmt/format.h>

#include "fabric/error.h"
#include "fabric/topology.h"
#include "fabric/types.h"
#include "util/log.h"

namespace fabric {

namespace {

NicConfig nic_config(const TopoNic& nic) { return NicConfig{nic.domain, ""}; }

std::optional<int> cpu(int c) { return c >= 0 ? std::optional<int>(c) : std::nullopt; }

}  // namespace

EngineConfig engine_config_for(const Topology& topo, const EngineConfig& base,
                               std::span<const int> cuda_devices) {
  EngineConfig c = base;
  c.workers.clear();
  const bool has_nics = !topo.provider.empty() && !topo.nics.empty();
  if (has_nics) c.provider = topo.provider;

  std::vector<const TopoGpu*> gpus;
  if (cuda_devices.empty()) {
    for (const TopoGpu& g : topo.gpus) gpus.push_back(&g);
  } else {
    for (int d : cuda_devices) {
      auto it = std::find_if(topo.gpus.begin(), topo.gpus.end(),
                             [&](const TopoGpu& g) { return g.cuda_index == d; });
      if (it == topo.gpus.end())
        throw Error(ErrorCode::kNotFound,
                    fmt::format("engine_config_for: the topology has no GPU {} ({} GPUs detected)",
                                d, topo.gpus.size()));
      gpus.push_back(&*it);
    }
  }

  if (gpus.empty()) {  // a host without GPUs: one host-memory worker
    if (has_nics) {
      c.nics.clear();
      for (size_t i = 0; i < topo.nics.size() && i < kMaxNics; i++) c.nics.push_back(nic_config(topo.nics[i]));
    }
    return c;
  }

  size_t rail = kMaxNics;
  for (const TopoGpu* g : gpus) rail = std::min(rail, g->nics.size());
  if (has_nics && rail == 0)
    throw Error(ErrorCode::kNotFound, "engine_config_for: a chosen GPU has no NIC assigned");
  for (const TopoGpu* g : gpus) {
    if (has_nics && g->nics.size() > rail)
      log::info("engine_config_for: GPU {} uses {} of its {} NICs (every worker needs as many)",
                g->cuda_index, rail, g->nics.size());
    WorkerConfig w;
    w.cuda_device = g->cuda_index;
    w.worker_cpu = cpu(g->worker_cpu);
    w.watcher_cpu = cpu(g->watcher_cpu);
    if (has_nics) {
      w.nics.clear();
      for (size_t i = 0; i < rail; i++) w.nics.push_back(nic_config(topo.nics.at(g->nics[i])));
    } else {
      w.nics = base.nics;
    }
    c.workers.push_back(std::move(w));
  }
  return c;
}

}  // namespace fabric
