// What detect_topology reads from sysfs (enumerate, detect.cpp) and the policy that turns it into a
// Topology (assign, assign.cpp). assign is a pure function of the Inventory so that unit tests can
// drive the policy with hand-made machines; enumerate only reads and parses.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/topology.h"

namespace fabric::topo {

class SysfsTree;

// Where a PCI device sits, from its resolved sysfs path
// ("devices/pci0000:44/0000:44:00.0/0000:45:00.0/0000:46:01.4/0000:53:00.0").
struct PciPath {
  std::string root;                // what precedes the first PCI address: "devices/pci0000:44"
  std::vector<std::string> chain;  // PCI addresses from the first bridge down to the device itself

  // Empty root and chain when the path holds no PCI address (a virtual device such as rxe0).
  static PciPath parse(std::string_view resolved);
};

// True for a PCI address as sysfs names devices: "0000:53:00.0" (a domain of 4 or more hex digits).
bool is_pci_address(std::string_view s);

// How many PCI bridges two devices share below the host bridge: the length of the common part of
// their chains, each without the device itself. 0 when they share none (or sit under different
// host bridges): then no switch joins them.
size_t shared_bridges(const PciPath& a, const PciPath& b);

struct GpuInfo {
  std::string pci;
  int numa_node = -1;
  PciPath path;
};

struct NicInfo {
  TopoNic nic;
  PciPath path;
};

struct NodeInfo {
  int id = 0;
  std::vector<int> cpus;   // every logical CPU, ascending
  std::vector<int> cores;  // one logical CPU per physical core (its lowest), ascending
};

struct Inventory {
  std::vector<GpuInfo> gpus;    // NVIDIA display and 3D controllers, any order
  std::vector<NicInfo> nics;    // every entry of class/infiniband, active or not, any order
  std::vector<NodeInfo> nodes;  // NUMA nodes, any order
};

// Reads the inventory from a sysfs tree (missing files leave fields at their defaults).
Inventory enumerate(const SysfsTree& sysfs);

// The assignment topology.h describes: NICs kept (active, one provider), GPUs numbered in PCI
// order, and each GPU's NICs, affinity and cores.
Topology assign(const Inventory& inventory);

// Sets nic.provider and nic.domain from nic.driver: "efa" (domain "<name>-rdm") or "verbs".
void set_provider(TopoNic& nic);

// "0-47,96-143" -> {0..47, 96..143}; malformed pieces are skipped.
std::vector<int> parse_cpulist(std::string_view list);
// {0..47, 96..143} -> "0-47,96-143".
std::string format_cpulist(const std::vector<int>& cpus);
// "400 Gb/sec (4X NDR)", "100 Gb/sec" -> 400, 100.
std::optional<double> parse_rate_gbps(std::string_view rate);
// "4: ACTIVE" -> true; "1: DOWN", "5: ACTIVE_DEFER" -> false.
bool parse_port_active(std::string_view state);

}  // namespace fabric::topo
