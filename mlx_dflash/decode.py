"""The decode loop (docs/math.md §5) as phases: propose, verify, accept, commit.

Each cycle the policy (``policy.Policy``) chooses what to verify: a chain of
B tokens (the anchor and B-1 drafts), a DDTree, or plain steps (B = 1, no
draft). ``Decoder`` holds one generation's state and has one method per
phase; ``generate_tokens`` is the loop that asks the policy and runs them.
"""

import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from . import ddtree
from .config import GenerationConfig
from .errors import DFlashError, is_int
from .models.draft import propose as draft_propose
from .policy import Plan, Policy, forget_costs, load_costs
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
    policy: str = ""  # how widths were chosen (Policy.describe)
    switches: List[str] = field(default_factory=list)  # adaptive: why each change of width happened
    shadow_drafts: int = 0  # drafts proposed during plain steps and scored, never verified

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
    def widths(self) -> dict:
        """Cycles per verify width chosen (1 = a plain step)."""
        out = {}
        for w in self.tree_sizes:
            out[w] = out.get(w, 0) + 1
        return dict(sorted(out.items()))

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
        d.update(
            tau=self.tau,
            prefill_tps=self.prefill_tps,
            decode_tps=self.decode_tps,
            other_time=self.other_time,
            depth_acceptance=self.depth_acceptance,
            widths=self.widths,
            mean_tree_size=self.mean_tree_size,
        )
        return d


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def longest_match(drafted: List[int], picks: List[int]) -> int:
    """Chain acceptance (docs/math.md §5): drafted tokens kept while each equals the
    target's pick for the row before it."""
    a = 0
    while a < len(drafted) and drafted[a] == picks[a]:
        a += 1
    return a


@dataclass
class Proposal:
    """What one cycle verifies: the anchor plus a chain of drafts (on device)
    or a DDTree; neither for a plain step."""

    plan: Plan
    drafted: Optional[mx.array] = None  # chain: draft token ids [B-1]
    q: Optional[mx.array] = None  # chain, speculative rule: the draft's sampling distribution per row
    tree: Optional[ddtree.Tree] = None
    logits: Optional[mx.array] = None  # tree: the draft's logits, until the tree is built

    @property
    def width(self) -> int:
        if self.tree is not None:
            return len(self.tree)
        return 1 + (self.drafted.shape[0] if self.drafted is not None else 0)


@dataclass
class Verified:
    """The target's picks for each verified row, and the drafts as host ints."""

    block: List[int]  # tokens verified (anchor first; tree nodes in order)
    picks: List[int]
    features: Optional[mx.array]  # captured target features of every row
    kept: Optional[List[bool]] = None  # speculative rule: each drafted row kept or not


class Decoder:
    """One generation's state (caches, position, anchor, committed history)
    and the phases of a cycle. The anchor is the last committed token; it is
    not in the target cache yet and sits at position ``pos``."""

    def __init__(
        self,
        target,
        cache,
        draft,
        dcache,
        sampler: Sampler,
        stats: GenerationStats,
        eos,
        max_tokens: int,
        max_context: int,
        profile: bool,
        acceptance,
        tree_topk: int,
        spec: bool = False,
        spec_rule=speculative_rule,
    ):
        self.target, self.cache, self.draft, self.dcache = target, cache, draft, dcache
        self.sampler, self.stats, self.eos = sampler, stats, eos
        self.max_tokens, self.max_context = max_tokens, max_context
        self.profile, self.acceptance, self.tree_topk = profile, acceptance, tree_topk
        self.spec, self.spec_rule = spec, spec_rule  # the speculative acceptance rule (T > 0, chain)
        self.capture = draft.target_layer_ids if draft is not None else ()
        self.feats: List[mx.array] = []  # target features of committed rows the draft has not read
        self.history: List[int] = []  # committed tokens (for repetition-penalty contexts)
        self.anchor = 0
        self.pos = 0
        self.pending: Optional[Proposal] = None  # the next cycle's draft, launched early
        self.committed = self.verified = 0  # tokens kept / verified by the last cycle
        self.prefix_run = None  # a prefix cache's run for this generation
        self.tic = 0.0
        self.shadow = None  # a shadow draft in flight: (anchor position, drafted tokens)
        self.shadow_in: Optional[int] = None  # plain steps before the next shadow draft (None: not set)
        self.shadow_read = 0  # committed rows the shadow draft in flight read first
        self.rows_read = 0  # committed rows handed to the draft so far (the policy prices reading them)

    # --- bookkeeping -------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stats.finish_reason is not None

    def room(self) -> int:
        """Tokens the next cycle may verify: what is left of max_tokens and the context."""
        return min(self.max_tokens - self.stats.generated_tokens, self.max_context - self.pos)

    def emit(self, tokens: List[int]) -> List[int]:
        """Hand out committed tokens up to EOS or max_tokens."""
        out = []
        st = self.stats
        for t in tokens:
            out.append(t)
            st.generated_tokens += 1
            if t in self.eos:
                st.finish_reason = "stop"
                break
            if st.generated_tokens >= self.max_tokens:
                st.finish_reason = "length"
                break
        self.history.extend(out)
        return out

    def add_features(self, f: Optional[mx.array]) -> None:
        if f is not None:
            self.feats.append(f)

    def pending_features(self) -> Optional[mx.array]:
        """The committed rows' features the draft has not read, in one array."""
        if not self.feats:
            return None
        return self.feats[0] if len(self.feats) == 1 else mx.concatenate(self.feats, axis=0)

    def unread(self) -> int:
        """Committed rows the draft's next forward will read."""
        rows = sum(f.shape[0] for f in self.feats)
        dropped = getattr(self.dcache, "dropped", None)
        return rows - (dropped(rows) if dropped is not None else 0)

    def draft_context(self) -> Optional[mx.array]:
        """The pending feature rows, in one array; rows the draft's window would
        drop on arrival are never handed over."""
        if not self.feats:
            return None
        f = self.feats[0] if len(self.feats) == 1 else mx.concatenate(self.feats, axis=0)
        self.feats = []
        skip = getattr(self.dcache, "skip", None)
        n = skip(f.shape[0]) if skip is not None else 0
        self.rows_read += f.shape[0] - n
        return f[n:] if n else f

    def sync(self, *arrays) -> None:
        if self.profile:
            mx.eval(*arrays)

    # --- prefill -----------------------------------------------------------------
    def prefill(self, chunk_size: int, prefix_cache=None, prefix_boundary=None, progress=None):
        """Prefill the prompt (``history``) alone, in chunks of ``chunk_size``,
        and sample the first token (the anchor). With a ``prefix_cache``, the
        longest cached prefix is restored first; returns its run (or None).
        ``progress(processed, total)``: after each chunk, then ``(total, total)``."""
        total = len(self.history)
        for _ in self.prefill_steps(chunk_size, prefix_cache, prefix_boundary):
            if progress is not None:
                progress(self.cache.offset, total)
        self.stats.peak_memory = mx.get_peak_memory() / 1e9  # (cycles update it from here)
        if progress is not None:
            progress(total, total)
        return self.prefix_run

    def prefill_steps(self, chunk_size: int, prefix_cache=None, prefix_boundary=None) -> Iterator[None]:
        """:meth:`prefill` one chunk per step: yields between chunks, so a
        batch runs its cycles in between. Its chunks, and so its cache, are a
        solo prefill's."""
        prompt = list(self.history)
        tic = time.perf_counter()
        self.stats.prefill_time = 0.0
        self.prefix_run = None
        if prefix_cache is not None:
            # The draft consumes the prompt's features during this prefill.
            for out in prefix_cache.prefill_steps(
                self.target,
                prompt,
                self.cache,
                draft=self.draft,
                dcache=self.dcache,
                capture=self.capture,
                chunk_size=chunk_size,
                boundary=prefix_boundary,
                stats=self.stats,
            ):
                if out is None:
                    self.stats.prefill_time += time.perf_counter() - tic
                    yield
                    tic = time.perf_counter()
            logits, self.prefix_run = out
        else:
            # Features only of the rows the draft's window will read.
            skip = getattr(self.dcache, "skip", None)
            first = skip(len(prompt)) if skip is not None else 0
            for out in self.target.prefill_steps(
                prompt, self.cache, capture=self.capture, chunk_size=chunk_size, capture_from=first
            ):
                if out is None:  # time spent away is not prefill time
                    self.stats.prefill_time += time.perf_counter() - tic
                    yield
                    tic = time.perf_counter()
            logits, feats = out
            self.add_features(feats)
        sampler = self.sampler
        self.anchor = int(sampler(logits, [len(prompt)], [self.history] if sampler.needs_context else None)[0].item())
        self.stats.prefill_time += time.perf_counter() - tic
        self.pos = len(prompt)

    # --- propose -----------------------------------------------------------------
    def launch(self, plan: Plan) -> Proposal:
        """The draft's proposal for ``plan``, left lazy (chain: token ids; tree:
        built from the draft's logits, which reads them)."""
        B = plan.block if plan.tree else max(plan.block, plan.width)
        if plan.tree:
            return Proposal(plan, logits=self.draft(self.draft_context(), self.anchor, self.pos, B, self.dcache))
        drafted, q = draft_propose(
            self.draft, self.draft_context(), self.anchor, self.pos, B, self.dcache, self.sampler, sample=self.spec
        )
        if B > plan.width:  # drafted from the full block, verified up to the width
            drafted = drafted[: plan.width - 1]
            q = q[: plan.width - 1] if q is not None else None
        return Proposal(plan, drafted=drafted, q=q)

    def propose(self, plan: Plan, launched: Optional[Proposal] = None) -> Proposal:
        """The proposal to verify: ``launched`` (a batch drafted it with its
        siblings'), else the one prefetched, else :meth:`launch`'s."""
        if plan.width == 1:
            return Proposal(plan)
        prop = launched if launched is not None else self.pending if self.pending is not None else self.launch(plan)
        self.pending = None
        if prop.logits is not None:
            prop.tree = ddtree.build(prop.logits, self.anchor, plan.width - 1, self.tree_topk)
            prop.logits = None
        self.sync(prop.drafted if prop.drafted is not None else [])
        return prop

    def prefetch(self, plan: Plan) -> None:
        """Queue the next cycle's draft now, so it runs while the caller
        handles this cycle's tokens (detokenizing, printing)."""
        if plan.width > 1 and not self.profile and not self.finished:
            self.pending = self.launch(plan)
            p = self.pending
            mx.async_eval([x for x in (p.drafted, p.q, p.logits) if x is not None])

    # --- verify ------------------------------------------------------------------
    def block_input(self, prop: Proposal) -> mx.array:
        """A chain proposal's tokens to verify: the anchor, then the drafts."""
        anchor = mx.array([self.anchor], dtype=mx.int32)
        return anchor if prop.drafted is None else mx.concatenate([anchor, prop.drafted])

    def verify(self, prop: Proposal) -> Verified:
        """One target forward over the proposal; the target's pick per row."""
        tree = prop.tree
        if tree is not None:
            block_in, parents = tree.tokens, tree.parents
        else:
            block_in, parents = self.block_input(prop), None
        vlogits, vfeats = self.target.forward(
            block_in, self.cache, capture=self.capture, record=prop.width > 1, parents=parents
        )
        return self.judge(prop, vlogits, vfeats)

    def picks(self, prop: Proposal, vlogits: mx.array) -> tuple:
        """The target's pick per verified row from the verify forward's logits
        [W, V], left lazy: (picks, kept by the speculative rule or None, the
        drafted tokens if the penalty context had to read them, else None)."""
        tree = prop.tree
        depths = tree.depths if tree is not None else range(prop.width)
        positions = [self.pos + 1 + d for d in depths]
        drafted = None
        contexts = None
        if self.sampler.needs_context:
            # Each row's penalty context includes the drafts before it: read them first.
            drafted = prop.drafted.tolist() if prop.drafted is not None else []
            block = tree.tokens if tree is not None else [self.anchor] + drafted
            rows = (
                [ddtree.path_rows(tree.parents, i) for i in range(len(block))]
                if tree is not None
                else [list(range(i + 1)) for i in range(len(block))]
            )
            tail = self.history[-self.sampler.repetition_context_size :]
            contexts = [tail + [block[j] for j in r[1:]] for r in rows]
        picks = self.sampler(vlogits, positions, contexts)
        kept = None
        if prop.q is not None:
            kept, picks = self.spec_rule(
                self.sampler.probs(vlogits, contexts), prop.q, prop.drafted, picks, self.sampler.seed, positions
            )
        return picks, kept, drafted

    @staticmethod
    def pending_reads(prop: Proposal, verdict: tuple) -> list:
        """What :meth:`judge` reads to the host for ``verdict`` (:meth:`picks`'
        result): evaluated together, several slots' reads are one host sync."""
        return [x for x in (verdict[0], verdict[1], prop.drafted) if x is not None]

    def judge(
        self, prop: Proposal, vlogits: mx.array, vfeats: Optional[mx.array], verdict: Optional[tuple] = None
    ) -> Verified:
        """The target's pick per verified row, read to the host, with the
        features the verify captured; ``verdict``: :meth:`picks`' result if
        the caller already made (and evaluated) it."""
        picks, kept, drafted = verdict if verdict is not None else self.picks(prop, vlogits)
        if drafted is None and prop.drafted is not None:
            mx.eval(self.pending_reads(prop, (picks, kept)))  # the one host sync of a cycle
            drafted = prop.drafted.tolist()
        block = prop.tree.tokens if prop.tree is not None else [self.anchor] + (drafted or [])
        return Verified(block, picks.tolist(), vfeats, kept.tolist() if kept is not None else None)

    # --- accept ------------------------------------------------------------------
    def accept(self, prop: Proposal, v: Verified) -> List[int]:
        """The block rows kept, root first: the longest drafted prefix the
        target agrees with (chain), or the tree path along its picks."""
        if prop.tree is not None:
            return ddtree.walk(prop.tree, v.picks)
        if v.kept is not None:  # the speculative rule: rows kept up to the first rejected
            return list(range((v.kept.index(False) if False in v.kept else len(v.kept)) + 1))
        return list(range(self.acceptance(v.block[1:], v.picks) + 1))

    # --- commit / rollback ---------------------------------------------------------
    def commit(self, prop: Proposal, v: Verified, path: List[int], rolled_back: bool = False) -> List[int]:
        """Keep the accepted rows in the caches (rollback of the rest, left
        lazy for the next forward; ``rolled_back``: the caller did it), hand
        their features to the draft, and emit the accepted drafts plus the
        bonus token."""
        n_keep = len(path)
        if prop.width > 1 and not rolled_back:
            self.cache.rollback(n_keep, path=path if prop.tree is not None else None)
            self.sync(self.cache.state())
        if v.features is not None:
            self.add_features(v.features[mx.array(path)] if prop.tree is not None else v.features[:n_keep])
        self.anchor = v.picks[path[-1]]
        self.pos += n_keep
        return self.emit([v.block[i] for i in path[1:]] + [self.anchor])

    # --- one cycle, and runs of plain steps --------------------------------------------
    def cycle(self, plan: Plan) -> List[int]:
        """propose -> verify -> accept -> commit; sets ``committed`` and ``verified``."""
        st = self.stats
        t0 = time.perf_counter()
        prop = self.propose(plan)
        t1 = time.perf_counter()
        v = self.verify(prop)
        t2 = time.perf_counter()
        path = self.accept(prop, v)
        out = self.commit(prop, v, path)
        t3 = time.perf_counter()
        st.draft_time += t1 - t0
        st.verify_time += t2 - t1
        st.rollback_time += t3 - t2
        self.committed, self.verified = len(path), len(v.block)
        if plan.width > 1:
            self.shadow_in = None  # a new plain stretch starts its shadow count afresh
        return out

    def plain_steps(self, n: int, shadow: int = 0, scored=None) -> Iterator[List[int]]:
        """Up to ``n`` plain steps, each queued before the host reads the one
        before it (as mlx-lm's ``generate_step``), so the device never waits
        on Python. A step queued past EOS is undone from a cache snapshot.

        ``shadow``: every so many steps the draft proposes a block from the
        committed state (a shadow draft: never verified or emitted, so the
        output is plain decoding's), queued behind the next step; once plain
        decoding has committed the tokens it guessed, or a miss shows,
        ``scored(compared, matched, rows it read, partial=False)`` books it
        and returns the steps to the next one, or 0 to end the run (no
        further step is queued). While it is all right so far it is offered
        with ``partial=True``, and ``scored`` returns None to wait for more."""
        shadows = shadow > 0 and self.draft is not None and scored is not None
        if shadows and self.shadow_in is None:
            self.shadow_in = shadow
        if self.sampler.needs_context or self.profile:
            for _ in range(n):
                out = self.cycle(Plan(1))
                self.stats.add_cycle(1, 1, self.tic)
                stop = shadows and self.shadow_step(scored)
                yield out
                if self.finished or self.room() < 1 or stop:
                    break
            if shadows:
                self.shadow_score(scored)
            return
        target, cache, sampler = self.target, self.cache, self.sampler

        def step(tok: mx.array, p: int):
            snap = cache.snapshot()
            logits, f = target.forward(tok, cache, capture=self.capture)
            nxt = sampler(logits, [p + 1]).astype(mx.int32)
            mx.async_eval(nxt, *(() if f is None else (f,)))
            return snap, nxt, f

        left = min(n, self.room())
        queued = step(mx.array([self.anchor], dtype=mx.int32), self.pos) if left > 0 else None
        try:
            while queued is not None:
                _, cur, f = queued
                queued = None
                left -= 1
                if left > 0:
                    queued = step(cur, self.pos + 1)
                self.anchor = cur.item()
                self.add_features(f)
                self.pos += 1
                out = self.emit([self.anchor])
                if self.finished and queued is not None:
                    cache.restore(queued[0])
                    queued = None
                self.stats.add_cycle(1, 1, self.tic)
                if shadows and not self.finished and self.shadow_step(scored):
                    left = 0  # drafting pays: the step already queued is the run's last
                yield out
        finally:
            if queued is not None:  # closed early: the step queued past the last yield is undone
                cache.restore(queued[0])
        if shadows:
            self.shadow_score(scored)

    def pause(self) -> None:
        """Leave the solo loop between two of its yields (a batch takes the
        slot over): the draft launched early and a shadow draft in flight are
        dropped. Their context rows are already in the draft's cache, and the
        target's cache holds exactly the committed tokens."""
        self.pending = None
        self.shadow = None
        self.shadow_in = None

    # --- shadow drafts: evidence while decoding plainly ---------------------------------
    def shadow_step(self, scored) -> bool:
        """After a plain step: score the shadow draft in flight once plain
        decoding has committed all it guessed or a miss shows, launch the
        next when due. True when ``scored`` says the run should end."""
        if self.shadow is not None:
            at, drafted = self.shadow
            n = self.pos - at  # tokens committed after its anchor
            # From the second step on the draft has surely run (a step queued
            # after it has been read), so looking costs no wait. Scored once
            # it is all committed or a miss shows; while it is all right so
            # far, the policy may take that much as enough.
            if n >= min(len(drafted), 2):
                whole = n >= len(drafted) or self.acceptance(self._shadow_guess()[:n], self.history[at + 1 :]) < n
                if self.shadow_score(scored, partial=not whole):
                    return True
        if self.shadow is None and self.shadow_in is not None:
            self.shadow_in -= 1
            if self.shadow_in <= 0 and self.room() > 1:
                # The draft reads the committed rows' features and proposes its
                # full block from the anchor, as a drafted cycle would; queued
                # behind the next plain step, read only once it is scored.
                read = self.rows_read
                drafted, _ = draft_propose(
                    self.draft, self.draft_context(), self.anchor, self.pos, self.draft.block_size, self.dcache
                )
                self.shadow_read = self.rows_read - read
                mx.async_eval(drafted)
                self.shadow = (self.pos, drafted)
        return False

    def _shadow_guess(self) -> List[int]:
        """The shadow draft's tokens, read from the device once."""
        at, drafted = self.shadow
        if not isinstance(drafted, list):
            drafted = drafted.tolist()
            self.shadow = (at, drafted)
        return drafted

    def shadow_score(self, scored, partial: bool = False) -> bool:
        """Compare the shadow draft in flight with the tokens committed after
        its anchor (at a run's end: as many as there are) and book it; True
        when ``scored`` says the run should end. ``partial``: its tokens
        committed so far are all right and more are to come; ``scored`` may
        decline to book it yet (None), and it stays in flight."""
        if self.shadow is None:
            return False
        at, drafted = self.shadow
        committed = self.history[at + 1 : at + 1 + len(drafted)]
        guess = self._shadow_guess()[: len(committed)]
        if not committed:
            self.shadow = None
            return False
        gap = scored(len(committed), self.acceptance(guess, committed), self.shadow_read, partial=partial)
        if gap is None:  # not booked yet: it stays in flight
            return False
        self.shadow = None
        self.stats.shadow_drafts += 1
        self.shadow_in = gap if gap > 0 else None
        return gap == 0


@dataclass
class Hooks:
    """Stand-ins for the loop's own pieces, so tests can drive it with scripted ones."""

    acceptance: Callable[[List[int], List[int]], int] = longest_match  # the chain acceptance rule
    spec_rule: Callable = speculative_rule  # the speculative acceptance rule
    policy: Optional[Policy] = None  # widths per cycle (default: made from the config)
    sampler: Optional[Sampler] = None  # default: made from the config

    @classmethod
    def take(cls, options: dict) -> "Hooks":
        """Hooks out of a keyword dict (removed from it), the rest being config options."""
        return cls(**{k: options.pop(k) for k in cls.__dataclass_fields__ if k in options})


def generate_tokens(
    target,
    prompt: Sequence[int],
    config: Optional[GenerationConfig] = None,
    *,
    draft=None,
    eos_token_ids: Sequence[int] = (),
    stats: Optional[GenerationStats] = None,
    cache=None,
    prefix_cache=None,
    prefix_boundary: Optional[int] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    **options,
) -> Iterator[List[int]]:
    """Yield lists of newly committed token ids until EOS or ``max_tokens``.

    ``config``: a :class:`~mlx_dflash.config.GenerationConfig` (default: its
    defaults); keyword ``options`` (its field names) override it.
    ``draft``: a bound DFlash draft (or anything with ``target_layer_ids``,
    ``block_size``, ``make_cache(window)`` and ``__call__(features, anchor,
    anchor_pos, block_size, cache) -> logits [B-1, V]``); None (or
    ``baseline``) = plain decoding. Every emitted token is the target's own
    pick for its position, so the output equals plain decoding with the same
    sampling options and seed. See ``GenerationConfig`` and
    :func:`mlx_dflash.stream_generate` for what each option does.
    ``stats``: a :class:`GenerationStats` filled live.
    ``cache``: an empty ``target.make_cache()`` to use (and inspect afterwards);
    it ends holding the prompt and every emitted token but the last.
    ``prefix_cache``: a :class:`~mlx_dflash.prefix.PrefixCache` to restore the
    longest cached prefix of the prompt from and to snapshot into
    (``prefix_boundary``: the stable prompt boundary, see ``prefix.py``).
    ``prompt_progress_callback(processed, total)``: called after each prefill
    chunk with the prompt tokens in the cache (restored ones included), and
    once at the end with ``(total, total)``, as mlx-lm calls it; an exception
    it raises ends the generation there (a server's cancel or timeout).
    """
    yield from _generate_tokens(
        target,
        prompt,
        config,
        draft=draft,
        eos_token_ids=eos_token_ids,
        stats=stats,
        cache=cache,
        prefix_cache=prefix_cache,
        prefix_boundary=prefix_boundary,
        prompt_progress_callback=prompt_progress_callback,
        **options,
    )


def speculative(c: GenerationConfig, sampler: Sampler) -> bool:
    """Whether ``c`` verifies with the speculative rule (T > 0, chain)."""
    return c.accept_rule == "speculative" and not sampler.greedy and c.tree_budget == 0


def check_prompt(target, prompt: Sequence[int], c: GenerationConfig) -> int:
    """Refuse a prompt that is empty or fills the context, and token ids of
    ``c`` outside the vocabulary; returns the context limit."""
    max_context = c.max_context or target.max_context
    if max_context > target.max_context:
        raise DFlashError(f"max_context {max_context} is beyond the model's context of {target.max_context} tokens")
    if not len(prompt):
        raise DFlashError("empty prompt: give at least one token")
    V = target.vocab_size
    bad = [t for t in prompt if not is_int(t) or not 0 <= t < V]
    if bad:  # an id past the embedding would read outside it
        raise DFlashError(f"prompt token id {bad[0]!r} is not a token of this model (ids are integers 0..{V - 1})")
    if len(prompt) >= max_context:
        raise DFlashError(f"prompt has {len(prompt)} tokens; the context limit is {max_context}")
    bad = [t for t in c.xtc_special_tokens if not 0 <= t < V]
    if bad:  # the sampler gathers their logits: an id past the vocabulary would read outside them
        raise DFlashError(f"xtc_special_tokens: {bad[0]} is not a token of this model (ids are 0..{V - 1})")
    return max_context


def open_decoder(
    target,
    prompt,
    c: GenerationConfig,
    hooks: "Hooks",
    sampler: Sampler,
    *,
    draft,
    eos_token_ids=(),
    stats=None,
    cache=None,
) -> Decoder:
    """A :class:`Decoder` for ``prompt`` under the (validated) options ``c``,
    its caches made, ready for :meth:`Decoder.prefill`; ``draft`` is None for
    plain decoding."""
    stats = stats if stats is not None else GenerationStats()
    prompt = list(prompt)
    max_context = check_prompt(target, prompt, c)
    # The sequence (prompt + output) never holds more than max_context tokens:
    # the context limit is a length limit like max_tokens, the same in every mode.
    max_tokens = min(c.max_tokens, max_context - len(prompt))
    block_size = (c.block_size or draft.block_size) if draft is not None else 1
    if cache is None:
        cache = target.make_cache(kv_bits=c.kv_bits) if c.kv_bits else target.make_cache()
    stats.prompt_tokens = len(prompt)
    stats.block_size = block_size
    stats.accept_hist = [0] * (max(block_size, c.tree_budget + 1, c.auto_tree + 1) + 1)
    dcache = draft.make_cache(c.draft_window) if draft is not None else None
    d = Decoder(
        target,
        cache,
        draft,
        dcache,
        sampler,
        stats,
        set(eos_token_ids),
        max_tokens,
        max_context,
        c.profile,
        hooks.acceptance,
        c.tree_topk,
        speculative(c, sampler),
        hooks.spec_rule,
    )
    d.history = prompt
    return d


def make_policy(target, draft, c: GenerationConfig, sampler: Sampler, kv_bits: Optional[int] = None) -> Policy:
    """The width policy a solo generation under ``c`` runs with: pinned by
    ``block_size``, ``tree_budget``, ``adaptive=False`` or the speculative
    rule, else adaptive on the pair's measured costs (``kv_bits``: the
    cache's KV format); plain steps without a draft."""
    if draft is None:
        return Policy(1)
    # The speculative rule's text depends on what was drafted, so widths
    # chosen from timings would make a seed's text vary run to run: it keeps
    # the full block (greedy and the equality rule do not depend on it).
    pinned = c.block_size is not None or c.tree_budget > 0 or not c.adaptive or speculative(c, sampler)
    # Measured (once per machine and model) before this generation's cache
    # exists: a pipeline-split target has one live cache at a time.
    trees = (c.auto_tree + 1,) if c.auto_tree else ()
    costs = None if pinned else load_costs(target, draft, kv_bits=kv_bits, tree_sizes=trees)[0]
    return Policy(draft.block_size, costs, fixed=c.block_size, tree_budget=c.tree_budget, auto_tree=c.auto_tree)


def _generate_tokens(
    target,
    prompt,
    config=None,
    *,
    hooks: Optional[Hooks] = None,
    draft=None,
    eos_token_ids=(),
    stats=None,
    cache=None,
    prefix_cache=None,
    prefix_boundary=None,
    prompt_progress_callback=None,
    **options,
) -> Iterator[List[int]]:
    """:func:`generate_tokens` with ``hooks`` (tests call this directly)."""
    c = GenerationConfig.build(config, **options)
    hooks = hooks or Hooks()
    if c.baseline:
        draft = None
    c.validate(draft)
    prompt = list(prompt)
    check_prompt(target, prompt, c)
    sampler = hooks.sampler or c.sampler()
    bits = getattr(cache, "kv_bits", None) if cache is not None else c.kv_bits
    policy = (
        hooks.policy if hooks.policy is not None and draft is not None else make_policy(target, draft, c, sampler, bits)
    )
    d = open_decoder(
        target, prompt, c, hooks, sampler, draft=draft, eos_token_ids=eos_token_ids, stats=stats, cache=cache
    )
    d.stats.policy = policy.describe() if draft is not None else "plain"
    mx.reset_peak_memory()
    prefix_run = d.prefill(c.prefill_chunk, prefix_cache, prefix_boundary, progress=prompt_progress_callback)
    try:
        yield d.emit([d.anchor])
        if d.finished:  # the first token was EOS, or max_tokens == 1
            if prefix_run is not None:  # the next turn restores prompt and reply, as after a longer one
                prefix_run.finish(d.history, d.pending_features())
            return
        d.tic = time.perf_counter()
        yield from decode_loop(d, policy, c.profile)
    except GeneratorExit:  # closed early (at the first token too): snapshot what is committed
        if prefix_run is not None:
            prefix_run.finish(d.history, d.pending_features())
        raise
    if prefix_run is not None:
        prefix_run.finish(d.history, d.pending_features())


def decode_loop(d: Decoder, policy: Policy, profile: bool = False) -> Iterator[List[int]]:
    """Cycles until done: ask the policy, run plain steps or one drafted
    cycle (propose, verify, accept, commit), book it, yield its tokens.
    Closed early, it leaves ``d`` at its last yield (see :meth:`Decoder.pause`)."""
    stats = d.stats

    plan = policy.plan(d.room(), d.pos, d.unread())
    timed = None  # (plan, tokens, start, rows read before it) of the last cycle or plain run, timed up to the next
    # Where the last one ended (its time, rows read by then): a drafted cycle
    # ends where the next one's draft is launched (prefetched), so each window
    # holds its own draft. (Ended at the loop's top, the cycle before a plain
    # run read 0.7-0.8 of the cycles around it and the one after a plain run
    # 1.3x, and the correction's samples, taken at those changes, scattered
    # 0.6-1.4 with their median off by where the changes fell.)
    mark = None
    while not d.finished:
        if mark is None:  # after a plain run: it ends here
            mark = (time.perf_counter(), d.rows_read)
        if timed is not None and not profile:
            policy.timed(timed[0], timed[1], mark[0] - timed[2], mark[1] - timed[3])
        if d.room() < 1:
            stats.finish_reason = "length"  # context full
            break
        (start, read), mark = mark, None
        if plan.width == 1:
            n = 0
            with closing(d.plain_steps(plan.steps, plan.shadow, policy.shadowed)) as steps:
                for out in steps:
                    n += 1
                    yield out
            policy.observe(plan, n)
            # Timed from the run's start to the next cycle's, as a drafted
            # cycle is: each side then pays its own fill and host work. (Timed
            # from the first token read, a 4-step calibration run came out at
            # 0.6-0.7 of a plain step, as the host's work after that read
            # overlapped the next step, and every generation carried a
            # correction of 1.6-1.8 against drafting: a 16-wide look then
            # seemed to cost 4.7 plain steps where it costs 3.)
            timed = (plan, n, start, read) if n > 0 else None
        else:
            out = d.cycle(plan)
            policy.observe(plan, d.committed)
            timed = (plan, d.committed, start, read)
            nxt = policy.plan(d.room(), d.pos, d.unread()) if not d.finished else plan
            if nxt.width > 1:
                mark = (time.perf_counter(), d.rows_read)
            d.prefetch(nxt)
            stats.add_cycle(len(out), d.verified, d.tic)  # tokens past EOS or max_tokens are no output
            yield out
            plan = nxt
            continue
        plan = policy.plan(d.room(), d.pos, d.unread())
    stats.decode_time = time.perf_counter() - d.tic
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if policy.drifted() and forget_costs(policy.costs):
        policy.switches.append(
            f"the cost curve was measured under load (this run took x{policy.load():.2f} of its times): "
            "it is measured again before the next generation"
        )
    stats.switches = policy.switches
