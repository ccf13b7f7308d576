"""What the torchrun worker scripts of the tests (distributed_worker.py, sequence_parallel_worker.py,
linear_attention_worker.py, grpo_ulysses_worker.py) share: running their scenarios, the whole
gradients of a (possibly sharded) model, and handing their results back to the test that launched
them."""

from __future__ import annotations

import contextlib
import gc
import json
import time
import traceback
from collections.abc import Callable

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


def run_scenarios(scenarios: dict[str, Callable[[], dict]], names: str, after_each: Callable[[], object]) -> dict:
    """Run the comma-separated `names` of `scenarios` in turn; a scenario that raises is recorded
    (for the test to assert on) and the others still run. `after_each` undoes what a scenario may
    have left registered (its own failure ignored); every scenario's wall time is recorded."""
    results: dict[str, dict] = {}
    for name in names.split(","):
        started = time.perf_counter()
        try:
            results[name] = scenarios[name]()
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        with contextlib.suppress(Exception):
            after_each()
        dist.barrier()
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    return results
