"""`hf-offload estimate`'s forked workers run torch after the parent has run parallel CPU ops.

GNU OpenMP's thread pool does not survive a fork: in a child forked after a parallel op in the
parent, the first parallel op waits in OpenMP's barrier for threads that do not exist. Each case
runs in a fresh interpreter under a deadline, so a hang is a failed assertion, never a hung suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hf_offload.tools import estimate as estimate_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 30  # for the child's op, after torch is imported and the pool is up: it takes about a second

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys
    from concurrent.futures import ProcessPoolExecutor, TimeoutError
    import torch
    from hf_offload.tools.estimate import forked_pool

    def parallel_op():
        torch.zeros(2**26).add_(1)  # 256 MiB: torch splits it over its OpenMP threads
        return "done"

    torch.set_num_threads(2)
    torch.zeros(2**26).add_(1)  # the parent's parallel op: OpenMP's pool now exists
    context = multiprocessing.get_context("fork")
    pool = forked_pool(1, context) if sys.argv[1] == "forked_pool" else ProcessPoolExecutor(1, mp_context=context)
    try:
        print(pool.submit(parallel_op).result(timeout=float(sys.argv[2])), flush=True)
    except TimeoutError:
        print("hang", flush=True)
        for process in list(pool._processes.values()):
            process.kill()
        os._exit(0)
    pool.shutdown()
    """
)


def child_after_parent_parallel_op(pool: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, pool, str(DEADLINE_S)], capture_output=True, text=True, env=env,
        timeout=DEADLINE_S + 240, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


@needs_fork
def test_the_estimates_forked_workers_run_a_parallel_op_after_the_parent_ran_one():
    assert child_after_parent_parallel_op("forked_pool") == "done"


@needs_fork
def test_companion_a_plain_forked_pool_hangs_there():
    """The hazard is real on this torch: the same op in a worker of a plain forked pool hangs
    (if a torch release makes its OpenMP pool survive a fork, this says so, and the workers'
    one thread may go)."""
    assert child_after_parent_parallel_op("plain") == "hang"


def test_every_pool_of_the_estimate_is_a_forked_pool(monkeypatch):
    """run_estimate's pools (modes side by side, and a search's steps two at a time) all come from
    `forked_pool`: no worker starts without its one thread."""
    made = []

    class Recording(estimate_module.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("initializer"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(estimate_module, "ProcessPoolExecutor", Recording)
    from conftest import TINY_CONFIGS
    from transformers import AutoConfig

    from hf_offload.tools.simulator import Training

    config = AutoConfig.for_model("llama", **TINY_CONFIGS["llama"])
    request = estimate_module.Request(
        config=config, name="tiny", training=Training(optimizer_states=0), modes=["none", "checkpointing"],
        seq_len=64,
    )  # fmt: skip
    estimate_module.run_estimate(request, echo=None, jobs=2)
    searched = estimate_module.Request(
        config=config, name="tiny", training=Training(optimizer_states=0), modes=["checkpointing"], seq_len=64,
        memory_bytes=2**27, granularity=64,
    )  # fmt: skip
    monkeypatch.setattr(estimate_module.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    estimate_module.run_estimate(searched, echo=None, jobs=1)
    assert len(made) >= 2 and all(initializer is estimate_module._one_thread for initializer in made), made
