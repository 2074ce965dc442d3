// The assignment of NICs and cores to GPUs (topology.h says the rule), over an Inventory.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "topology/inventory.h"

namespace fabric::topo {

void set_provider(TopoNic& nic) {
  if (nic.driver == "efa") {
    nic.provider = "efa";
    nic.domain = nic.name + "-rdm";  // libfabric's efa provider names its RDM domains so
  } else {
    nic.provider = "verbs";
    nic.domain = nic.name;
  }
}

namespace {

// The NICs GPU i of `gpus` gets out of `nics` (already in PCI order): with at least as many NICs
// as GPUs, consecutive runs whose sizes differ by at most one (the first GPUs get the extra ones),
// so no NIC is shared; with fewer, one NIC each, GPU i taking NIC i * nics / gpus.
std::vector<size_t> share(size_t gpus, const std::vector<size_t>& nics, size_t i) {
  const size_t n = nics.size();
  if (n == 0 || gpus == 0) return {};
  if (n < gpus) return {nics[i * n / gpus]};
  const size_t base = n / gpus, extra = n % gpus;
  const size_t first = i * base + std::min(i, extra);
  const size_t count = base + (i < extra ? 1 : 0);
  return {nics.begin() + static_cast<std::ptrdiff_t>(first),
          nics.begin() + static_cast<std::ptrdiff_t>(first + count)};
}

bool nic_order(const NicInfo& a, const NicInfo& b) {
  // By PCI address; NICs without one (virtual devices) last, by name.
  return std::tuple(a.nic.pci.empty(), a.nic.pci, a.nic.name) <
         std::tuple(b.nic.pci.empty(), b.nic.pci, b.nic.name);
}

}  // namespace

Topology assign(const Inventory& inventory) {
  Topology topo;

  std::vector<NodeInfo> nodes = inventory.nodes;
  std::sort(nodes.begin(), nodes.end(), [](const NodeInfo& a, const NodeInfo& b) { return a.id < b.id; });
  for (const NodeInfo& n : nodes) topo.numa_nodes.push_back({n.id, n.cpus});
  // A device the platform gives no node (-1) belongs to the only node when there is one.
  auto node_of = [&](int numa) { return numa < 0 && nodes.size() == 1 ? nodes[0].id : numa; };

  // NICs: active ones, of one provider. A host with both (EFA next to a ConnectX, as on
  // p6-b300) uses EFA only: one engine speaks one provider, and the EFA devices are the rails.
  std::vector<NicInfo> nics;
  for (const NicInfo& n : inventory.nics)
    if (n.nic.active) nics.push_back(n);
  const bool any_efa = std::any_of(nics.begin(), nics.end(), [](const NicInfo& n) { return n.nic.provider == "efa"; });
  if (any_efa)
    nics.erase(std::remove_if(nics.begin(), nics.end(), [](const NicInfo& n) { return n.nic.provider != "efa"; }),
               nics.end());
  std::sort(nics.begin(), nics.end(), nic_order);
  for (NicInfo& n : nics) {
    n.nic.numa_node = node_of(n.nic.numa_node);
    topo.nics.push_back(n.nic);
  }
  if (!nics.empty()) topo.provider = nics[0].nic.provider;

  // GPUs: CUDA's PCI_BUS_ID order.
  std::vector<GpuInfo> gpus = inventory.gpus;
  std::sort(gpus.begin(), gpus.end(), [](const GpuInfo& a, const GpuInfo& b) { return a.pci < b.pci; });
  for (size_t i = 0; i < gpus.size(); i++) {
    TopoGpu g;
    g.cuda_index = static_cast<int>(i);
    g.pci = gpus[i].pci;
    g.numa_node = node_of(gpus[i].numa_node);
    topo.gpus.push_back(std::move(g));
  }
  std::vector<bool> placed(gpus.size(), false);
  auto give = [&](const std::vector<size_t>& group, const std::vector<size_t>& group_nics, NicAffinity affinity) {
    for (size_t k = 0; k < group.size(); k++) {
      TopoGpu& g = topo.gpus[group[k]];
      g.nics = share(group.size(), group_nics, k);
      g.affinity = affinity;
      placed[group[k]] = true;
    }
  };

  // 1. The switch: each GPU's deepest bridge shared with any NIC. GPUs with the same one share its
  //    NICs. Where switches nest, the deeper groups choose first, and a shallower group takes the
  //    NICs they left (all of its NICs if they left none).
  struct SwitchGroup {
    size_t depth = 0;
    std::vector<size_t> gpus;
    std::vector<size_t> nics;
  };
  std::map<std::vector<std::string>, SwitchGroup> switches;  // key: root, then the bridges
  for (size_t i = 0; i < gpus.size(); i++) {
    size_t depth = 0;
    for (const NicInfo& n : nics) depth = std::max(depth, shared_bridges(gpus[i].path, n.path));
    if (depth == 0) continue;
    std::vector<std::string> key{gpus[i].path.root};
    key.insert(key.end(), gpus[i].path.chain.begin(), gpus[i].path.chain.begin() + static_cast<std::ptrdiff_t>(depth));
    SwitchGroup& s = switches[key];
    if (s.gpus.empty()) {
      s.depth = depth;
      for (size_t j = 0; j < nics.size(); j++)
        if (shared_bridges(gpus[i].path, nics[j].path) >= depth) s.nics.push_back(j);
    }
    s.gpus.push_back(i);
  }
  std::vector<const SwitchGroup*> by_depth;
  for (const auto& [key, s] : switches) by_depth.push_back(&s);
  std::stable_sort(by_depth.begin(), by_depth.end(),
                   [](const SwitchGroup* a, const SwitchGroup* b) { return a->depth > b->depth; });
  std::set<size_t> claimed;
  for (const SwitchGroup* s : by_depth) {
    std::vector<size_t> free;
    for (size_t j : s->nics)
      if (!claimed.count(j)) free.push_back(j);
    const std::vector<size_t>& use = free.empty() ? s->nics : free;
    give(s->gpus, use, NicAffinity::kSwitch);
    claimed.insert(use.begin(), use.end());
  }

  // 2. The NUMA node: GPUs left over share the NICs of their node.
  for (const NodeInfo& node : nodes) {
    std::vector<size_t> group, node_nics;
    for (size_t i = 0; i < gpus.size(); i++)
      if (!placed[i] && topo.gpus[i].numa_node == node.id) group.push_back(i);
    for (size_t j = 0; j < nics.size(); j++)
      if (topo.nics[j].numa_node == node.id) node_nics.push_back(j);
    if (!group.empty() && !node_nics.empty()) give(group, node_nics, NicAffinity::kNuma);
  }

  // 3. The host: GPUs still left over share every NIC; with no NIC at all, they get none.
  std::vector<size_t> rest, all_nics;
  for (size_t i = 0; i < gpus.size(); i++)
    if (!placed[i]) rest.push_back(i);
  for (size_t j = 0; j < nics.size(); j++) all_nics.push_back(j);
  give(rest, all_nics, all_nics.empty() ? NicAffinity::kNone : NicAffinity::kSystem);

  // Cores: per node, its physical cores but the first (left to the system; a node of one core
  // gives that one), two per GPU in CUDA order, wrapping around when the node runs out.
  std::map<int, size_t> taken;  // node id -> GPUs served so far
  for (TopoGpu& g : topo.gpus) {
    auto node = std::find_if(nodes.begin(), nodes.end(), [&](const NodeInfo& n) { return n.id == g.numa_node; });
    if (g.numa_node < 0 || node == nodes.end() || node->cores.empty()) continue;
    const std::vector<int>& c = node->cores;
    const size_t skip = c.size() > 1 ? 1 : 0;
    const size_t m = c.size() - skip;
    const size_t k = taken[node->id]++;
    g.worker_cpu = c[skip + (2 * k) % m];
    g.watcher_cpu = c[skip + (2 * k + 1) % m];
  }
  return topo;
}

}  // namespace fabric::topo
