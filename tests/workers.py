"""What the torchrun worker scripts of the tests (distributed_worker.py, sequence_parallel_worker.py)
share: the whole gradients of a (possibly sharded) model, and handing their results back to the
test that launched them."""

from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole (a DTensor's gathered), copied."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return grads


def write_results_and_tear_down(out: str, results: dict) -> None:
    """Rank 0 writes every rank's results to `out`; then the ranks tear down together, after what
    the scenarios left (FSDP and DDP state hold the process group and its pending work) is gone:
    otherwise a rank sometimes aborts at exit ("terminate called without an active exception")."""
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "results": results})
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"world_size": dist.get_world_size(), "ranks": gathered}, handle, indent=1)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
