"""transformers' output capturing (`@capture_outputs`, 5.x): while a model's forward runs, forward
hooks on chosen submodules append their outputs to a collector, one entry per call; MoE routers
record their logits this way, and the load-balancing loss reads one entry per layer covering all
tokens. A tiled MLP calls its router once per tile, so sequence tiling takes the tiles' entries
out of the collector and puts back one. The collector is a private context variable of
transformers (inventory entry `transformers.output_collector`): without it tiling would leave each
tile's record, without its gradient, so `check_output_collector` refuses before a step runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .upstream import resolve


def check_output_collector() -> None:
    """Raise UpstreamChanged where transformers no longer has the collector tiling mends."""
    _context_variable()


def _context_variable():
    return resolve("transformers.output_collector")


def active_collector() -> dict[str, list] | None:
    """The lists outputs are being collected into, by key (e.g. "router_logits"); None outside a
    capturing forward."""
    return _context_variable().get()


@contextlib.contextmanager
def collecting(keys) -> Iterator[dict[str, list]]:
    """Collect the given keys into fresh lists within this block (a tile recomputed in backward,
    where no model forward is collecting)."""
    variable = _context_variable()
    collected = {key: [] for key in keys}
    token = variable.set(collected)
    try:
        yield collected
    finally:
        variable.reset(token)
