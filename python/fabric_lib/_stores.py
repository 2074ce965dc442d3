"""What the torch-facing modules share about torch.distributed Stores."""

from __future__ import annotations

from typing import Any


def store_of(store: Any) -> Any:
    """The store to exchange metadata through: `store`, or the default process group's."""
    if store is not None:
        return store
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("no store given and torch.distributed is not initialized")
    return dist.distributed_c10d._get_default_store()
