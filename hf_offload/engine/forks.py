"""What a fork duplicates, and who may use it afterwards.

`os.fork()` (multiprocessing's default start method on Linux, a user's own fork) gives the child a
copy of the engine while a graph may be alive, but none of its threads:

- the disk tier's file is the same open file description in both: a truncate or a write by the
  child is one in the parent's file, and a job queued in the child is never run (no I/O thread);
- the host pool's slabs are the parent's pages on CUDA (registered shared memory), and their
  registration is the parent's to undo;
- the copy stream and its events belong to a CUDA context the child cannot use;
- the handles of the graph alive at the fork, whose buffers, extents and device memory are the
  parent's.

Each of these records the process that made it and is inert in any other: nothing there is given
back, truncated, unregistered or waited for, and what cannot be done (reading the parent's file)
raises at once. The engine notices the new process at the child's next forward pass and makes the
child resources of its own (`ActivationOffloader._after_fork`), so a child that trains works.
"""

from __future__ import annotations

import os


def this_process() -> int:
    """What an owner records: the id of the process that makes a resource."""
    return os.getpid()


def made_here(owner: int) -> bool:
    """Whether a resource recorded by `owner` belongs to this process (not inherited by a fork)."""
    return os.getpid() == owner
