"""Pipeline-parallel targets over ``mx.distributed``, with DFlash on top.

The target's decoder layers are split into contiguous stages, one per rank of
the ``mx.distributed`` group (launched with ``mlx.launch``). As in mlx-lm,
rank 0 holds the *last* stage: rank N-1 embeds and runs the first layers,
hands its hidden states to rank N-2, ..., rank 0 runs the last layers, the
final norm and the head. Rank 0 also drives generation: it runs the ordinary
decode loop (``decode.generate_tokens``, plain, chain or tree, any sampler)
over a :class:`PipelineTarget` whose forward sends the block's token ids
around the ring (0 -> N-1 -> ... -> 1 -> 0) and finishes it locally; it holds
the draft (which borrows an embedding copy and the head), decides acceptance
once, and prints. Every hop is between ring neighbours.

Per hop one message of 1 KB holding the header and, inline, the ``meta``
ints (cache operations still to apply, capture layer ids, tree parents,
token ids), then the hidden states with the capture layers' features
appended (none on the hop that carries the token ids to the first stage).
Cache operations (reset, rollback to the accepted prefix or tree path, undo
of a queued plain step) ride on the next message, so a DFlash cycle and a
plain token each cost exactly one trip around the ring; every rank applies
them to its own layers, so all stages roll back identically.

A rank that dies closes its sockets: the ring backend then fails the pending
receive (about a second) and every rank exits with one ``error:`` line. A
link that goes silent is caught by a watchdog thread: a receive that waits
longer than ``timeout`` seconds during a generation ends the process.

Modules, imported one way (stage -> link, plan): :mod:`.plan` (costs and the
split), :mod:`.link` (the wire), :mod:`.stage` (what a rank holds and runs).
An engine over a pipeline comes from ``mlx_dflash.load(..., pipeline=...)``.
"""

from .link import Link, init_group
from .plan import Costs, StagePlan, costs_from_sizes, plan_stages, stage_plan
from .stage import Pipeline, PipelineCache, PipelineTarget, Stage, StageTarget, StageWorker, load_stage

__all__ = [
    "Costs",
    "Link",
    "Pipeline",
    "PipelineCache",
    "PipelineTarget",
    "Stage",
    "StagePlan",
    "StageTarget",
    "StageWorker",
    "costs_from_sizes",
    "init_group",
    "load_stage",
    "plan_stages",
    "stage_plan",
]
