#!/usr/bin/env python3
"""Writes the fixtures of machines we have not recorded (p5.48xlarge, p5en.48xlarge, dgx-h100)
from what is published about them; docs/testing.md and each fixture's header say
what is real and what is reconstructed. A fixture recorded on the machine itself
(record_sysfs.py) replaces the reconstructed one: delete its entry here when that happens.

    python3 tests/topology/reconstruct_fixtures.py   # rewrites those files in fixtures/
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record_sysfs import Fixture  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

# Only what record_sysfs.py keeps by default: NVIDIA devices and the RDMA NICs' PCI devices. The
# bridges above them are no devices of the fixture, only directories of the paths.
NVIDIA, AMAZON, MELLANOX = "0x10de", "0x1d0f", "0x15b3"


class Machine:
    def __init__(self, comments: list[str]) -> None:
        self.fx = Fixture()
        self.fx.comments = comments

    def pci(self, path: list[str], cls: str, vendor: str, numa: int) -> str:
        """A PCI device at devices/<path> (host bridge first, the device's address last)."""
        bdf = path[-1]
        where = "devices/" + "/".join(path)
        self.fx.add_link(f"bus/pci/devices/{bdf}", "../../../" + where)
        self.fx.add_file(f"{where}/class", cls)
        self.fx.add_file(f"{where}/vendor", vendor)
        self.fx.add_file(f"{where}/numa_node", str(numa))
        return where

    def rdma(self, name: str, path: list[str], driver: str, rate: str, state: str = "4: ACTIVE") -> None:
        """An RDMA device of the PCI device at devices/<path>, as the ib core registers it."""
        where = "devices/" + "/".join(path)
        dev = f"{where}/infiniband/{name}"
        self.fx.add_link(f"class/infiniband/{name}", "../../" + dev)
        self.fx.add_link(f"{dev}/device", "../../../" + path[-1])
        self.fx.add_link(f"{where}/driver", "../" * (len(path) + 1) + f"bus/pci/drivers/{driver}")
        self.fx.add_file(f"{dev}/ports/1/rate", rate)
        self.fx.add_file(f"{dev}/ports/1/state", state)

    def cpus(self, nodes: dict[int, str], core_of) -> None:
        """NUMA nodes by cpulist; core_of(cpu) gives (package, core) or None (no topology files)."""
        all_cpus: list[int] = []
        for node, cpulist in nodes.items():
            self.fx.add_file(f"devices/system/node/node{node}/cpulist", cpulist)
            for piece in cpulist.split(","):
                lo, _, hi = piece.partition("-")
                all_cpus += range(int(lo), int(hi or lo) + 1)
        all_cpus.sort()
        self.fx.add_file("devices/system/cpu/online", f"{all_cpus[0]}-{all_cpus[-1]}")
        for cpu in all_cpus:
            c = core_of(cpu)
            if c is None:
                continue
            self.fx.add_file(f"devices/system/cpu/cpu{cpu}/topology/core_id", str(c[1]))
            self.fx.add_file(f"devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(c[0]))

    def write(self, name: str) -> None:
        self.fx.write(os.path.join(FIXTURES, f"{name}.sysfs"))


def smt_cores(cores_per_socket: int, sockets: int):
    """Linux numbering of a 2-way SMT machine: CPUs 0..N-1 are the first threads of the cores,
    socket by socket; CPU c + N is c's sibling."""
    n = cores_per_socket * sockets

    def core_of(cpu: int):
        c = cpu % n
        return (c // cores_per_socket, c % cores_per_socket)

    return core_of


def p5() -> None:
    m = Machine([
        "machine: p5.48xlarge (reconstructed, not recorded: replace with record_sysfs.py on a p5)",
        "8 H100 (10de, class 0302), 32 EFA (1d0f:efa1, driver efa, 100 Gb/s), 2 NUMA nodes.",
        "Real: the GPU addresses 53 64 75 86 97 a8 b9 ca:00.0; the EFA addresses and names (4f-52 with",
        "GPU 53 ... c6-c9 with GPU ca, rdmap<bus>s0); 4 EFA + 1 GPU behind each PCIe switch; switch",
        "upstream ports 45 56 67 78 (node 0) 89 9a ab bc (node 1) (aws-ofi-nccl's p5.48xl-topo.xml);",
        "host bridge 44 -> bridge 44:00.0 -> 45:00.0 -> 46:01.0 -> EFA 4f and 46:01.4 -> GPU 53",
        "(a published lstopo -v of a p5); NUMA cpulists (numactl --hardware on a p5).",
        "Reconstructed: the other groups follow the same pattern (host bridge = upstream - 1,",
        "downstream ports <upstream+1>:01.0-01.3 for the EFAs, 01.4 for the GPU); core_id and",
        "physical_package_id (AMD EPYC 7R13, 48 cores per socket, CPU N+96 the sibling of N); the",
        "rate text (the efa driver's 4X EDR for 100 Gb/s). Bridges, NVMe and other devices are left out.",
    ])
    for g in range(8):
        base = 0x44 + 0x11 * g
        numa = 0 if g < 4 else 1
        hb = f"pci0000:{base:02x}"
        rp = f"0000:{base:02x}:00.0"
        up = f"0000:{base + 1:02x}:00.0"
        for port in range(5):
            dn = f"0000:{base + 2:02x}:01.{port}"
            bus = base + 0xb + port
            dev = [hb, rp, up, dn, f"0000:{bus:02x}:00.0"]
            if port < 4:
                m.pci(dev, "0x020000", AMAZON, numa)
                m.rdma(f"rdmap{bus}s0", dev, "efa", "100 Gb/sec (4X EDR)")
            else:
                m.pci(dev, "0x030200", NVIDIA, numa)
    m.cpus({0: "0-47,96-143", 1: "48-95,144-191"}, smt_cores(48, 2))
    m.write("p5.48xlarge")


def p5en() -> None:
    m = Machine([
        "machine: p5en.48xlarge (reconstructed, not recorded: replace with record_sysfs.py on a p5en)",
        "8 H200 (10de, class 0302), 16 EFA (1d0f, driver efa, 200 Gb/s), 2 NUMA nodes.",
        "Real: the GPU addresses 59 5a 72 73 8b 8c a4 a5:00.0 (nvidia-smi on a p5en); the 16 EFA",
        "names rdmap85s0-88s0, 110-113, 135-138, 160-163 (ibv_devinfo on a p5en), so buses 55-58,",
        "6e-71, 87-8a, a0-a3; the NUMA cpulists (lscpu on a p5en, Xeon 8488C, 2 x 48 cores).",
        "Reconstructed: which 2 EFA share a PCIe switch with which GPU (55 56 with GPU 59, 57 58",
        "with 5a, and so on: aws-ofi-nccl groups the NICs in these pairs), every bridge address",
        "(host bridge = first EFA bus - 5, two root ports, one switch per GPU), GPUs 0-3 on node 0,",
        "core_id and physical_package_id (CPU N+96 the sibling of N), the rate text (4X HDR).",
    ])
    for pair, (gpu0, nic0) in enumerate([(0x59, 0x55), (0x72, 0x6e), (0x8b, 0x87), (0xa4, 0xa0)]):
        numa = 0 if pair < 2 else 1
        hb_bus = nic0 - 5
        hb = f"pci0000:{hb_bus:02x}"
        for side in range(2):
            rp = f"0000:{hb_bus:02x}:01.{side}"
            up = f"0000:{hb_bus + 1 + 2 * side:02x}:00.0"
            ports = [nic0 + 2 * side, nic0 + 2 * side + 1, gpu0 + side]
            for port, bus in enumerate(ports):
                dn = f"0000:{hb_bus + 2 + 2 * side:02x}:0{port}.0"
                dev = [hb, rp, up, dn, f"0000:{bus:02x}:00.0"]
                if port < 2:
                    m.pci(dev, "0x020000", AMAZON, numa)
                    m.rdma(f"rdmap{bus}s0", dev, "efa", "200 Gb/sec (4X HDR)")
                else:
                    m.pci(dev, "0x030200", NVIDIA, numa)
    m.cpus({0: "0-47,96-143", 1: "48-95,144-191"}, smt_cores(48, 2))
    m.write("p5en.48xlarge")


def dgx_h100() -> None:
    m = Machine([
        "machine: dgx-h100 (reconstructed, not recorded: replace with record_sysfs.py on a DGX H100)",
        "8 H100, 8 ConnectX-7 compute NICs (mlx5_core, 400 Gb/s NDR), 2 storage NICs (200 Gb/s),",
        "4 NVSwitches (10de, class 0680: NVIDIA devices that are not GPUs), 2 NUMA nodes.",
        "Real: the GPU addresses 1b 43 52 61 9d c3 d1 df:00.0 (nvidia-smi on a DGX H100); the",
        "compute NICs' buses 18 40 4f 5e 9a c0 ce dc and the storage cards' 29 and aa (ibdev2netdev",
        "on a DGX H100: ibp24s0 ... ibp220s0, ibp41s0f0, ibp170s0f0); NVSwitches at 05-08:00.0 (an",
        "HGX H100 NCCL topology dump); the NUMA cpulists (2 x 56 cores, nvidia-smi topo -m).",
        "Reconstructed: the PCIe switches. A real DGX H100 puts one GPU and one compute NIC under",
        "each switch hierarchy; here each of 4 switches holds 2 GPUs and 2 NICs (1b 43 with 18 40,",
        "52 61 with 4f 5e, 9d c3 with 9a c0, d1 df with ce dc) so that the split-evenly rule runs",
        "(each GPU still gets the NIC it gets on the real machine). The device names: a real DGX",
        "numbers mlx5_* in PCI order with the storage ports among them; here mlx5_0-7 are the",
        "compute NICs and mlx5_8, mlx5_9 the storage NICs, each under its own root port. Bridge",
        "addresses, core_id and physical_package_id (CPU N+112 the sibling of N) are invented.",
    ])
    switches = [  # host bridge bus, the buses below its downstream ports (NIC, GPU, NIC, GPU), node
        (0x15, [0x18, 0x1b, 0x40, 0x43], 0),
        (0x48, [0x4f, 0x52, 0x5e, 0x61], 0),
        (0x97, [0x9a, 0x9d, 0xc0, 0xc3], 1),
        (0xc7, [0xce, 0xd1, 0xdc, 0xdf], 1),
    ]
    nic_index = 0
    for hb_bus, buses, numa in switches:
        hb = f"pci0000:{hb_bus:02x}"
        rp = f"0000:{hb_bus:02x}:01.0"
        up = f"0000:{hb_bus + 1:02x}:00.0"
        for port, bus in enumerate(buses):
            dn = f"0000:{hb_bus + 2:02x}:0{port}.0"
            dev = [hb, rp, up, dn, f"0000:{bus:02x}:00.0"]
            if port % 2 == 0:
                m.pci(dev, "0x020700", MELLANOX, numa)
                m.rdma(f"mlx5_{nic_index}", dev, "mlx5_core", "400 Gb/sec (4X NDR)")
                nic_index += 1
            else:
                m.pci(dev, "0x030200", NVIDIA, numa)
    for name, hb_bus, bus, numa in [("mlx5_8", 0x26, 0x29, 0), ("mlx5_9", 0xa7, 0xaa, 1)]:
        hb = f"pci0000:{hb_bus:02x}"
        rp = f"0000:{hb_bus:02x}:01.0"
        dev = [hb, rp, f"0000:{bus:02x}:00.0"]
        m.pci(dev, "0x020700", MELLANOX, numa)
        m.rdma(name, dev, "mlx5_core", "200 Gb/sec (4X HDR)")
    for i, bus in enumerate(range(0x05, 0x09)):
        rp = f"0000:00:01.{i}"
        m.pci(["pci0000:00", rp, f"0000:{bus:02x}:00.0"], "0x068000", NVIDIA, 0)
    m.cpus({0: "0-55,112-167", 1: "56-111,168-223"}, smt_cores(56, 2))
    m.write("dgx-h100")


if __name__ == "__main__":
    os.makedirs(FIXTURES, exist_ok=True)
    p5()
    p5en()
    dgx_h100()
