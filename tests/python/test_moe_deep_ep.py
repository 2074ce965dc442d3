"""fabric_lib.moe.deep_ep.Buffer, DeepEP's low-latency API, from rank processes that meet in a
torch.distributed (gloo) group: 4 ranks as 2 nodes over tcp;ofi_rxm, 4 ranks as one node over
shm, and 4 ranks with NVLink refused (4 nodes over shm), host kernels. Two batches in flight (one received through its hook), FP8 with plain
scales and with round_scale + UE8M0 packing; DeepEP's shapes and layouts (column-major scales,
src_info, layout_range) and every count, row and combined value against the oracle; the
arguments the shim does not support raise; cumulative_local_expert_recv_stats sums the counts;
async_finish's event can be waited on."""

import os
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import moe_roles as R  # noqa: E402


@pytest.mark.parametrize("provider,ranks,node_size,allow_nvlink",
                         [("tcp;ofi_rxm", 4, 2, True), ("shm", 4, 4, True), ("shm", 4, 4, False), ("shm", 8, 4, True)],
                         ids=["tcp-2nodes", "shm-1node", "shm-no-nvlink", "shm-8ranks-2nodes"])
def test_deep_ep_low_latency_calls_match_the_oracle_with_two_batches_in_flight(peer, provider, ranks, node_size, allow_nvlink):
    """allow_nvlink_for_low_latency_mode=False: every rank a node of its own, every row through
    the proxy and the engine. 8 ranks as 2 nodes of 4 (DeepEP's EP8 shape on two hosts)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(provider=provider, ranks=ranks, node_size=node_size, experts=4 * ranks, topk=4, hidden=1024, max_tokens=8,
               dtype="fp8", steps=4, port=store.port, job=uuid.uuid4().hex[:16], allow_nvlink=allow_nvlink)
    procs = [peer(R.deep_ep_rank_main, dict(cfg, rank=r)) for r in range(cfg["ranks"])]
    R.deep_ep_results(procs)
    del store


@pytest.mark.parametrize("node_size", [1, 2], ids=["every-rank-a-node", "nvlink-pairs"])
def test_two_ep_groups_of_one_world_never_exchange_tokens(peer, node_size):
    """A world of 4 ranks split into EP groups {0, 1} and {2, 3}, a Buffer each, dispatching at once
    over tcp: each group's Buffer meets under a job named by its group's global ranks, every row a
    rank receives comes from its own group, and a second Buffer under a live job is refused."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(provider="tcp;ofi_rxm", ranks=4, group=2, node_size=node_size, experts=8, topk=2, hidden=256,
               max_tokens=6, dtype="bf16", port=store.port)
    procs = [peer(R.deep_ep_groups_rank_main, dict(cfg, rank=r)) for r in range(cfg["ranks"])]
    R.deep_ep_results(procs)
    del store


@pytest.mark.parametrize("shrink", [True, False], ids=["shrink", "no-shrink"])
def test_a_rank_killed_mid_run_is_masked_in_shrink_mode_and_named_without_it(peer, shrink):
    """4 ranks as 2 nodes over tcp (deep_ep.Buffer, host kernels); rank 3 SIGKILLs itself after
    step 1. enable_shrink: the survivors mask it after one 2 s timeout and stay exact (DeepEP's
    shrink semantics, moe_roles.deep_ep_shrink_rank_main); without it their step 2 raises naming it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(provider="tcp;ofi_rxm", ranks=4, node_size=2, experts=16, topk=4, hidden=256, max_tokens=8,
               dtype="bf16", port=store.port, gone=3, shrink=shrink, timeout_s=2.0, transfer_timeout_s=5.0)
    procs = [peer(R.deep_ep_shrink_rank_main, dict(cfg, rank=r)) for r in range(cfg["ranks"])]
    for r, (conn, _) in enumerate(procs):
        assert conn.poll(120), f"rank {r} did not start"
        assert conn.recv() == "ready"
    _, p3 = procs[3]
    p3.join(timeout=120)
    assert p3.exitcode == -9, f"rank 3 ended with {p3.exitcode}, not by its SIGKILL"
    R.deep_ep_results(procs[:3], timeout=120, started=True)
    del store


def test_host_wait_auto_blocks_where_the_ranks_threads_outnumber_the_cores():
    """deep_ep.Buffer's host_wait="auto": blocking-sync where the ranks on a host, three busy threads
    each (proxy, worker, callback), need more than its cores (8 ranks on a 16-core host), else
    CUDA's spin; an explicit mode is kept; an unknown one raises. (The GPU tests check that the
    Buffer's context runs the mode taken.)"""
    from fabric_lib.moe import host_wait

    assert host_wait.choose("auto", 8, cores=16) == "blocking-sync"
    assert host_wait.choose("auto", 5, cores=16) == "spin"
    assert host_wait.choose("auto", 4, cores=16) == "spin"
    assert host_wait.choose("auto", 2, cores=2) == "blocking-sync"
    assert host_wait.choose("spin", 8, cores=2) == "spin"
    assert host_wait.choose("yield", 1, cores=64) == "yield"
    with pytest.raises(ValueError, match="host_wait must be one of"):
        host_wait.choose("busy", 1)
