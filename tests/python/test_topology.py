"""fabric_lib.detect_topology: the live /sys, a recorded fixture, and the recorder itself
(tests/topology/record_sysfs.py) reproducing what it records."""

import glob
import os
import sys

import pytest

import fabric_lib as fl

HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "..", "topology")
FIXTURES = os.path.join(TOPOLOGY, "fixtures")
sys.path.insert(0, TOPOLOGY)
import record_sysfs  # noqa: E402


def nvidia_gpus_in(sysfs: str) -> int:
    """NVIDIA display and 3D controllers, counted without the library."""
    n = 0
    for dev in glob.glob(os.path.join(sysfs, "bus/pci/devices/*")):
        try:
            with open(os.path.join(dev, "vendor")) as v, open(os.path.join(dev, "class")) as c:
                vendor, cls = v.read().strip(), c.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and cls[:6] in ("0x0302", "0x0300"):
            n += 1
    return n


# The live cases need a PCI bus in /sys (a container without sysfs has none; the fixtures cover it).
needs_pci = pytest.mark.skipif(not os.path.isdir("/sys/bus/pci/devices"), reason="no PCI bus in /sys")


@needs_pci
def test_live_sys():
    t = fl.detect_topology()
    assert isinstance(t, fl.Topology)
    assert len(t.gpus) == nvidia_gpus_in("/sys")
    assert t.numa_nodes and all(n.cpus for n in t.numa_nodes)
    assert t.provider in ("", "efa", "verbs")
    table = t.to_table()
    assert f"{len(t.gpus)} GPU(s)" in table
    for g in t.gpus:
        assert all(0 <= i < len(t.nics) for i in g.nics)
        assert (g.affinity == fl.NicAffinity.NONE) == (not g.nics)


def test_dgx_fixture(tmp_path):
    record_sysfs.materialize(os.path.join(FIXTURES, "dgx-h100.sysfs"), str(tmp_path))
    t = fl.detect_topology(str(tmp_path))
    assert t.provider == "verbs"
    assert [g.pci for g in t.gpus][:2] == ["0000:1b:00.0", "0000:43:00.0"]
    rails = [[t.nics[i].name for i in g.nics] for g in t.gpus]
    assert rails == [[f"mlx5_{i}"] for i in range(8)]
    assert all(g.affinity == fl.NicAffinity.SWITCH for g in t.gpus)
    assert [(g.worker_cpu, g.watcher_cpu) for g in t.gpus] == [
        (1, 2), (3, 4), (5, 6), (7, 8), (57, 58), (59, 60), (61, 62), (63, 64)]
    nic = t.nics[t.gpus[0].nics[0]]
    assert (nic.name, nic.pci, nic.driver, nic.domain, nic.link_gbps, nic.numa_node, nic.active) == (
        "mlx5_0", "0000:18:00.0", "mlx5_core", "mlx5_0", 400.0, 0, True)
    assert [n.id for n in t.numa_nodes] == [0, 1]
    assert t.numa_nodes[1].cpus == list(range(56, 112)) + list(range(168, 224))
    assert "mlx5_8" in t.to_table()  # a storage NIC no GPU uses


def test_not_a_sysfs_tree(tmp_path):
    with pytest.raises(fl.FabricError, match="not a sysfs tree"):
        fl.detect_topology(str(tmp_path))


@pytest.mark.parametrize("machine,all_pci", [("p5.48xlarge", False), ("p5en.48xlarge", False),
                                             ("dgx-h100", False), ("h200-1gpu-nonic", False),
                                             ("cpu-only", True)])
def test_recorder_reproduces_a_tree(tmp_path, machine, all_pci):
    """Recording a materialised fixture gives back its links and files: the recorder follows the
    same paths detect_topology does and records nothing it does not read."""
    src = record_sysfs.Fixture.load(os.path.join(FIXTURES, f"{machine}.sysfs"))
    src.materialize(str(tmp_path / "tree"))
    again = record_sysfs.record(str(tmp_path / "tree"), all_pci=all_pci).fx
    assert again.links == src.links
    assert again.files == src.files
    out = tmp_path / "again.sysfs"
    again.write(str(out))
    again.materialize(str(tmp_path / "tree2"))
    assert fl.detect_topology(str(tmp_path / "tree2")).to_table() == \
        fl.detect_topology(str(tmp_path / "tree")).to_table()


def test_recorder_on_live_sys(tmp_path):
    """What the recorder takes from this machine's /sys detects the same as /sys itself."""
    rec = record_sysfs.record("/sys", all_pci=False)
    rec.fx.materialize(str(tmp_path))
    assert fl.detect_topology(str(tmp_path)).to_table() == fl.detect_topology().to_table()


@needs_pci
def test_engine_from_the_live_topology_serves_every_gpu_and_labels_its_nics():
    t = fl.detect_topology()
    gpus = len(t.gpus)
    if gpus and not t.provider:
        pytest.skip("GPUs without RDMA NICs: the workers would need CUDA (the GPU run covers it)")
    if gpus:
        pytest.skip("a host with GPUs: covered by the GPU run (tests/gpu/run.sh)")
    e = fl.TransferEngine(topology=t, nics=["127.0.0.1"])
    try:
        assert e.worker_count == 1  # no GPU: one host worker
        stats = e.nic_stats()
        assert stats and stats[0].nic and stats[0].worker == 0
        assert stats[0].link_gbps >= 0
    finally:
        e.close()


@needs_pci
def test_engine_from_a_topology_rejects_a_gpu_it_does_not_have():
    t = fl.detect_topology()
    with pytest.raises(fl.FabricError, match="no GPU 99"):
        fl.TransferEngine(topology=t, gpus=[99])
    with pytest.raises(fl.FabricError, match="needs topology"):
        fl.TransferEngine(gpus=[0])
