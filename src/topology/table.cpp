// Topology::to_table(): what `fabric-bench topo` prints.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fabric/topology.h"
#include "topology/inventory.h"

namespace fabric {

namespace {

std::string gbps(double v) {
  if (v <= 0) return "? Gb/s";
  if (v == static_cast<double>(static_cast<long>(v))) return fmt::format("{} Gb/s", static_cast<long>(v));
  return fmt::format("{:g} Gb/s", v);
}

std::string_view affinity_name(NicAffinity a) {
  switch (a) {
    case NicAffinity::kSwitch: return "switch";
    case NicAffinity::kNuma: return "numa";
    case NicAffinity::kSystem: return "system";
    case NicAffinity::kNone: return "none";
  }
  return "?";
}

std::string num_or_dash(int v) { return v < 0 ? "-" : std::to_string(v); }

// "mlx5_0 mlx5_1 (2 x 400 Gb/s)" when the speeds agree, else "mlx5_0 (400 Gb/s), mlx5_8 (200 Gb/s)".
std::string nic_list(const Topology& t, const std::vector<size_t>& idx) {
  if (idx.empty()) return "-";
  std::string out;
  bool same = std::all_of(idx.begin(), idx.end(),
                          [&](size_t i) { return t.nics[i].link_gbps == t.nics[idx[0]].link_gbps; });
  for (size_t i : idx) {
    if (!out.empty()) out += same ? " " : ", ";
    out += t.nics[i].name;
    if (!same) out += " (" + gbps(t.nics[i].link_gbps) + ")";
  }
  if (same) out += idx.size() == 1 ? fmt::format(" ({})", gbps(t.nics[idx[0]].link_gbps))
                                   : fmt::format(" ({} x {})", idx.size(), gbps(t.nics[idx[0]].link_gbps));
  return out;
}

// Rows of cells, columns padded to their widest cell (the last column is not padded).
std::string columns(const std::vector<std::vector<std::string>>& rows, std::string_view indent) {
  std::vector<size_t> width;
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); c++) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], r[c].size());
    }
  std::string out;
  for (const auto& r : rows) {
    std::string line(indent);
    for (size_t c = 0; c < r.size(); c++) {
      line += r[c];
      if (c + 1 < r.size()) line += std::string(width[c] - r[c].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace

std::string Topology::to_table() const {
  std::string out = fmt::format("{} GPU(s), {} RDMA NIC(s){}, {} NUMA node(s)\n", gpus.size(), nics.size(),
                                provider.empty() ? "" : " (provider " + provider + ")", numa_nodes.size());
  if (!gpus.empty()) {
    std::vector<std::vector<std::string>> rows{{"GPU", "PCI", "NUMA", "worker", "watcher", "NICs", "affinity"}};
    for (const TopoGpu& g : gpus)
      rows.push_back({std::to_string(g.cuda_index), g.pci, num_or_dash(g.numa_node), num_or_dash(g.worker_cpu),
                      num_or_dash(g.watcher_cpu), nic_list(*this, g.nics), std::string(affinity_name(g.affinity))});
    out += columns(rows, "");
  }
  std::vector<bool> used(nics.size(), false);
  for (const TopoGpu& g : gpus)
    for (size_t i : g.nics)
      if (i < used.size()) used[i] = true;
  std::vector<std::vector<std::string>> unused;
  for (size_t i = 0; i < nics.size(); i++)
    if (!used[i]) {
      const TopoNic& n = nics[i];
      unused.push_back({n.name, n.pci.empty() ? "-" : n.pci, "NUMA " + num_or_dash(n.numa_node),
                        gbps(n.link_gbps), n.driver.empty() ? "-" : n.driver});
    }
  if (!unused.empty()) out += gpus.empty() ? "NICs:\n" + columns(unused, "  ") : "NICs no GPU uses:\n" + columns(unused, "  ");
  for (const TopoNumaNode& n : numa_nodes)
    out += fmt::format("NUMA node {}: {} CPU(s) {}\n", n.id, n.cpus.size(), topo::format_cpulist(n.cpus));
  return out;
}

}  // namespace fabric
