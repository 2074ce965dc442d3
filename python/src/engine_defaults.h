// The configuration a Python TransferEngine starts from: what the caller gave, else the FABRIC_*
// environment as C++'s EngineConfig::from_env reads it, else the provider's own defaults (tcp: the
// loopback address; efa: the NICs detect_topology() assigns to the engine's GPU; the others: the
// provider's default domain, as shm needs no address).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "fabric/topology.h"

namespace fabric::py {

// The NICs a provider uses when nobody named any.
inline std::vector<NicConfig> default_nics(const std::string& provider, std::optional<int> cuda_device) {
  if (provider.rfind("tcp", 0) == 0) return {NicConfig{"", "127.0.0.1"}};
  if (provider == "efa") {
    Topology t;
    try {
      t = detect_topology();
    } catch (const Error&) {
      return {NicConfig{}};  // no sysfs to read: libfabric's first EFA domain
    }
    const int gpu = cuda_device.value_or(0);
    std::vector<NicConfig> out;
    for (const TopoGpu& g : t.gpus)
      if (g.cuda_index == gpu)
        for (size_t i : g.nics) out.push_back(NicConfig{t.nics.at(i).domain, ""});
    if (out.empty())  // no GPU known: every EFA NIC of the host, up to a rail's width
      for (const TopoNic& n : t.nics)
        if (n.provider == "efa" && out.size() < kMaxNics) out.push_back(NicConfig{n.domain, ""});
    if (!out.empty()) return out;
  }
  return {NicConfig{}};
}

inline EngineConfig python_engine_config(const std::optional<std::string>& provider,
                                         const std::optional<std::vector<std::string>>& nics,
                                         std::optional<int> cuda_device) {
  EngineConfig c = EngineConfig::from_env();
  if (provider) c.provider = *provider;
  if (cuda_device) c.cuda_device = cuda_device;
  if (nics) {
    // An explicit empty list is an error, as in C++ (docs/api.md).
    if (nics->empty() || nics->size() > kMaxNics)
      throw Error(ErrorCode::kInvalidArgument,
                  "TransferEngine(nics=...) must list 1 to " + std::to_string(kMaxNics) + " NICs, it lists " +
                      std::to_string(nics->size()) +
                      " (leave it out for the provider's default: 127.0.0.1 for tcp, the default "
                      "domain for shm, the detected NICs for efa; \"\" picks the provider's default domain)");
    c.nics.clear();
    for (const std::string& n : *nics) c.nics.push_back(NicConfig::parse(c.provider, n));
  } else if (const char* env = std::getenv("FABRIC_NICS"); env && *env) {
    // Read again for the provider chosen here (verbs names devices, libfabric addresses).
    c.nics = NicConfig::parse_list(c.provider, env);
  } else {
    c.nics = default_nics(c.provider, c.cuda_device);
  }
  return c;
}

}  // namespace fabric::py
