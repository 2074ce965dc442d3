// The host as the engine sees it: GPUs, RDMA NICs, the PCIe switches they sit behind, NUMA nodes
// and their cores; and which NICs and cores serve each GPU. Read from sysfs (docs/architecture.md
// says why not hwloc). engine_config_for turns it into a multi-GPU engine's workers.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/config.h"

namespace fabric {

// One RDMA NIC: a verbs device (ConnectX: "mlx5_0") or an EFA device ("rdmap16s27"), both listed
// under /sys/class/infiniband.
struct TopoNic {
  std::string name;       // the device name: "mlx5_0", "rdmap16s27"
  std::string pci;        // "0000:16:00.0"
  std::string driver;     // "mlx5_core", "efa", ... ("" when unknown)
  std::string provider;   // what EngineConfig::provider must say to use it: "efa" or "verbs"
  std::string domain;     // NicConfig::domain: libfabric's domain ("rdmap16s27-rdm"), verbs' device
  int numa_node = -1;     // -1 when the platform does not say
  double link_gbps = 0;   // port 1's rate (0 when unknown)
  bool active = false;    // port 1 is ACTIVE
};

// How close a GPU's NICs are (the best of them), as NCCL names PCIe distances.
enum class NicAffinity {
  kSwitch,  // behind the same PCIe switch as the GPU
  kNuma,    // on the GPU's NUMA node, under another switch or root port
  kSystem,  // on another NUMA node (traffic crosses the CPU interconnect)
  kNone,    // no RDMA NIC on the host
};

struct TopoGpu {
  int cuda_index = -1;    // the CUDA device index (PCI bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID)
  std::string pci;        // "0000:53:00.0"
  int numa_node = -1;
  std::vector<size_t> nics;  // indices into Topology::nics: this GPU's rail, in rail order
  NicAffinity affinity = NicAffinity::kNone;
  int worker_cpu = -1;    // a core of its NUMA node for its worker thread (-1: none known)
  int watcher_cpu = -1;   // and another for its UVM watcher thread
};

struct TopoNumaNode {
  int id = 0;
  std::vector<int> cpus;  // every logical CPU of the node
};

struct Topology {
  std::vector<TopoGpu> gpus;        // by CUDA index
  std::vector<TopoNic> nics;        // active RDMA NICs, by PCI address
  std::vector<TopoNumaNode> numa_nodes;
  // The provider every NIC above speaks ("efa" or "verbs"), "" when there is no RDMA NIC. A host
  // with both EFA and verbs NICs keeps the EFA ones only (one engine speaks one provider).
  std::string provider;

  // A readable table: one line per GPU (PCI, NUMA node, NICs with link speed, cores), then the
  // NICs no GPU uses. What `fabric-bench topo` prints.
  std::string to_table() const;
};

struct TopologyOptions {
  // Where sysfs is mounted. Tests point it at a recorded tree (tests/topology/fixtures).
  std::string sysfs_root = "/sys";
};

// Reads the host's topology and assigns each GPU its NICs and cores:
// - a GPU gets the NICs behind its own PCIe switch (the deepest bridge they share); when several
//   GPUs share a switch its NICs are split evenly between them in PCI order (runs whose sizes
//   differ by at most one; a GPU gets a shared NIC only when the switch has fewer NICs than GPUs);
// - a GPU with no NIC under its switch gets those of its NUMA node, split the same way, and failing
//   that all NICs of the host;
// - each GPU gets two cores of its NUMA node (worker, watcher): one logical CPU per physical core,
//   the node's first core left to the system, GPUs of a node taking theirs in CUDA order
//   (wrapping around when the node runs out). A device whose numa_node is -1 belongs to the node
//   when the host has one, else to none (its GPU gets no cores).
// Throws fabric::Error(kNotFound) when sysfs_root has no PCI bus (not a sysfs tree).
Topology detect_topology(const TopologyOptions& options = {});

// An engine serving the chosen GPUs of the host (all of them when `cuda_devices` is empty), one
// worker per GPU with the NICs and cores detect_topology gave it. Everything else (polling,
// timeouts, cuda_ipc, limits) comes from `base`. Where the host has no RDMA NIC, every worker gets
// base.nics on base.provider (loopback tcp, shm): same-host GPUs still reach each other through
// cuda_ipc. A host without GPUs gives one host-memory worker on the NICs of the host (at most 4).
// The rail width is the smallest NIC count among the chosen GPUs (at most kMaxNics), so that
// every worker has as many. Throws kNotFound for a GPU the topology does not have.
EngineConfig engine_config_for(const Topology& topology, const EngineConfig& base = {},
                               std::span<const int> cuda_devices = {});

}  // namespace fabric
