// Enumerating GPUs, RDMA NICs and NUMA nodes from sysfs, and detect_topology itself.
#include <algorithm>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "fabric/error.h"
#include "fabric/topology.h"
#include "topology/inventory.h"
#include "topology/sysfs.h"

namespace fabric::topo {

namespace {

constexpr std::string_view kNvidiaVendor = "0x10de";

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// "node12" -> 12; anything else (has_cpu, online, power, ...) -> none.
std::optional<int> numbered(std::string_view name, std::string_view prefix) {
  if (!starts_with(name, prefix) || name.size() == prefix.size()) return std::nullopt;
  int v = 0;
  for (char c : name.substr(prefix.size())) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
    if (v > (1 << 24)) return std::nullopt;
  }
  return v;
}

std::vector<GpuInfo> enumerate_gpus(const SysfsTree& t) {
  std::vector<GpuInfo> gpus;
  for (const std::string& bdf : t.list("bus/pci/devices")) {
    const std::string dir = "bus/pci/devices/" + bdf;
    auto vendor = t.read(dir + "/vendor");
    auto cls = t.read(dir + "/class");
    if (!vendor || !cls || lower(*vendor) != kNvidiaVendor) continue;
    // PCI class 03 (display) subclass 02 (3D controller: H100, H200) or 00 (VGA).
    const std::string c = lower(*cls);
    if (!starts_with(c, "0x0302") && !starts_with(c, "0x0300")) continue;
    GpuInfo g;
    g.pci = bdf;
    g.numa_node = static_cast<int>(t.read_int(dir + "/numa_node").value_or(-1));
    if (auto resolved = t.resolve(dir)) g.path = PciPath::parse(*resolved);
    gpus.push_back(std::move(g));
  }
  return gpus;
}

std::vector<NicInfo> enumerate_nics(const SysfsTree& t) {
  std::vector<NicInfo> nics;
  for (const std::string& name : t.list("class/infiniband")) {
    const std::string dir = "class/infiniband/" + name;
    NicInfo n;
    n.nic.name = name;
    if (auto device = t.resolve(dir + "/device")) {
      n.path = PciPath::parse(*device);
      if (!n.path.chain.empty()) n.nic.pci = n.path.chain.back();
    }
    if (auto driver = t.link_target(dir + "/device/driver")) {
      std::vector<std::string> parts = split_path(*driver);
      if (!parts.empty()) n.nic.driver = parts.back();
    }
    n.nic.numa_node = static_cast<int>(t.read_int(dir + "/device/numa_node").value_or(-1));
    if (auto rate = t.read(dir + "/ports/1/rate")) n.nic.link_gbps = parse_rate_gbps(*rate).value_or(0);
    if (auto state = t.read(dir + "/ports/1/state")) n.nic.active = parse_port_active(*state);
    set_provider(n.nic);
    nics.push_back(std::move(n));
  }
  return nics;
}

// One logical CPU per physical core: CPUs with the same (physical_package_id, core_id) are
// hyperthreads of one core; where the files are missing, each CPU is its own core.
std::vector<int> physical_cores(const SysfsTree& t, const std::vector<int>& cpus) {
  std::map<std::pair<long, long>, int> lowest;  // (package, core) -> lowest CPU
  std::vector<int> cores;
  for (int cpu : cpus) {
    const std::string dir = fmt::format("devices/system/cpu/cpu{}/topology", cpu);
    auto core = t.read_int(dir + "/core_id");
    auto package = t.read_int(dir + "/physical_package_id");
    if (!core || !package) {
      cores.push_back(cpu);
      continue;
    }
    auto [it, inserted] = lowest.emplace(std::pair{*package, *core}, cpu);
    if (!inserted) it->second = std::min(it->second, cpu);
  }
  for (const auto& [key, cpu] : lowest) cores.push_back(cpu);
  std::sort(cores.begin(), cores.end());
  return cores;
}

std::vector<NodeInfo> enumerate_nodes(const SysfsTree& t) {
  std::vector<NodeInfo> nodes;
  for (const std::string& name : t.list("devices/system/node")) {
    auto id = numbered(name, "node");
    if (!id) continue;
    NodeInfo n;
    n.id = *id;
    n.cpus = parse_cpulist(t.read("devices/system/node/" + name + "/cpulist").value_or(""));
    nodes.push_back(std::move(n));
  }
  if (nodes.empty()) {
    // A kernel without NUMA support: one node 0 holding every online CPU.
    NodeInfo n;
    if (auto online = t.read("devices/system/cpu/online")) {
      n.cpus = parse_cpulist(*online);
    } else {
      for (const std::string& name : t.list("devices/system/cpu"))
        if (auto cpu = numbered(name, "cpu")) n.cpus.push_back(*cpu);
      std::sort(n.cpus.begin(), n.cpus.end());
    }
    nodes.push_back(std::move(n));
  }
  for (NodeInfo& n : nodes) n.cores = physical_cores(t, n.cpus);
  return nodes;
}

}  // namespace

Inventory enumerate(const SysfsTree& sysfs) {
  Inventory inv;
  inv.gpus = enumerate_gpus(sysfs);
  inv.nics = enumerate_nics(sysfs);
  inv.nodes = enumerate_nodes(sysfs);
  return inv;
}

}  // namespace fabric::topo

namespace fabric {

Topology detect_topology(const TopologyOptions& options) {
  topo::SysfsTree sysfs(options.sysfs_root);
  if (!sysfs.is_dir("bus/pci/devices"))
    throw Error(ErrorCode::kNotFound,
                fmt::format("detect_topology: {} has no bus/pci/devices: not a sysfs tree "
                            "(TopologyOptions::sysfs_root)",
                            sysfs.root()));
  return topo::assign(topo::enumerate(sysfs));
}

}  // namespace fabric
