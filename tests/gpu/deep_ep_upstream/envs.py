"""deep_ep.utils.envs for running DeepEP's own tests against fabric_lib's shim on one machine:
DeepEP's init_dist joins NCCL ranks one per GPU; here every rank is a process on GPU 0 (under MPS,
no SM partition), they meet over gloo on a TCPStore, and LOCAL_WORLD_SIZE says how many ranks
form a node (the shim reads it). The rest is as DeepEP's: bf16 default dtype, CUDA default device."""

import os

import torch
import torch.distributed as dist


_all_gather_into_tensor = dist.all_gather_into_tensor


def _all_gather_into_flat_tensor(output, input, group=None, async_op=False):
    """gloo takes the output of all_gather_into_tensor flat in its first dimension ([W * n, ...]);
    NCCL, which DeepEP's tests use, also takes [W, n, ...]. Same bytes either way."""
    return _all_gather_into_tensor(output.view(-1, *input.shape[1:]), input, group=group, async_op=async_op)


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    port = int(os.getenv("MASTER_PORT", "8361"))
    dist.all_gather_into_tensor = _all_gather_into_flat_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=num_local_ranks, rank=local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(0)
    torch.manual_seed(seed + local_rank)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
