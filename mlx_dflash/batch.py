"""Several requests decoded together, each exactly as it would decode alone.

A :class:`BatchDecoder` holds up to ``max_batch`` slots. A request takes a
free slot between cycles and prefills alone (B = 1, its own chunks, so its
cache is its solo run's), then samples its first token and joins. While
other slots are decoding, a step runs prefill chunks (round robin) only
until ``prefill_budget`` tokens are done (at least one chunk), then one
cycle: running slots keep streaming, a cycle delayed by about one budget's
prefill at most, and short prompts join several at a time. Each cycle drafts for
every active slot in one draft forward (``propose_slots``; each slot's
context on its own), verifies all slots' chains in
one :meth:`Target.forward_slots` of one width W, and accepts, commits and
rolls back per slot (:class:`~mlx_dflash.cache.SlotBatch`). A slot leaves
the moment it hits EOS, ``max_tokens`` or the context end.

W is the block size (the request options' ``block_size``, else the
draft's), cut to the context room the tightest slot has left (a slot near
its ``max_tokens`` verifies the full width; emit stops at its limit); W = 1
(no draft, or a slot one token from its context end) is a plain step for
the batch. Greedy and the
equality rule give each request its solo tokens (every emitted token is the
target's pick, and each slot's rows are its solo forward's).
"""

import time
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import mlx.core as mx

from .api import GenerationResult
from .cache import SlotBatch
from .config import GenerationConfig
from .decode import Decoder, GenerationStats, Hooks, Proposal, check_prompt, open_decoder
from .errors import DFlashError
from .models.draft import propose_slots
from .policy import Plan


@dataclass
class SlotEvent:
    """Tokens a request committed in one :meth:`BatchDecoder.step` (its first
    token when it joined, or a cycle's), and its finish reason once done."""

    index: int
    tokens: List[int]
    finish_reason: Optional[str]
    stats: GenerationStats


class BatchDecoder:
    """Requests decoded together in slots (see the module's docstring).

    ``add`` queues a request (``config`` and keyword options as
    :func:`mlx_dflash.generate` takes them; the options that shape the
    batch's verify, ``block_size`` and ``baseline``, must be the same for
    all); ``step`` admits queued requests while slots are free, then runs
    one cycle for the active slots, and returns what each request committed.
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        max_batch: int = 8,
        eos_token_ids: Sequence[int] = (),
        prefix_cache=None,
        prefill_budget: int = 512,
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise DFlashError(f"max_batch must be a positive number of slots, got {max_batch!r}")
        if prefill_budget < 1:
            raise DFlashError(f"prefill_budget must be a positive number of tokens, got {prefill_budget}")
        self.target, self.draft, self.max_batch = target, draft, max_batch
        self.prefill_budget = prefill_budget
        # A PrefixCache bound to the engine: a request restores its longest cached
        # prefix at admission (stats.cached_tokens) and is snapshotted when it leaves.
        self.prefix_cache = prefix_cache
        self.eos_token_ids = list(eos_token_ids)
        self.queue = deque()
        self.prefilling = deque()  # (index, Decoder, its prefill steps), round robin
        self.active: List[tuple] = []  # (index, Decoder)
        self.count = 0
        self.shape = None  # (block_size, baseline) shared by every request
        mx.reset_peak_memory()  # each request's stats.peak_memory: the batch's

    @property
    def done(self) -> bool:
        return not self.queue and not self.prefilling and not self.active

    def add(
        self,
        prompt: Sequence[int],
        config: Optional[GenerationConfig] = None,
        *,
        prefix_boundary: Optional[int] = None,
        **options,
    ) -> int:
        """Queue a request (token ids); returns its index (0, 1, ... in order
        added). ``prefix_boundary``: its stable prompt boundary for the prefix
        cache (see ``prefix.py``)."""
        c = GenerationConfig.build(config, **options)
        if self.done:
            self.shape = None  # a drained batch takes any shape
        c.validate(None if c.baseline else self.draft)
        if c.tree_budget or c.auto_tree:
            raise DFlashError("batched decoding verifies chains: --tree-budget and --auto-tree are not supported")
        check_prompt(self.target, list(prompt), c)
        shape = (c.block_size, c.baseline)
        if self.shape is not None and shape != self.shape:
            raise DFlashError("every request of a batch needs the same block_size and baseline options")
        self.shape = shape
        index = self.count
        self.count += 1
        self.queue.append((index, list(prompt), c, prefix_boundary))
        return index

    def cancel(self, index: int) -> Optional[SlotEvent]:
        """Drop request ``index`` between steps, queued or active (its finish
        reason "cancelled"); no other slot's state is touched. None if it
        is not running (finished, or never added)."""
        for i, (j, prompt, *_) in enumerate(self.queue):
            if j == index:
                del self.queue[i]
                stats = GenerationStats(prompt_tokens=len(prompt), finish_reason="cancelled")
                return SlotEvent(index, [], "cancelled", stats)
        for slots in (self.prefilling, self.active):
            for i, (j, d, *_) in enumerate(slots):
                if j == index:
                    del slots[i]
                    d.stats.finish_reason = "cancelled"
                    self._leave(d)
                    return SlotEvent(index, [], "cancelled", d.stats)
        return None

    def step(self) -> List[SlotEvent]:
        """Admit queued requests to free slots, run prefill chunks up to
        ``prefill_budget`` tokens (and on to a first token while no slot is
        decoding), then one cycle of the decoding slots. Returns what each
        request committed."""
        while self.queue and len(self.prefilling) + len(self.active) < self.max_batch:
            self._admit(*self.queue.popleft())
        events = []
        spent = 0
        while self.prefilling and (spent < self.prefill_budget or not self.active):
            d = self.prefilling[0][1]
            before = d.cache.offset
            ev = self._prefill_chunk()
            spent += d.cache.offset - before
            if ev is not None:
                events.append(ev)
        if self.active:
            running = dict(self.active)
            cycled = self._cycle()
            for ev in cycled:
                if ev.finish_reason is not None:
                    self._leave(running[ev.index])
            events += cycled
        return events

    def _admit(self, index: int, prompt: List[int], c: GenerationConfig, prefix_boundary: Optional[int]) -> None:
        draft = None if c.baseline else self.draft
        d = open_decoder(self.target, prompt, c, Hooks(), c.sampler(), draft=draft, eos_token_ids=self.eos_token_ids)
        d.stats.policy = f"batch of up to {self.max_batch}, chain of {d.stats.block_size}" if draft else "batch, plain"
        steps = d.prefill_steps(c.prefill_chunk, self.prefix_cache, prefix_boundary)
        self.prefilling.append((index, d, steps))

    def _leave(self, d: Decoder) -> None:
        """A slot that finished or was cancelled: snapshot its committed
        tokens into the prefix cache (as a solo generation does at its end)."""
        if d.prefix_run is not None:
            d.prefix_run.finish(d.history, d.pending_features())

    def _prefill_chunk(self) -> Optional[SlotEvent]:
        """The next chunk of the first slot in prefill; when that was its
        last, its first token (and the slot joins the decoding ones)."""
        index, d, steps = self.prefilling.popleft()
        if next(steps, StopIteration) is not StopIteration:
            self.prefilling.append((index, d, steps))
            return None
        out = d.emit([d.anchor])
        d.tic = time.perf_counter()
        if not d.finished:
            self.active.append((index, d))
        else:
            self._leave(d)
        return SlotEvent(index, out, d.stats.finish_reason, d.stats)

    def _cycle(self) -> List[SlotEvent]:
        ds: List[Decoder] = [d for _, d in self.active]
        # A slot's context end bounds every slot's width; its max_tokens does
        # not: rows past it are verified and not emitted (emit stops there).
        W = min([ds[0].stats.block_size] + [d.max_context - d.pos for d in ds])
        plan = Plan(max(W, 1))
        t0 = time.perf_counter()
        if plan.width > 1:
            items = [(d.draft_context(), d.anchor, d.pos, d.dcache, d.sampler, d.spec) for d in ds]
            props = [Proposal(plan, drafted=t, q=q) for t, q in propose_slots(self.draft, items, plan.width)]
        else:
            props = [Proposal(plan) for _ in ds]
        t1 = time.perf_counter()
        slots = SlotBatch([d.cache for d in ds])
        tokens = mx.stack([d.block_input(p) for d, p in zip(ds, props)])
        logits, feats = self.target.forward_slots(tokens, slots, capture=ds[0].capture, record=plan.width > 1)
        verified = [
            d.judge(p, logits[b], None if feats is None else feats[b]) for b, (d, p) in enumerate(zip(ds, props))
        ]
        t2 = time.perf_counter()
        paths = [d.accept(p, v) for d, p, v in zip(ds, props, verified)]
        if plan.width > 1:
            slots.rollback([len(path) for path in paths])
        events = []
        for (index, d), p, v, path in zip(self.active, props, verified, paths):
            out = d.commit(p, v, path, rolled_back=True)
            st = d.stats
            st.draft_time += t1 - t0  # the batch's draft, verify and rollback time
            st.verify_time += t2 - t1
            st.rollback_time += time.perf_counter() - t2
            st.add_cycle(len(path), plan.width, d.tic)
            if not d.finished and d.room() < 1:
                st.finish_reason = "length"  # context full
            events.append(SlotEvent(index, out, st.finish_reason, st))
        self.active = [(i, d) for i, d in self.active if not d.finished]
        return events


def batch_generate(
    engine,
    prompts: Sequence[Union[str, Sequence[int]]],
    config: Optional[GenerationConfig] = None,
    *,
    max_batch: int = 8,
    configs: Optional[Sequence[Optional[GenerationConfig]]] = None,
    prefix_cache=None,
    **options,
) -> List[GenerationResult]:
    """Generate for every prompt (text or token ids), up to ``max_batch`` at
    a time in one batch; results (text, tokens, stats) in prompt order.

    ``config`` and keyword ``options`` (the names :func:`mlx_dflash.generate`
    takes, mlx-lm's for sampling) apply to every request; ``configs[i]``
    (a :class:`~mlx_dflash.GenerationConfig`, or None) replaces ``config``
    for prompt i, e.g. its own ``seed``, ``temperature`` or ``max_tokens``.
    ``prefix_cache``: a :class:`~mlx_dflash.PrefixCache`, as
    :func:`mlx_dflash.stream_generate` takes it: each request restores its
    longest cached prefix when it joins (``stats.cached_tokens``) and is
    snapshotted into it when it leaves.

    Greedy, and sampling with ``accept_rule="equality"``, give each request
    the tokens :func:`mlx_dflash.generate` gives it alone. Chains only (no
    ``tree_budget``); the verify width is ``block_size`` (default: the
    draft's) for the whole batch, not the adaptive policy's choice.
    """
    if engine.stage is not None:
        raise DFlashError("batch_generate does not run on a pipeline-split target")
    if configs is not None and len(configs) != len(prompts):
        raise DFlashError(f"{len(configs)} configs for {len(prompts)} prompts")
    tok = engine.tokenizer
    if prefix_cache is not None:
        prefix_cache.bind(engine)
    batch = BatchDecoder(
        engine.target, engine.draft, max_batch=max_batch, eos_token_ids=tok.eos_token_ids, prefix_cache=prefix_cache
    )
    for i, prompt in enumerate(prompts):
        own = configs[i] if configs is not None and configs[i] is not None else config
        ids = engine.encode(prompt)
        boundary = prefix_cache.stable_boundary(tok, ids) if prefix_cache is not None else None
        batch.add(ids, own, prefix_boundary=boundary, **options)
    tokens = [[] for _ in prompts]
    stats = [None] * len(prompts)
    while not batch.done:
        for ev in batch.step():
            tokens[ev.index].extend(ev.tokens)
            stats[ev.index] = ev.stats
    results = []
    detok = tok.detokenizer
    for toks, st in zip(tokens, stats):
        detok.reset()
        for t in toks:
            if t not in tok.eos_token_ids:
                detok.add_token(t)
        detok.finalize()
        results.append(GenerationResult(detok.text, toks, st))
    return results


# `serve --max-batch` when not given (provisional: bench/batch.py measures
# concurrency 1, 2, 4 and 8); the server lowers it to what memory holds.
DEFAULT_MAX_BATCH = 4


def slot_bytes(target, draft=None, *, context: Optional[int] = None, kv_bits=None, draft_window=None) -> int:
    """Memory one slot may hold at ``context`` tokens (default: the target's
    context limit): the target's attention KV per token times the context,
    plus its DeltaNet recurrent and conv state (fixed per slot), plus the
    draft's context KV per token times the rows its window keeps. Measured
    on a one-token probe forward, so it holds for any KV format."""
    context = context or target.max_context
    cache = target.make_cache(kv_bits=kv_bits) if kv_bits else target.make_cache()
    capture = draft.target_layer_ids if draft is not None else ()
    _, feats = target.forward([0], cache, capture=capture, logits="none")
    mx.eval(cache.state())
    row = sum(c.nbytes() for c in cache.layers if c.sequence)
    total = row * context + sum(c.nbytes() for c in cache.layers if not c.sequence)
    if draft is not None and hasattr(draft, "add_context"):
        dcache = draft.make_cache(draft_window)
        draft.add_context(feats, dcache)
        rows = context if dcache.window is None else min(context, sum(dcache.window))
        total += rows * sum(a.nbytes for a in dcache.state())
    return total
