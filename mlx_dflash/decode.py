"""The decode loop (docs/math.md §5): prefill, draft, verify, accept, rollback.

Plain autoregressive decoding is the same loop with no draft: every cycle
verifies a block of one token (the anchor) and commits the bonus token.
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from . import ddtree
from .errors import DFlashError
from .kernels import path_rows as kernels_path
from .models.draft import propose
from .sampling import Sampler, speculative_rule


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from a prefix cache, not prefilled
    generated_tokens: int = 0
    cycles: int = 0
    block_size: int = 1
    # accept_hist[n] = cycles that committed n tokens (accepted drafts + bonus)
    accept_hist: List[int] = field(default_factory=list)
    cycle_commits: List[int] = field(default_factory=list)  # tokens committed by each cycle
    tree_sizes: List[int] = field(default_factory=list)  # tokens verified by each cycle
    prefill_time: float = 0.0
    decode_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    rollback_time: float = 0.0
    peak_memory: float = 0.0  # GB
    finish_reason: Optional[str] = None

    @property
    def tau(self) -> float:
        """Mean committed tokens per cycle."""
        n = sum(i * c for i, c in enumerate(self.accept_hist))
        return n / self.cycles if self.cycles else 0.0

    @property
    def depth_acceptance(self) -> List[float]:
        """Fraction of cycles whose accepted drafts reached depth d (d = 1, 2, ...)."""
        if not self.cycles:
            return []
        out, reach = [], self.cycles
        for n in range(1, len(self.accept_hist)):
            reach -= self.accept_hist[n]
            out.append(reach / self.cycles)
        while out and out[-1] == 0:
            out.pop()
        return out

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 0.0

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes from prefill; decode covers the rest.
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_time if self.decode_time else 0.0

    def add_cycle(self, committed: int, verified: int, tic: float) -> None:
        """Book one verify cycle (``committed`` tokens kept of ``verified``)."""
        self.cycles += 1
        self.accept_hist[committed] += 1
        self.cycle_commits.append(committed)
        self.tree_sizes.append(verified)
        self.decode_time = time.perf_counter() - tic
        self.peak_memory = mx.get_peak_memory() / 1e9

    @property
    def other_time(self) -> float:
        return max(self.decode_time - self.draft_time - self.verify_time - self.rollback_time, 0.0)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(tau=self.tau, prefill_tps=self.prefill_tps, decode_tps=self.decode_tps,
                 other_time=self.other_time, depth_acceptance=self.depth_acceptance,
                 mean_tree_size=self.mean_tree_size)
        return d


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def _plain_pipelined(target, cache, anchor, pos, sampler, stats, emit, max_tokens, max_context, tic):
    """Plain decoding with each step queued before the host reads the one
    before it (as mlx-lm's ``generate_step``), so the device never waits on
    Python. A step queued past the end is undone from a cache snapshot."""

    def step(tok: mx.array, p: int):
        snap = cache.snapshot()
        logits, _ = target.forward(tok, cache)
        nxt = sampler(logits, [p + 1]).astype(mx.int32)
        mx.async_eval(nxt)
        return snap, nxt

    queued = step(mx.array([anchor], dtype=mx.int32), pos) if pos < max_context else None
    while queued is not None:
        _, cur = queued
        queued = None
        if stats.generated_tokens + 1 < max_tokens and pos + 1 < max_context:
            queued = step(cur, pos + 1)
        tok = cur.item()
        pos += 1
        out = emit([tok])
        if stats.finish_reason is not None and queued is not None:
            cache.restore(queued[0])
            queued = None
        stats.add_cycle(1, 1, tic)
        yield out
    if stats.finish_reason is None:
        stats.finish_reason = "length"  # context full


def longest_match(drafted: List[int], picks: List[int]) -> int:
    """Chain acceptance (docs/math.md §5): drafted tokens kept while each equals the
    target's pick for the row before it."""
    a = 0
    while a < len(drafted) and drafted[a] == picks[a]:
        a += 1
    return a


def generate_tokens(
    target,
    prompt: Sequence[int],
    *,
    draft=None,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    eos_token_ids: Sequence[int] = (),
    sampler: Optional[Sampler] = None,
    tree_budget: int = 0,
    tree_topk: int = 4,
    draft_window=None,
    prefill_chunk: int = 512,
    max_context: Optional[int] = None,
    stats: Optional[GenerationStats] = None,
    cache=None,
    acceptance: Callable[[List[int], List[int]], int] = longest_match,
    profile: bool = False,
    accept_rule: str = "equality",
    spec_rule=speculative_rule,
    prefix_cache=None,
    prefix_boundary: Optional[int] = None,
) -> Iterator[List[int]]:
    """Yield lists of newly committed token ids until EOS or ``max_tokens``.

    ``draft``: a bound DFlash draft (or anything with ``target_layer_ids``,
    ``block_size``, ``make_cache(window)`` and ``__call__(features, anchor,
    anchor_pos, block_size, cache) -> logits [B-1, V]``); None = plain decoding.
    ``sampler``: a :class:`Sampler` (default greedy). Every emitted token is the
    target's own pick for its position, so the output equals plain decoding
    with the same sampler and seed. ``tree_budget`` > 0 verifies a DDTree of
    that many nodes (``tree_topk`` candidates per depth) instead of a chain.
    ``cache``: an empty ``target.make_cache()`` to use (and inspect afterwards);
    it ends holding the prompt and every emitted token but the last.
    ``acceptance``: the chain acceptance rule (a test hook; keep the default).
    ``profile``: synchronise after each phase so ``stats`` splits the time
    into draft / verify / rollback (slower; without it the device work of a
    cycle is queued as one graph and ``verify_time`` holds nearly all of it).
    ``accept_rule`` at temperature > 0 on a chain: "equality" (the draft's
    greedy block; a token is kept when it equals the target's own keyed
    sample, so every mode gives the same text for a seed) or "speculative"
    (the draft samples its block from its proposal q; a token is kept with
    probability min(1, p/q), the first rejected row resamples from the
    residual: the target's distribution, typically more tokens kept, but
    the text depends on the mode; the API and CLI default). ``spec_rule``:
    that rule (a test hook).
    ``prefix_cache``: a :class:`~mlx_dflash.prefix.PrefixCache` to restore the
    longest cached prefix of the prompt from and to snapshot into
    (``prefix_boundary``: the stable prompt boundary, see ``prefix.py``).
    """
    stats = stats if stats is not None else GenerationStats()
    prompt = list(prompt)
    max_context = max_context or target.max_context
    if not prompt:
        raise DFlashError("empty prompt: give at least one token")
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be positive, got {max_tokens}")
    if len(prompt) >= max_context:
        raise DFlashError(
            f"prompt has {len(prompt)} tokens; the context limit is {max_context}"
        )
    if accept_rule not in ("equality", "speculative"):
        raise DFlashError(f"acceptance rule must be 'equality' or 'speculative', got {accept_rule!r}")
    # The sequence (prompt + output) never holds more than max_context tokens:
    # the context limit is a length limit like max_tokens, the same in every mode.
    max_tokens = min(max_tokens, max_context - len(prompt))
    if tree_budget < 0 or tree_topk < 1:
        raise DFlashError(f"tree budget must be >= 0 and tree top-k >= 1, got {tree_budget}, {tree_topk}")
    if draft is not None:
        limit = draft.block_size
        block_size = block_size or limit
        if not 2 <= block_size <= limit:
            raise DFlashError(f"block size must be in 2..{limit} for this draft, got {block_size}")
    else:
        block_size = 1
        tree_budget = 0
    sampler = sampler or Sampler(0.0, seed=0)
    eos = set(eos_token_ids)
    stats.prompt_tokens = len(prompt)
    stats.block_size = block_size
    hist_len = max(block_size, tree_budget + 1)
    stats.accept_hist = [0] * (hist_len + 1)
    mx.reset_peak_memory()
    history = prompt  # committed tokens (for repetition-penalty contexts)

    capture = draft.target_layer_ids if draft is not None else ()
    cache = cache if cache is not None else target.make_cache()
    dcache = draft.make_cache(draft_window) if draft is not None else None
    tic = time.perf_counter()
    prefix_run = None
    if prefix_cache is not None:
        feats = None  # the draft consumes the prompt's features during the prefill
        logits, prefix_run = prefix_cache.prefill(
            target, prompt, cache, draft=draft, dcache=dcache, capture=capture,
            chunk_size=prefill_chunk, boundary=prefix_boundary, stats=stats)
    else:
        logits, feats = target.prefill(prompt, cache, capture=capture, chunk_size=prefill_chunk)
    anchor = int(sampler(logits, [len(prompt)], [history] if sampler.needs_context else None)[0].item())
    stats.prefill_time = time.perf_counter() - tic
    pos = len(prompt)  # position of the anchor (not yet in the target cache)

    def emit(tokens: List[int]) -> List[int]:
        out = []
        for t in tokens:
            out.append(t)
            stats.generated_tokens += 1
            if t in eos:
                stats.finish_reason = "stop"
                break
            if stats.generated_tokens >= max_tokens:
                stats.finish_reason = "length"
                break
        return out

    history = history + emit([anchor])
    yield history[-1:]
    if stats.finish_reason is not None:  # the first token was EOS, or max_tokens == 1
        return
    tic = time.perf_counter()
    if draft is None and not sampler.needs_context and not profile:
        plain = _plain_pipelined(target, cache, anchor, pos, sampler, stats, emit,
                                 max_tokens, max_context, tic)
        if prefix_run is None:
            yield from plain
            return
        for out in plain:
            history.extend(out)
            try:
                yield out
            except GeneratorExit:  # closed early: snapshot what is committed
                prefix_run.finish(history)
                raise
        prefix_run.finish(history)
        return

    def block_len(pos):
        """Tokens the next cycle verifies: the block, cut to what is left."""
        return min(block_size, max_tokens - stats.generated_tokens, max_context - pos)

    spec = accept_rule == "speculative" and not sampler.greedy and tree_budget == 0

    def launch_draft(feats, anchor, pos, B):
        """The draft's proposal for the next block, left lazy (chain: token
        ids and, with the speculative rule, q; tree: the logits ``ddtree.build`` reads)."""
        if tree_budget > 0:
            return draft(feats, anchor, pos, B, dcache)
        return propose(draft, feats, anchor, pos, B, dcache, sampler, sample=spec)

    pending = None  # the next cycle's draft, launched before yielding
    while stats.finish_reason is None:
        B = block_len(pos)
        if B < 1:
            stats.finish_reason = "length"  # context full
            break
        t0 = time.perf_counter()
        tree = None
        drafted_arr = q_arr = None
        if draft is not None and B > 1:
            proposal = pending if pending is not None else launch_draft(feats, anchor, pos, B)
            feats = None
            if tree_budget > 0:
                tree = ddtree.build(proposal, anchor, tree_budget, tree_topk)
            else:
                drafted_arr, q_arr = proposal
                if profile:
                    mx.eval(drafted_arr)
        pending = None
        t1 = time.perf_counter()
        if tree is not None:
            block, parents, depths = tree.tokens, tree.parents, tree.depths
            block_in = block
        else:
            parents = None
            depths = range(B if drafted_arr is not None else 1)
            anchor_arr = mx.array([anchor], dtype=mx.int32)
            block_in = anchor_arr if drafted_arr is None else mx.concatenate([anchor_arr, drafted_arr])
        record = len(depths) > 1
        vlogits, vfeats = target.forward(block_in, cache, capture=capture, record=record, parents=parents)
        positions = [pos + 1 + d for d in depths]
        contexts = None
        drafted: Optional[List[int]] = None
        if sampler.needs_context:
            # Each row's penalty context includes the drafts before it: read them first.
            drafted = drafted_arr.tolist() if drafted_arr is not None else []
            if tree is None:
                block = [anchor] + drafted
            rows = [kernels_path(parents, i) for i in range(len(block))] if tree is not None \
                else [list(range(i + 1)) for i in range(len(block))]
            contexts = [history + [block[j] for j in r[1:]] for r in rows]
        picks_arr = sampler(vlogits, positions, contexts)
        kept = None
        if q_arr is not None:
            kept, picks_arr = spec_rule(sampler.probs(vlogits, contexts), q_arr, drafted_arr, picks_arr,
                                        sampler.seed, positions)
        if drafted is None and drafted_arr is not None:
            mx.eval(picks_arr, drafted_arr, *(() if kept is None else (kept,)))  # the one host sync of a cycle
            drafted = drafted_arr.tolist()
        picks = picks_arr.tolist()
        t2 = time.perf_counter()
        if tree is not None:
            path = ddtree.walk(tree, picks)
        else:
            drafted = drafted or []
            block = [anchor] + drafted
            if kept is not None:
                kept = kept.tolist()
                n_acc = kept.index(False) if False in kept else len(kept)
            else:
                n_acc = acceptance(drafted, picks)
            path = list(range(n_acc + 1))
        n_keep = len(path)  # the anchor and the accepted drafts stay in the cache
        if record:
            # Left lazy: the next cycle's forward evaluates it.
            cache.rollback(n_keep, path=path if tree is not None else None)
            if profile:
                mx.eval(cache.state())
        if vfeats is not None:
            # Features of the committed rows become draft context. A draft
            # skipped this cycle (B == 1) keeps its pending rows.
            new = vfeats[mx.array(path)] if tree is not None else vfeats[:n_keep]
            feats = new if feats is None else mx.concatenate([feats, new], axis=0)
        t3 = time.perf_counter()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.rollback_time += t3 - t2
        anchor = picks[path[-1]]
        pos += n_keep
        out = emit([block[i] for i in path[1:]] + [anchor])
        history = history + out
        if draft is not None and not profile and stats.finish_reason is None:
            # Start the next draft now, so it runs while the caller handles
            # these tokens (detokenizing, printing).
            nB = block_len(pos)
            if nB > 1:
                pending = launch_draft(feats, anchor, pos, nB)
                feats = None
                mx.async_eval([x for x in (pending if isinstance(pending, tuple) else (pending,))
                               if x is not None])
        stats.add_cycle(n_keep, len(block), tic)
        try:
            yield out
        except GeneratorExit:  # closed early: snapshot what is committed
            if prefix_run is not None:
                prefix_run.finish(history, feats)
            raise
    stats.decode_time = time.perf_counter() - tic
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if prefix_run is not None:
        prefix_run.finish(history, feats)
