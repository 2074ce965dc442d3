// detect_topology: the recorded and reconstructed machines of tests/topology/fixtures (each
// materialised into a temporary directory and read as a sysfs root), the assignment policy as a
// pure function over hand-made inventories, the sysfs reader's edge cases, and the live /sys.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fabric/error.h"
#include "fabric/topology.h"
#include "topology/inventory.h"
#include "topology/sysfs.h"

#ifndef FABRIC_TOPOLOGY_FIXTURES
#error "FABRIC_TOPOLOGY_FIXTURES must name tests/topology/fixtures"
#endif

namespace fabric {
namespace {

namespace fs = std::filesystem;
using topo::Inventory;

// A temporary directory, removed with everything under it.
class TempDir {
 public:
  TempDir() {
    // tmpfs where there is one (TMPDIR still wins): a fixture is hundreds of files and
    // directories, which on a busy disk took 2 s per machine instead of 50 ms.
    fs::path base = fs::temp_directory_path();
    if (!getenv("TMPDIR") && access("/dev/shm", W_OK | X_OK) == 0) base = "/dev/shm";
    std::string tmpl = (base / "fabric-topo-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      out += s[i + 1] == 'n' ? '\n' : s[i + 1];
      i++;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Builds the tree a fixture describes (format: tests/topology/record_sysfs.py) under `root`.
void materialize(const fs::path& fixture, const fs::path& root) {
  std::ifstream in(fixture);
  ASSERT_TRUE(in) << "cannot open " << fixture;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    n++;
    if (line.empty() || line[0] == '#') continue;
    size_t sp1 = line.find(' ');
    ASSERT_NE(sp1, std::string::npos) << fixture << ":" << n;
    size_t sp2 = line.find(' ', sp1 + 1);
    const std::string kind = line.substr(0, sp1);
    const std::string rel = line.substr(sp1 + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp1 - 1);
    const std::string rest = sp2 == std::string::npos ? "" : line.substr(sp2 + 1);
    const fs::path p = root / rel;
    if (kind == "d") {
      fs::create_directories(p);
    } else if (kind == "f") {
      fs::create_directories(p.parent_path());
      std::ofstream(p) << unescape(rest) << "\n";
    } else if (kind == "l") {
      ASSERT_FALSE(rest.empty()) << fixture << ":" << n;
      fs::create_directories(p.parent_path());
      fs::create_symlink(rest, p);
    } else {
      FAIL() << fixture << ":" << n << ": cannot parse " << line;
    }
  }
}

Topology detect_fixture(const std::string& machine) {
  TempDir dir;
  materialize(fs::path(FABRIC_TOPOLOGY_FIXTURES) / (machine + ".sysfs"), dir.path());
  return detect_topology({.sysfs_root = dir.path().string()});
}

std::vector<std::string> nic_names(const Topology& t, const TopoGpu& g) {
  std::vector<std::string> names;
  for (size_t i : g.nics) names.push_back(i < t.nics.size() ? t.nics[i].name : "<bad index>");
  return names;
}

struct ExpectGpu {
  std::string pci;
  int numa_node;
  std::vector<std::string> nics;
  NicAffinity affinity;
  int worker_cpu, watcher_cpu;
};

void expect_gpus(const Topology& t, const std::vector<ExpectGpu>& want) {
  ASSERT_EQ(t.gpus.size(), want.size()) << t.to_table();
  for (size_t i = 0; i < want.size(); i++) {
    const TopoGpu& g = t.gpus[i];
    SCOPED_TRACE("GPU " + std::to_string(i));
    EXPECT_EQ(g.cuda_index, static_cast<int>(i));
    EXPECT_EQ(g.pci, want[i].pci);
    EXPECT_EQ(g.numa_node, want[i].numa_node);
    EXPECT_EQ(nic_names(t, g), want[i].nics);
    EXPECT_EQ(g.affinity, want[i].affinity);
    EXPECT_EQ(g.worker_cpu, want[i].worker_cpu);
    EXPECT_EQ(g.watcher_cpu, want[i].watcher_cpu);
  }
}

std::vector<int> range(int lo, int hi) {  // [lo, hi]
  std::vector<int> v;
  for (int i = lo; i <= hi; i++) v.push_back(i);
  return v;
}

std::vector<int> concat(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void expect_nodes(const Topology& t, const std::map<int, std::vector<int>>& want) {
  ASSERT_EQ(t.numa_nodes.size(), want.size());
  size_t i = 0;
  for (const auto& [id, cpus] : want) {
    EXPECT_EQ(t.numa_nodes[i].id, id);
    EXPECT_EQ(t.numa_nodes[i].cpus, cpus) << "node " << id;
    i++;
  }
}

// ---- the fixtures ----

TEST(TopologyFixture, P5_48xlarge) {
  Topology t = detect_fixture("p5.48xlarge");
  SCOPED_TRACE(t.to_table());
  EXPECT_EQ(t.provider, "efa");
  ASSERT_EQ(t.nics.size(), 32u);
  for (const TopoNic& n : t.nics) {
    EXPECT_EQ(n.driver, "efa");
    EXPECT_EQ(n.provider, "efa");
    EXPECT_EQ(n.domain, n.name + "-rdm");
    EXPECT_EQ(n.link_gbps, 100.0);
    EXPECT_TRUE(n.active);
  }
  EXPECT_EQ(t.nics[0].name, "rdmap79s0");
  EXPECT_EQ(t.nics[0].pci, "0000:4f:00.0");
  EXPECT_EQ(t.nics[0].numa_node, 0);
  EXPECT_EQ(t.nics[31].name, "rdmap201s0");
  EXPECT_EQ(t.nics[31].numa_node, 1);
  auto four = [](int bus) {
    std::vector<std::string> v;
    for (int i = 0; i < 4; i++) v.push_back("rdmap" + std::to_string(bus + i) + "s0");
    return v;
  };
  expect_gpus(t, {
                     {"0000:53:00.0", 0, four(79), NicAffinity::kSwitch, 1, 2},
                     {"0000:64:00.0", 0, four(96), NicAffinity::kSwitch, 3, 4},
                     {"0000:75:00.0", 0, four(113), NicAffinity::kSwitch, 5, 6},
                     {"0000:86:00.0", 0, four(130), NicAffinity::kSwitch, 7, 8},
                     {"0000:97:00.0", 1, four(147), NicAffinity::kSwitch, 49, 50},
                     {"0000:a8:00.0", 1, four(164), NicAffinity::kSwitch, 51, 52},
                     {"0000:b9:00.0", 1, four(181), NicAffinity::kSwitch, 53, 54},
                     {"0000:ca:00.0", 1, four(198), NicAffinity::kSwitch, 55, 56},
                 });
  expect_nodes(t, {{0, concat(range(0, 47), range(96, 143))}, {1, concat(range(48, 95), range(144, 191))}});
}

TEST(TopologyFixture, P5en_48xlarge) {
  Topology t = detect_fixture("p5en.48xlarge");
  SCOPED_TRACE(t.to_table());
  EXPECT_EQ(t.provider, "efa");
  ASSERT_EQ(t.nics.size(), 16u);
  for (const TopoNic& n : t.nics) {
    EXPECT_EQ(n.link_gbps, 200.0);
    EXPECT_EQ(n.domain, n.name + "-rdm");
  }
  using V = std::vector<std::string>;
  expect_gpus(t, {
                     {"0000:59:00.0", 0, V{"rdmap85s0", "rdmap86s0"}, NicAffinity::kSwitch, 1, 2},
                     {"0000:5a:00.0", 0, V{"rdmap87s0", "rdmap88s0"}, NicAffinity::kSwitch, 3, 4},
                     {"0000:72:00.0", 0, V{"rdmap110s0", "rdmap111s0"}, NicAffinity::kSwitch, 5, 6},
                     {"0000:73:00.0", 0, V{"rdmap112s0", "rdmap113s0"}, NicAffinity::kSwitch, 7, 8},
                     {"0000:8b:00.0", 1, V{"rdmap135s0", "rdmap136s0"}, NicAffinity::kSwitch, 49, 50},
                     {"0000:8c:00.0", 1, V{"rdmap137s0", "rdmap138s0"}, NicAffinity::kSwitch, 51, 52},
                     {"0000:a4:00.0", 1, V{"rdmap160s0", "rdmap161s0"}, NicAffinity::kSwitch, 53, 54},
                     {"0000:a5:00.0", 1, V{"rdmap162s0", "rdmap163s0"}, NicAffinity::kSwitch, 55, 56},
                 });
  expect_nodes(t, {{0, concat(range(0, 47), range(96, 143))}, {1, concat(range(48, 95), range(144, 191))}});
}

TEST(TopologyFixture, DgxH100) {
  Topology t = detect_fixture("dgx-h100");
  SCOPED_TRACE(t.to_table());
  EXPECT_EQ(t.provider, "verbs");
  ASSERT_EQ(t.nics.size(), 10u);  // 8 compute + 2 storage; the 4 NVSwitches are no GPUs
  std::map<std::string, const TopoNic*> by_name;
  for (const TopoNic& n : t.nics) by_name[n.name] = &n;
  for (int i = 0; i < 10; i++) {
    const TopoNic* n = by_name["mlx5_" + std::to_string(i)];
    ASSERT_NE(n, nullptr) << i;
    EXPECT_EQ(n->driver, "mlx5_core");
    EXPECT_EQ(n->provider, "verbs");
    EXPECT_EQ(n->domain, n->name);
    EXPECT_EQ(n->link_gbps, i < 8 ? 400.0 : 200.0) << n->name;
  }
  EXPECT_EQ(by_name["mlx5_8"]->pci, "0000:29:00.0");
  EXPECT_EQ(by_name["mlx5_9"]->numa_node, 1);
  // Each switch holds 2 GPUs and 2 NICs: split evenly, one NIC each, in PCI order.
  using V = std::vector<std::string>;
  expect_gpus(t, {
                     {"0000:1b:00.0", 0, V{"mlx5_0"}, NicAffinity::kSwitch, 1, 2},
                     {"0000:43:00.0", 0, V{"mlx5_1"}, NicAffinity::kSwitch, 3, 4},
                     {"0000:52:00.0", 0, V{"mlx5_2"}, NicAffinity::kSwitch, 5, 6},
                     {"0000:61:00.0", 0, V{"mlx5_3"}, NicAffinity::kSwitch, 7, 8},
                     {"0000:9d:00.0", 1, V{"mlx5_4"}, NicAffinity::kSwitch, 57, 58},
                     {"0000:c3:00.0", 1, V{"mlx5_5"}, NicAffinity::kSwitch, 59, 60},
                     {"0000:d1:00.0", 1, V{"mlx5_6"}, NicAffinity::kSwitch, 61, 62},
                     {"0000:df:00.0", 1, V{"mlx5_7"}, NicAffinity::kSwitch, 63, 64},
                 });
  expect_nodes(t, {{0, concat(range(0, 55), range(112, 167))}, {1, concat(range(56, 111), range(168, 223))}});
  const std::string table = t.to_table();
  EXPECT_NE(table.find("NICs no GPU uses"), std::string::npos) << table;
  EXPECT_NE(table.find("mlx5_8"), std::string::npos) << table;
}

TEST(TopologyFixture, H200OneGpuNoNic) {
  Topology t = detect_fixture("h200-1gpu-nonic");
  SCOPED_TRACE(t.to_table());
  EXPECT_EQ(t.provider, "");
  EXPECT_TRUE(t.nics.empty());
  // numa_node -1 on a machine with one node: that node. class/infiniband exists there, empty.
  expect_gpus(t, {{"0000:00:06.0", 0, {}, NicAffinity::kNone, 1, 2}});
  expect_nodes(t, {{0, range(0, 15)}});
}

TEST(TopologyFixture, CpuOnly) {
  Topology t = detect_fixture("cpu-only");
  SCOPED_TRACE(t.to_table());
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_TRUE(t.nics.empty());
  EXPECT_EQ(t.provider, "");  // this VM has no class/infiniband directory at all
  expect_nodes(t, {{0, {0, 1}}});
}

// ---- the assignment as a pure function ----

topo::GpuInfo gpu(std::string pci, int numa, const std::string& path) {
  return {std::move(pci), numa, topo::PciPath::parse("devices/" + path)};
}

topo::NicInfo nic(const std::string& name, int numa, const std::string& path, std::string driver = "mlx5_core",
                  bool active = true) {
  topo::NicInfo n;
  n.path = topo::PciPath::parse("devices/" + path);
  n.nic.name = name;
  n.nic.pci = n.path.chain.empty() ? "" : n.path.chain.back();
  n.nic.driver = std::move(driver);
  n.nic.numa_node = numa;
  n.nic.link_gbps = 400;
  n.nic.active = active;
  topo::set_provider(n.nic);
  return n;
}

topo::NodeInfo node(int id, std::vector<int> cpus) {
  topo::NodeInfo n;
  n.id = id;
  n.cores = cpus;  // no hyperthreads
  n.cpus = std::move(cpus);
  return n;
}

// A switch below root port 0000:00:01.0 of host bridge pci0000:00.
const std::string kSwitch = "pci0000:00/0000:00:01.0/0000:01:00.0";

TEST(TopologyAssign, SharedSwitchWithFewerNicsThanGpus) {
  Inventory inv;
  for (int i = 0; i < 4; i++) {
    std::string bdf = "0000:0" + std::to_string(3 + i) + ":00.0";
    inv.gpus.push_back(gpu(bdf, 0, kSwitch + "/0000:02:0" + std::to_string(i) + ".0/" + bdf));
  }
  inv.nics.push_back(nic("nicB", 0, kSwitch + "/0000:02:05.0/0000:08:00.0"));
  inv.nics.push_back(nic("nicA", 0, kSwitch + "/0000:02:04.0/0000:07:00.0"));
  inv.nodes.push_back(node(0, range(0, 15)));
  Topology t = topo::assign(inv);
  // nicA first: PCI order, not the order of class/infiniband.
  expect_gpus(t, {
                     {"0000:03:00.0", 0, {"nicA"}, NicAffinity::kSwitch, 1, 2},
                     {"0000:04:00.0", 0, {"nicA"}, NicAffinity::kSwitch, 3, 4},
                     {"0000:05:00.0", 0, {"nicB"}, NicAffinity::kSwitch, 5, 6},
                     {"0000:06:00.0", 0, {"nicB"}, NicAffinity::kSwitch, 7, 8},
                 });
  EXPECT_EQ(t.provider, "verbs");
}

TEST(TopologyAssign, SharedSwitchWithMoreNicsThanGpusSplitsWithoutSharing) {
  Inventory inv;
  inv.gpus.push_back(gpu("0000:03:00.0", 0, kSwitch + "/0000:02:00.0/0000:03:00.0"));
  inv.gpus.push_back(gpu("0000:04:00.0", 0, kSwitch + "/0000:02:01.0/0000:04:00.0"));
  for (int i = 0; i < 3; i++)
    inv.nics.push_back(nic("n" + std::to_string(i), 0,
                           kSwitch + "/0000:02:0" + std::to_string(2 + i) + ".0/0000:0" + std::to_string(5 + i) + ":00.0"));
  inv.nodes.push_back(node(0, range(0, 15)));
  Topology t = topo::assign(inv);
  expect_gpus(t, {
                     {"0000:03:00.0", 0, {"n0", "n1"}, NicAffinity::kSwitch, 1, 2},
                     {"0000:04:00.0", 0, {"n2"}, NicAffinity::kSwitch, 3, 4},
                 });
}

TEST(TopologyAssign, GpuWithoutSwitchNicTakesItsNumaNodesNics) {
  Inventory inv;
  // Node 1: a GPU and a NIC behind one switch.
  inv.gpus.push_back(gpu("0000:83:00.0", 1, "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0"));
  inv.nics.push_back(nic("n1", 1, "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0"));
  // Node 0: two GPUs and two NICs, each on a root port of its own (no switch shared).
  inv.gpus.push_back(gpu("0000:01:00.0", 0, "pci0000:00/0000:00:01.0/0000:01:00.0"));
  inv.gpus.push_back(gpu("0000:02:00.0", 0, "pci0000:00/0000:00:02.0/0000:02:00.0"));
  inv.nics.push_back(nic("n0b", 0, "pci0000:00/0000:00:04.0/0000:04:00.0"));
  inv.nics.push_back(nic("n0a", 0, "pci0000:00/0000:00:03.0/0000:03:00.0"));
  // Both GPUs sit under host bridge pci0000:00 like the NICs: a host bridge is no switch.
  inv.nodes.push_back(node(0, range(0, 7)));
  inv.nodes.push_back(node(1, range(8, 15)));
  Topology t = topo::assign(inv);
  expect_gpus(t, {
                     {"0000:01:00.0", 0, {"n0a"}, NicAffinity::kNuma, 1, 2},
                     {"0000:02:00.0", 0, {"n0b"}, NicAffinity::kNuma, 3, 4},
                     {"0000:83:00.0", 1, {"n1"}, NicAffinity::kSwitch, 9, 10},
                 });
}

TEST(TopologyAssign, GpuOnANodeWithoutNicsTakesTheHostsNics) {
  Inventory inv;
  inv.gpus.push_back(gpu("0000:81:00.0", 1, "pci0000:80/0000:80:01.0/0000:81:00.0"));
  inv.gpus.push_back(gpu("0000:82:00.0", 1, "pci0000:80/0000:80:02.0/0000:82:00.0"));
  inv.nics.push_back(nic("n0", 0, "pci0000:00/0000:00:03.0/0000:03:00.0"));
  inv.nics.push_back(nic("n1", 0, "pci0000:00/0000:00:04.0/0000:04:00.0"));
  inv.nodes.push_back(node(0, range(0, 7)));
  inv.nodes.push_back(node(1, range(8, 15)));
  Topology t = topo::assign(inv);
  expect_gpus(t, {
                     {"0000:81:00.0", 1, {"n0"}, NicAffinity::kSystem, 9, 10},
                     {"0000:82:00.0", 1, {"n1"}, NicAffinity::kSystem, 11, 12},
                 });
}

TEST(TopologyAssign, NoNicsAtAll) {
  Inventory inv;
  inv.gpus.push_back(gpu("0000:01:00.0", 0, "pci0000:00/0000:00:01.0/0000:01:00.0"));
  inv.gpus.push_back(gpu("0000:02:00.0", 0, "pci0000:00/0000:00:02.0/0000:02:00.0"));
  inv.nics.push_back(nic("down", 0, "pci0000:00/0000:00:03.0/0000:03:00.0", "mlx5_core", /*active=*/false));
  inv.nodes.push_back(node(0, range(0, 7)));
  Topology t = topo::assign(inv);
  EXPECT_TRUE(t.nics.empty());  // only active NICs are kept
  EXPECT_EQ(t.provider, "");
  expect_gpus(t, {
                     {"0000:01:00.0", 0, {}, NicAffinity::kNone, 1, 2},
                     {"0000:02:00.0", 0, {}, NicAffinity::kNone, 3, 4},
                 });
  EXPECT_NE(t.to_table().find("none"), std::string::npos);
}

TEST(TopologyAssign, CoresWrapAroundWithinTheNode) {
  Inventory inv;
  for (int i = 0; i < 3; i++) {
    std::string bdf = "0000:0" + std::to_string(1 + i) + ":00.0";
    inv.gpus.push_back(gpu(bdf, 0, "pci0000:00/0000:00:0" + std::to_string(1 + i) + ".0/" + bdf));
  }
  inv.gpus.push_back(gpu("0000:81:00.0", 1, "pci0000:80/0000:80:01.0/0000:81:00.0"));
  // Node 0: CPUs 0-7 on 4 physical cores (0 1 2 3, with siblings 4-7); core 0 is left alone.
  topo::NodeInfo n0;
  n0.id = 0;
  n0.cpus = range(0, 7);
  n0.cores = {0, 1, 2, 3};
  inv.nodes.push_back(n0);
  inv.nodes.push_back(node(1, {8}));  // one core: the GPU gets it twice
  Topology t = topo::assign(inv);
  expect_gpus(t, {
                     {"0000:01:00.0", 0, {}, NicAffinity::kNone, 1, 2},
                     {"0000:02:00.0", 0, {}, NicAffinity::kNone, 3, 1},
                     {"0000:03:00.0", 0, {}, NicAffinity::kNone, 2, 3},
                     {"0000:81:00.0", 1, {}, NicAffinity::kNone, 8, 8},
                 });
}

TEST(TopologyAssign, UnknownNodeOnAMultiNodeMachineGetsNoCores) {
  Inventory inv;
  inv.gpus.push_back(gpu("0000:01:00.0", -1, "pci0000:00/0000:00:01.0/0000:01:00.0"));
  inv.nodes.push_back(node(0, range(0, 7)));
  inv.nodes.push_back(node(1, range(8, 15)));
  Topology t = topo::assign(inv);
  expect_gpus(t, {{"0000:01:00.0", -1, {}, NicAffinity::kNone, -1, -1}});
}

TEST(TopologyAssign, MixedProvidersKeepEfa) {
  Inventory inv;
  inv.gpus.push_back(gpu("0000:03:00.0", 0, kSwitch + "/0000:02:00.0/0000:03:00.0"));
  inv.nics.push_back(nic("mlx5_0", 0, kSwitch + "/0000:02:01.0/0000:04:00.0"));
  inv.nics.push_back(nic("rdmap5s0", 0, kSwitch + "/0000:02:02.0/0000:05:00.0", "efa"));
  inv.nodes.push_back(node(0, range(0, 3)));
  Topology t = topo::assign(inv);
  EXPECT_EQ(t.provider, "efa");
  ASSERT_EQ(t.nics.size(), 1u);
  EXPECT_EQ(t.nics[0].domain, "rdmap5s0-rdm");
  expect_gpus(t, {{"0000:03:00.0", 0, {"rdmap5s0"}, NicAffinity::kSwitch, 1, 2}});
}

TEST(TopologyAssign, NestedSwitchesDeeperGroupChoosesFirst) {
  Inventory inv;
  // Outer switch 0000:01:00.0; GPU a directly below it, GPU b below an inner switch 0000:03:00.0.
  const std::string outer = "pci0000:00/0000:00:01.0/0000:01:00.0";
  inv.gpus.push_back(gpu("0000:02:00.0", 0, outer + "/0000:01:00.1/0000:02:00.0"));  // a
  inv.gpus.push_back(gpu("0000:05:00.0", 0, outer + "/0000:03:00.0/0000:04:00.0/0000:05:00.0"));  // b
  inv.nics.push_back(nic("inner", 0, outer + "/0000:03:00.0/0000:04:01.0/0000:06:00.0"));
  inv.nics.push_back(nic("outer", 0, outer + "/0000:01:00.2/0000:07:00.0"));
  inv.nodes.push_back(node(0, range(0, 7)));
  Topology t = topo::assign(inv);
  expect_gpus(t, {
                     {"0000:02:00.0", 0, {"outer"}, NicAffinity::kSwitch, 1, 2},
                     {"0000:05:00.0", 0, {"inner"}, NicAffinity::kSwitch, 3, 4},
                 });
}

// ---- reading and parsing ----

TEST(TopologySysfs, MissingFilesAreEmptyNotErrors) {
  TempDir dir;
  topo::SysfsTree t(dir.path().string());
  EXPECT_FALSE(t.read("bus/pci/devices/0000:00:00.0/class"));
  EXPECT_FALSE(t.read_int("nothing"));
  EXPECT_FALSE(t.link_target("class/infiniband/mlx5_0/device/driver"));
  EXPECT_FALSE(t.resolve("devices"));
  EXPECT_TRUE(t.list("class/infiniband").empty());
  EXPECT_FALSE(t.is_dir("bus/pci/devices"));
  try {
    detect_topology({.sysfs_root = dir.path().string()});
    FAIL() << "no bus/pci/devices: not a sysfs tree";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("bus/pci/devices"), std::string::npos) << e.what();
  }
}

TEST(TopologySysfs, LinksResolveInsideTheRootOnly) {
  TempDir dir;
  const fs::path r = dir.path();
  fs::create_directories(r / "devices/pci0000:00/0000:00:01.0");
  std::ofstream(r / "devices/pci0000:00/0000:00:01.0/vendor") << "0x10de\n";
  fs::create_directories(r / "bus/pci/devices");
  fs::create_symlink("../../../devices/pci0000:00/0000:00:01.0", r / "bus/pci/devices/0000:00:01.0");
  fs::create_symlink("../../../../../../../../etc", r / "bus/pci/climb");  // ".." stops at the root
  fs::create_symlink("/etc", r / "bus/pci/absolute_outside");
  fs::create_symlink((r / "devices").string(), r / "bus/pci/absolute_inside");
  fs::create_symlink("loop", r / "bus/pci/loop");
  topo::SysfsTree t(r.string());
  EXPECT_EQ(t.read("bus/pci/devices/0000:00:01.0/vendor"), "0x10de");
  EXPECT_EQ(t.read_int("bus/pci/devices/0000:00:01.0/vendor"), std::nullopt);
  EXPECT_EQ(t.resolve("bus/pci/devices/0000:00:01.0"), "devices/pci0000:00/0000:00:01.0");
  EXPECT_EQ(t.link_target("bus/pci/devices/0000:00:01.0"), "../../../devices/pci0000:00/0000:00:01.0");
  EXPECT_FALSE(t.resolve("bus/pci/climb/passwd"));       // would be <root>/etc/passwd: absent
  EXPECT_FALSE(t.read("bus/pci/absolute_outside/hostname"));  // never the live /etc
  EXPECT_EQ(t.resolve("bus/pci/absolute_inside/pci0000:00"), "devices/pci0000:00");
  EXPECT_FALSE(t.resolve("bus/pci/loop"));
  EXPECT_EQ(t.list("bus/pci/devices"), std::vector<std::string>{"0000:00:01.0"});
  // A root named through a symlink: absolute links naming the real directory are inside it too.
  const fs::path alias = r.string() + "-alias";
  fs::create_symlink(r, alias);
  topo::SysfsTree via_alias(alias.string() + "/");
  EXPECT_EQ(via_alias.resolve("bus/pci/absolute_inside/pci0000:00"), "devices/pci0000:00");
  EXPECT_EQ(via_alias.read("bus/pci/devices/0000:00:01.0/vendor"), "0x10de");
  fs::remove(alias);
}

TEST(TopologyParse, Values) {
  EXPECT_EQ(topo::parse_cpulist("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(topo::parse_cpulist(""), std::vector<int>{});
  EXPECT_EQ(topo::parse_cpulist("x,2,5-3"), std::vector<int>{2});
  EXPECT_EQ(topo::format_cpulist(concat(range(0, 47), range(96, 143))), "0-47,96-143");
  EXPECT_EQ(topo::format_cpulist({3, 1, 2, 7}), "1-3,7");
  EXPECT_EQ(topo::parse_rate_gbps("400 Gb/sec (4X NDR)"), 400.0);
  EXPECT_EQ(topo::parse_rate_gbps("100 Gb/sec"), 100.0);
  EXPECT_EQ(topo::parse_rate_gbps("2.5 Gb/sec (1X SDR)"), 2.5);
  EXPECT_EQ(topo::parse_rate_gbps("fast"), std::nullopt);
  EXPECT_TRUE(topo::parse_port_active("4: ACTIVE"));
  EXPECT_FALSE(topo::parse_port_active("1: DOWN"));
  EXPECT_FALSE(topo::parse_port_active("5: ACTIVE_DEFER"));
  EXPECT_TRUE(topo::is_pci_address("0000:53:00.0"));
  EXPECT_TRUE(topo::is_pci_address("10000:e0:06.0"));
  EXPECT_FALSE(topo::is_pci_address("pci0000:53"));
  EXPECT_FALSE(topo::is_pci_address("0000:53:00.8"));
  topo::PciPath p = topo::PciPath::parse("devices/pci0000:44/0000:44:00.0/0000:45:00.0/0000:46:01.4/0000:53:00.0");
  EXPECT_EQ(p.root, "devices/pci0000:44");
  EXPECT_EQ(p.chain, (std::vector<std::string>{"0000:44:00.0", "0000:45:00.0", "0000:46:01.4", "0000:53:00.0"}));
  topo::PciPath nic = topo::PciPath::parse("devices/pci0000:44/0000:44:00.0/0000:45:00.0/0000:46:01.0/0000:4f:00.0");
  EXPECT_EQ(topo::shared_bridges(p, nic), 2u);
  EXPECT_EQ(topo::shared_bridges(p, topo::PciPath::parse("devices/virtual/infiniband/rxe0")), 0u);
}

// ---- the machine running the test ----

TEST(TopologyLive, ThisMachine) {
  if (!fs::exists("/sys/bus/pci/devices"))
    GTEST_SKIP() << "no PCI bus in this /sys (a container without sysfs): the fixtures cover detection";
  Topology t;
  ASSERT_NO_THROW(t = detect_topology());
  std::cout << t.to_table();
  // Counted here independently: NVIDIA display or 3D controllers on the PCI bus.
  size_t nvidia = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/sys/bus/pci/devices", ec)) {
    std::string vendor, cls;
    std::ifstream(e.path() / "vendor") >> vendor;
    std::ifstream(e.path() / "class") >> cls;
    if (vendor == "0x10de" && (cls.rfind("0x0302", 0) == 0 || cls.rfind("0x0300", 0) == 0)) nvidia++;
  }
  EXPECT_EQ(t.gpus.size(), nvidia);
  EXPECT_FALSE(t.numa_nodes.empty());
  std::set<size_t> ids;
  for (const TopoNumaNode& n : t.numa_nodes) EXPECT_TRUE(ids.insert(n.id).second);
  for (const TopoGpu& g : t.gpus) {
    for (size_t i : g.nics) EXPECT_LT(i, t.nics.size());
    EXPECT_EQ(g.nics.empty(), g.affinity == NicAffinity::kNone);
    if (g.worker_cpu < 0) continue;
    auto node = std::find_if(t.numa_nodes.begin(), t.numa_nodes.end(),
                             [&](const TopoNumaNode& n) { return n.id == g.numa_node; });
    ASSERT_NE(node, t.numa_nodes.end());
    EXPECT_NE(std::find(node->cpus.begin(), node->cpus.end(), g.worker_cpu), node->cpus.end());
    EXPECT_NE(std::find(node->cpus.begin(), node->cpus.end(), g.watcher_cpu), node->cpus.end());
  }
  for (const TopoNic& n : t.nics) {
    EXPECT_TRUE(n.active);
    EXPECT_EQ(n.provider, t.provider);
  }
}

}  // namespace
}  // namespace fabric
