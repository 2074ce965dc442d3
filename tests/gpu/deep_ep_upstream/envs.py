"""deep_ep.utils.envs for running DeepEP's own tests against fabric_lib's shim on one machine:
DeepEP's init_dist joins NCCL ranks one per GPU; here every rank is a process on GPU 0 (under MPS,
no SM partition), they meet over gloo on a TCPStore, and LOCAL_WORLD_SIZE says how many ranks
form a node (the shim reads it). The rest is as DeepEP's: bf16 default dtype, CUDA default device."""

import os

import torch
import torch.distributed as dist


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    port = int(os.getenv("MASTER_PORT", "8361"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=num_local_ranks, rank=local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(0)
    torch.manual_seed(seed + local_rank)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
