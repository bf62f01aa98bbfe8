"""Several requests decoded together, each exactly as it would decode alone.

A :class:`BatchDecoder` holds up to ``max_batch`` slots. A request takes a
free slot between cycles and prefills alone (B = 1, its own chunks, so its
cache is its solo run's), then samples its first token and joins. A step
runs prefill chunks (round robin) only until ``prefill_budget`` tokens are
done (at least one chunk), then one cycle: running slots keep streaming, a cycle delayed by about one budget's
prefill at most, and short prompts join several at a time. Each cycle drafts for
every active slot in one draft forward (``propose_slots``; each slot's
context on its own), verifies all slots' chains (or, with ``tree_budget``,
a DDTree per slot) in one :meth:`Target.forward_slots` of one width W, and
accepts, commits and rolls back per slot
(:class:`~mlx_dflash.cache.SlotBatch`). A slot leaves the moment it hits
EOS, ``max_tokens`` or the context end. While one slot alone is decoding,
it runs the solo loop (:meth:`BatchDecoder._alone`): a batch of one is a
solo generation, its widths, pipelined plain steps and speed included.

W is chosen per cycle for the whole batch by :class:`BatchPolicy`: the
width with the most expected committed tokens, summed over the slots, per
second of a batch cycle (:class:`BatchCosts`), W = 1 being a plain step for
the batch; pinned, as a solo run is, by ``block_size``, ``adaptive=False``,
``tree_budget`` or the speculative rule. It is cut to the context room the
tightest slot has left (a slot near its ``max_tokens`` verifies the full
width; emit stops at its limit). Greedy and the equality rule give each
request its solo tokens (every emitted token is the target's pick, and each
slot's rows are its solo forward's).
"""

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .api import GenerationResult, check_engine, check_prefix_cache
from .cache import SlotBatch
from .config import GenerationConfig
from .decode import (
    Decoder,
    GenerationStats,
    Hooks,
    Proposal,
    Verified,
    check_prompt,
    decode_loop,
    make_policy,
    open_decoder,
)
from .detokenize import Detokenizer
from .errors import DFlashError, is_int, token_ids
from .models.draft import draft_logits_slots, propose_slots
from .policy import (
    Acceptance,
    Plan,
    Policy,
    cost_key,
    default_cache_dir,
    evidence_margin,
    interpolate,
    machine_id,
    write_json,
)
from .sampling import Sampler


@dataclass
class SlotEvent:
    """Tokens a request committed in one :meth:`BatchDecoder.step` (its first
    token when it joined, or a cycle's), and its finish reason once done."""

    index: int
    tokens: List[int]
    finish_reason: Optional[str]
    stats: GenerationStats
    error: Optional[Exception] = None  # finish_reason "error": what its own prefill raised (the others go on)


# --- the batch's width: costs of S slots at width W, and the choice ----------------


def _pow2_brackets(S: int) -> Tuple[int, int]:
    """The powers of two around S (measured batch sizes; others interpolated)."""
    lo = 1 << (S.bit_length() - 1)
    return lo, (lo if lo == S else 2 * lo)


class BatchCosts:
    """Seconds of one batch cycle of S slots at width W, drafting included (W =
    1: a plain step for every slot, no draft). Measured on scratch caches
    (``context`` tokens each) the first time a batch of S slots needs them,
    at S = 1, 2, 4, 8, ... (a width ladder each; S between two of those is
    interpolated linearly) and cached in ``batch-costs.json`` next to the
    solo policy's ``costs.json``, under the same key (pair, KV format,
    machine, mlx version). A batch cycle is not S solo cycles: the row-wise
    work (the weights read once for all rows) is shared, attention and the
    draft's context run per slot, so its cost is measured, not derived.

    Measured costs are a prior: the median of the last 5 observed cycles at
    an (S, W) (:meth:`observed`, each clipped to 3x the estimate) replaces
    it; the first cycle at each (S, W) is not timed (it traces that shape's
    compiled forwards), and times expire after ``stale_after`` cycles
    without that shape (one timed in a stall of the machine would otherwise
    never be chosen, so never corrected)."""

    FILE = "batch-costs.json"
    FORMAT = 2  # 2: CPU verifies over quantized KV attend over it dequantized (cheaper)
    stale_after = 64

    def __init__(self, target, draft, *, kv_bits: Optional[int] = None, cache_dir=None, context: int = 64):
        self.target, self.draft, self.kv_bits, self.context = target, draft, kv_bits, context
        self.folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.tables: Dict[int, Dict[int, float]] = {}  # S -> {W: seconds}
        self.measured: List[int] = []  # the S measured by this process (not read from the file)
        self._key = None
        self.seen: Dict[Tuple[int, int], List[float]] = {}  # (S, W) -> its last few cycle times
        self.seen_at: Dict[Tuple[int, int], int] = {}  # (S, W) -> ``cycles`` at its last time
        self.warm = set()  # (S, W) whose first, untimed cycle has run
        self.cycles = 0

    def widths(self) -> List[int]:
        B = self.draft.block_size
        return sorted({w for w in (1, 2, 4, 8, 16, B) if w <= B})

    def cycle(self, S: int, W: int) -> float:
        ts = self.seen.get((S, W))
        return sorted(ts)[len(ts) // 2] if ts else self.prior(S, W)  # the middle of the recent ones

    def observed(self, S: int, W: int, seconds: float) -> None:
        """A cycle of S slots at width W took ``seconds``."""
        self.cycles += 1
        for k in [k for k, at in self.seen_at.items() if self.cycles - at > self.stale_after]:
            del self.seen[k], self.seen_at[k]
        if (S, W) not in self.warm:
            self.warm.add((S, W))
            return
        old = self.cycle(S, W)
        self.seen[S, W] = (self.seen.get((S, W), []) + [min(max(seconds, old / 3), old * 3)])[-5:]
        self.seen_at[S, W] = self.cycles

    def prior(self, S: int, W: int) -> float:
        """The measured cost (interpolated between measured S and W)."""
        lo, hi = _pow2_brackets(S)
        a, b = interpolate(self.table(lo), W), interpolate(self.table(hi), W)
        return a if hi == lo else a + (b - a) * (S - lo) / (hi - lo)

    def table(self, S: int) -> Dict[int, float]:
        if S not in self.tables:
            self.tables[S] = self._load(S)
        return self.tables[S]

    def _entry_key(self, S: int) -> str:
        if self._key is None:
            self._key = f"{cost_key(self.target, self.draft, self.kv_bits)}:{machine_id()}:{mx.__version__}"
        return f"{self._key}:{self.FORMAT}:{S}"

    def _load(self, S: int) -> Dict[int, float]:
        path = self.folder / self.FILE
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        if not isinstance(entries, dict):
            entries = {}
        key = self._entry_key(S)
        try:
            return {int(w): float(t) for w, t in entries[key].items()}
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # not there, or damaged: measured and replaced
        table = self.measure(S)
        self.measured.append(S)
        entries[key] = table
        write_json(path, dict(list(entries.items())[-64:]))  # a read-only home: measured again next time
        return table

    def measure(self, S: int, reps: int = 3) -> Dict[int, float]:
        """One batch cycle of S scratch slots per ladder width, as ``_cycle``
        runs it (draft for all slots at the full block, one forward_slots,
        the host reading the picks, the rollback to one kept token); the
        widths take turns within each of ``reps`` rounds after a warm-up and
        keep their fastest."""
        target, draft = self.target, self.draft
        V, Bmax, capture = target.vocab_size, draft.block_size, draft.target_layer_ids
        caches, items = [], []
        for b in range(S):
            c = target.make_cache(kv_bits=self.kv_bits) if self.kv_bits else target.make_cache()
            _, f = target.prefill([(7 * i + 3 + b) % V for i in range(self.context)], c, capture=capture)
            caches.append(c)
            items.append([f, 5, self.context, draft.make_cache(), Sampler(), False])
        propose_slots(draft, [tuple(it) for it in items], Bmax)  # the draft reads the scratch contexts
        for it in items:
            it[0] = None
        mx.eval([c.state() for c in caches])
        slots = SlotBatch(caches)

        def run(W):
            if W > 1:
                props = propose_slots(draft, [tuple(it) for it in items], Bmax)
                drafted = [t[: W - 1] for t, _ in props]
                tokens = mx.stack([mx.concatenate([mx.array([5], dtype=mx.int32), t]) for t in drafted])
            else:
                tokens = mx.full((S, 1), 5, dtype=mx.int32)
            logits, f = target.forward_slots(tokens, slots, capture=capture, record=W > 1)
            mx.argmax(logits, axis=-1).tolist()
            if W > 1:
                slots.rollback([1] * S)
            for b, it in enumerate(items):  # the draft reads the kept rows at its next call
                it[0] = f[b, :1] if W > 1 or it[0] is None else mx.concatenate([it[0], f[b, :1]])
                it[2] += 1
            mx.eval(slots.state())

        best = {W: float("inf") for W in self.widths()}
        for r in range(reps + 1):  # the first round warms up (traces, allocator)
            for W in best:
                t = time.perf_counter()
                run(W)
                if r:
                    best[W] = min(best[W], time.perf_counter() - t)
        hi, out = 0.0, {}
        for W in sorted(best):  # a wider cycle never costs less
            hi = out[W] = max(hi, best[W])
        return out


_BATCH_COSTS: Dict[tuple, BatchCosts] = {}


def batch_costs(target, draft, kv_bits: Optional[int] = None) -> BatchCosts:
    """The pair's :class:`BatchCosts`, one per process (tables filled as batch sizes come)."""
    key = (id(target), id(draft), kv_bits, getattr(target, "compiled", False), getattr(draft, "compiled", False))
    if key not in _BATCH_COSTS:
        _BATCH_COSTS[key] = BatchCosts(target, draft, kv_bits=kv_bits)
    return _BATCH_COSTS[key]


class BatchPolicy:
    """Each cycle's width W for the whole batch: the one with the most
    expected committed tokens summed over the slots per second of the batch
    cycle, ``sum_b E_b(min(W, left_b)) / T(S, W)``, W = 1 (a plain step for
    every slot, S tokens) or a drafted width of the solo ladder. ``E_b`` is
    slot b's expected chain tokens from its own :class:`Acceptance` (a
    request's rates stay its own whoever shares the batch); ``left_b`` its
    tokens before ``max_tokens`` (rows past it are verified and not
    emitted, so they earn nothing). ``T(S, W)``: ``costs.cycle(S, W)``
    (:class:`BatchCosts`, told each cycle's time by ``costs.observed``).

    Its own schedule, the solo policy's older one: two drafted warm-up
    cycles, two plain verdicts in a row before a plain run of 16, 32, ... up
    to 256 plain cycles. The batch's last plain cycle of a run also drafts
    (``shadow``), unverified: the target's next
    plain tokens score each slot's draft (its old counts dropped first), so
    a look at a useless draft costs a draft forward, not a wide verify. If
    drafting then pays by the solo policy's margin (:meth:`margin`), it
    resumes; else the next run is twice as long.
    ``costs`` None: pinned at ``fixed`` (else the block)."""

    first_plain_run = 16
    longest_plain_run = 256

    def __init__(self, max_width: int, costs=None, *, fixed: Optional[int] = None):
        self.max_width, self.costs, self.fixed = max_width, costs, fixed
        self.acc: Dict[int, Acceptance] = {}  # request index -> its acceptance
        self.warmup = 2
        self.plain_left = 0
        self.plain_run = self.first_plain_run
        self.plain_votes = 0
        self.last = 1  # the width of the cycle being booked
        self.shadow = False  # the plain cycle planned also drafts (see score_shadows)
        self.shadows: Dict[int, Tuple[int, List[int]]] = {}  # request index -> (anchor position, drafted tokens)

    @property
    def adaptive(self) -> bool:
        return self.costs is not None

    def acceptance(self, index: int) -> Acceptance:
        if index not in self.acc:
            self.acc[index] = Acceptance(self.max_width)
        return self.acc[index]

    def cost(self, S: int, W: int) -> float:
        return self.costs.cycle(S, W)

    def rate(self, slots: Sequence[Tuple[int, int]], W: int) -> float:
        """Expected committed tokens per second of a width-W cycle for
        ``slots`` = [(request index, tokens left)]."""
        e = sum(self.acceptance(i).expected(max(min(W, left), 1)) for i, left in slots)
        return e / self.cost(len(slots), W)

    def best(self, slots: Sequence[Tuple[int, int]], room: int, drafted: bool = False, margin: float = 1.0) -> int:
        """The width with the most expected tokens per second (``drafted``:
        of the drafted ones; ``margin``: plain steps' rate counted that many times)."""
        ladder = Policy(self.max_width).ladder(room)
        best, rate = 1, (0.0 if drafted else self.rate(slots, 1) * margin)
        for W in ladder:
            r = self.rate(slots, W)
            if r > rate:
                best, rate = W, r
        return best

    def plan(self, slots: Sequence[Tuple[int, int]], room: int) -> int:
        """The next cycle's width for ``slots`` = [(request index, tokens
        left before max_tokens)], ``room`` the tightest slot's context room."""
        live = {i for i, _ in slots}
        self.acc = {i: a for i, a in self.acc.items() if i in live}  # left slots' rates go
        self.shadows = {i: sh for i, sh in self.shadows.items() if i in live}
        self.shadow = False
        top = min(self.max_width, room)
        if top < 2:
            W = 1
        elif not self.adaptive:
            W = min(self.fixed or self.max_width, room)
        elif self.plain_left > 0 or self.shadows:  # in a plain run, or its shadow draft not yet scored
            W = 1
            if self.plain_left == 1:  # the run's last cycle: a look at the draft, on fresh evidence
                self.shadow = True
                for a in self.acc.values():
                    a.forget(0.0)
        elif self.warmup > 0:
            W = self.best(slots, room, drafted=True)
        else:
            # Leaving plain steps (a look's slots gone before it was scored) takes the margin too.
            W = self.best(slots, room, margin=self.margin(slots) if self.last == 1 else 1.0)
            if W == 1:
                self.plain_votes += 1
                if self.plain_votes >= 2:
                    self.plain_votes = 0
                    self.plain_left = self.plain_run
                    return self.plan(slots, room)
                W = self.best(slots, room, drafted=True)
            else:
                self.plain_votes = 0
        self.last = W
        return W

    def observe(self, slots: Sequence[Tuple[int, int, int]], seconds: float = 0.0) -> None:
        """Book the cycle just run: ``slots`` = [(request index, tokens left
        before it, tokens it committed)], in ``seconds`` (0: not timed)."""
        if not self.adaptive:
            return
        W, S = self.last, len(slots)
        if seconds > 0:
            self.costs.observed(S, W, seconds)
        if W == 1:
            self.plain_left = max(self.plain_left - 1, 0)
            return
        for i, _, n in slots:
            self.acceptance(i).observe(W - 1, n - 1)
        self.warmup -= 1

    def score_shadows(self, slots: Sequence[Tuple[int, int, List[int]]], room: int) -> None:
        """Score the shadow drafts against what the target committed since,
        for ``slots`` = [(request index, tokens left, its committed
        history)]: a slot's draft counts as a drafted cycle once a miss
        shows or all its positions are committed. When the last is scored,
        drafting resumes if it pays, else the next plain run is twice as
        long."""
        if not self.shadows:
            return
        for i, _, history in slots:
            if i not in self.shadows:
                continue
            pos, drafted = self.shadows[i]
            got = history[pos + 1 : pos + 1 + len(drafted)]
            a = 0
            while a < len(got) and got[a] == drafted[a]:
                a += 1
            if a < len(got) or len(got) == len(drafted):
                del self.shadows[i]
                self.acceptance(i).observe(len(drafted), a)
        if self.shadows or self.plain_left > 0:
            return
        live = [(i, left) for i, left, _ in slots]
        if self.best(live, room, margin=self.margin(live)) > 1:
            self.plain_run = self.first_plain_run
        else:
            self.plain_run = min(self.plain_run * 2, self.longest_plain_run)
            self.plain_left = self.plain_run

    def margin(self, slots: Sequence[Tuple[int, int]]) -> float:
        """The solo policy's margin (:func:`~mlx_dflash.policy.evidence_margin`)
        over the blocks scored over the slots: a shadow look that just pays
        on one block per slot does not restart cycles that cost several
        plain steps."""
        return evidence_margin(sum(self.acceptance(i).trials[1] for i, _ in slots))

    def describe(self, S: int) -> str:
        if not self.adaptive:
            return f"batch of up to {S}, pinned (chain of {self.fixed or self.max_width})"
        return f"batch of up to {S}, adaptive (sum over slots of expected tokens per second of the batch cycle)"


class BatchDecoder:
    """Requests decoded together in slots (see the module's docstring).

    ``add`` queues a request (``config`` and keyword options as
    :func:`mlx_dflash.generate` takes them; the options that shape the
    batch's verify, ``block_size``, ``baseline``, ``adaptive`` and
    ``tree_budget``, must be the same for all); ``step`` admits queued requests while slots are free, then runs
    one cycle for the active slots, and returns what each request committed.
    ``policy``: the batch's widths (a :class:`BatchPolicy`, which then also
    runs a batch of one; default: made at the first cycle from the
    requests' options, a lone slot running its solo loop).
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
        policy: Optional[BatchPolicy] = None,
    ):
        if not is_int(max_batch) or max_batch < 1:
            raise DFlashError(f"max_batch must be a positive number of slots, got {max_batch!r}")
        if not hasattr(target, "forward_slots"):
            raise DFlashError(f"target must be a loaded target (engine.target), got {type(target).__name__}")
        if draft is not None and not hasattr(draft, "block_size"):
            raise DFlashError(f"draft must be a loaded draft (engine.draft) or None, got {type(draft).__name__}")
        check_prefix_cache(prefix_cache)
        if policy is not None and not all(hasattr(policy, a) for a in ("plan", "observe", "max_width")):
            raise DFlashError(f"policy must be a BatchPolicy (plan, observe, max_width), got {type(policy).__name__}")
        if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Iterable):
            raise DFlashError(f"eos_token_ids must be a sequence of token ids (ints), got {eos_token_ids!r}")
        eos_token_ids = list(eos_token_ids)
        if not all(is_int(t) for t in eos_token_ids):
            raise DFlashError(f"eos_token_ids must be token ids (ints), got {eos_token_ids!r}")
        if not is_int(prefill_budget) or prefill_budget < 1:
            raise DFlashError(f"prefill_budget must be a positive number of tokens, got {prefill_budget}")
        self.target, self.draft, self.max_batch = target, draft, max_batch
        self.prefill_budget = prefill_budget
        # A PrefixCache bound to the engine: a request restores its longest cached
        # prefix at admission (stats.cached_tokens) and is snapshotted when it leaves.
        self.prefix_cache = prefix_cache
        self.eos_token_ids = list(eos_token_ids)
        self.queue = deque()
        self.prefilling = deque()  # (index, Decoder, its prefill steps), round robin
        self.boundaries: Dict[int, Optional[int]] = {}  # index -> its prefix boundary, while it prefills
        self.started: set = set()  # indices whose prefill has run a chunk
        self.active: List[tuple] = []  # (index, Decoder)
        self.count = 0
        self.shape = None  # (block_size, baseline, adaptive, tree_budget, tree_topk) shared by every request
        self.policy = policy  # the batch's widths (None: made at the first cycle, see _width_policy)
        self.given_policy = policy is not None  # it then rules every cycle, a batch of one's too
        self.policy_shape = None  # the shape self.policy was made for
        self.configs: Dict[int, GenerationConfig] = {}  # request index -> its options, while it runs
        self.solo: Dict[int, Policy] = {}  # request index -> its solo width policy, once it decoded alone
        self.lone: Optional[Tuple[int, Iterator[List[int]]]] = None  # the slot decoding alone: its solo loop
        # The next plain batch step, queued before the host read the last one:
        # ([(Decoder, its cache snapshot before the step)], logits, features).
        self.queued: Optional[tuple] = None
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
        if isinstance(prompt, (str, bytes)):
            raise DFlashError("add takes token ids; encode a text prompt first (engine.encode(text))")
        prompt = token_ids(prompt)  # a list, tuple or array of ints; anything else is one error now
        if prefix_boundary is not None and (not is_int(prefix_boundary) or prefix_boundary < 0):
            raise DFlashError(f"prefix_boundary must be a token count (an int >= 0), got {prefix_boundary!r}")
        c = GenerationConfig.build(config, **options)
        if self.done:
            self.shape = None  # a drained batch takes any shape
        c.validate(None if c.baseline else self.draft)
        if c.auto_tree:
            raise DFlashError(
                "batched decoding does not choose trees: auto_tree (--auto-tree) is not supported (the batch's width "
                "policy prices chains; --tree-budget pins a tree per slot)"
            )
        check_prompt(self.target, prompt, c)
        if self.prefix_cache is not None:  # one KV format per cache: checked now, not mid-step
            kv = [q.kv_bits for q in self.configs.values()] + [q[2].kv_bits for q in self.queue]
            if any(k != c.kv_bits for k in kv):
                raise DFlashError(
                    "requests sharing a prefix cache need one KV format: kv_bits "
                    f"{c.kv_bits} here, {kv[0]} in this batch (or give it no prefix cache)"
                )
            self.prefix_cache.check_budget(self.target, c.kv_bits)
        # Trees of one batch share a node count, which tree_topk bounds too.
        shape = (c.block_size, c.baseline, c.adaptive, c.tree_budget, c.tree_topk if c.tree_budget else None)
        if self.shape is not None and shape != self.shape:
            raise DFlashError(
                "every request of a batch needs the same block_size, baseline, adaptive, tree_budget "
                "and (with a tree) tree_topk options"
            )
        self.shape = shape
        if self.policy is not None and not self.given_policy and self.policy_shape != shape:
            self.policy = None  # widths made for another shape (a drained batch's) are made again
        index = self.count
        self.count += 1
        self.queue.append((index, prompt, c, prefix_boundary))
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
                    if slots is self.active:
                        self._undo_queued()
                    del slots[i]
                    d.stats.finish_reason = "cancelled"
                    self._leave(index, d)
                    return SlotEvent(index, [], "cancelled", d.stats)
        return None

    def step(self) -> List[SlotEvent]:
        """Admit queued requests to free slots, run prefill chunks up to
        ``prefill_budget`` tokens (at least one chunk), then one cycle of the
        decoding slots. Returns what each request committed. A long prompt
        thus takes several steps even with nothing decoding, and between
        them its caller can cancel it or admit others."""
        while self.queue and len(self.prefilling) + len(self.active) < self.max_batch:
            self._admit(*self.queue.popleft())
        events = []
        spent = 0
        while self.prefilling and spent < self.prefill_budget:
            self._next_prefill()
            index, d = self.prefilling[0][:2]
            before = d.cache.offset
            try:
                ev = self._prefill_chunk()
            except Exception as e:  # a slot's prefill (its own cache, its first sample) is its own fault
                ev = self._failed(index, d, e)
            spent += d.cache.offset - before
            if ev is not None:
                events.append(ev)
        if self.active:
            running = dict(self.active)
            alone = len(self.active) == 1 and not self.given_policy
            if alone:
                self._undo_queued()
            cycled = self._alone() if alone else self._cycle()
            for ev in cycled:
                if ev.finish_reason is not None:
                    self._leave(ev.index, running[ev.index])
            events += cycled
        return events

    def _admit(self, index: int, prompt: List[int], c: GenerationConfig, prefix_boundary: Optional[int]) -> None:
        draft = None if c.baseline else self.draft
        d = open_decoder(self.target, prompt, c, Hooks(), c.sampler(), draft=draft, eos_token_ids=self.eos_token_ids)
        d.stats.policy = f"batch of up to {self.max_batch}, chain of {d.stats.block_size}" if draft else "batch, plain"
        steps = d.prefill_steps(c.prefill_chunk, self.prefix_cache, prefix_boundary)
        self.prefilling.append((index, d, steps))
        self.boundaries[index] = prefix_boundary
        self.configs[index] = c

    def _next_prefill(self) -> None:
        """Put first the slot to prefill next. One not started yet waits while
        a slot mid-prefill will leave a snapshot it would restore, so a
        prefix two requests share (the same system prompt, the same question
        twice) is prefilled once and restored by the other."""
        for _ in range(len(self.prefilling)):
            if not self._waits(*self.prefilling[0][:2]):
                return
            self.prefilling.rotate(-1)

    def _waits(self, index: int, d: Decoder) -> bool:
        if self.prefix_cache is None or index in self.started:
            return False
        prompt = d.history  # the prompt, until the prefill ends
        layout = d.dcache.layout() if d.dcache is not None else None
        have = self.prefix_cache.lookup(prompt, draft_layout=layout)
        have = have.n if have is not None else 0
        for j, e, _ in self.prefilling:
            if j not in self.started or (layout is not None and (e.dcache is None or e.dcache.layout() != layout)):
                continue
            common = 0
            for a, b in zip(prompt, e.history):
                if a != b:
                    break
                common += 1
            points = self.prefix_cache.snapshot_points(e.history, self.boundaries[j])
            if any(have < p <= common and p < len(prompt) for p in points):
                return True
        return False

    def _leave(self, index: int, d: Decoder) -> None:
        """A slot that finished or was cancelled: snapshot its committed
        tokens into the prefix cache (as a solo generation does at its end)."""
        self.configs.pop(index, None)
        self.solo.pop(index, None)
        self.started.discard(index)
        self.boundaries.pop(index, None)
        if self.lone is not None and self.lone[0] == index:
            self.lone[1].close()
            self.lone = None
        if d.prefix_run is not None:
            d.prefix_run.finish(d.history, d.pending_features())

    def _prefill_chunk(self) -> Optional[SlotEvent]:
        """The next chunk of the first slot in prefill; when that was its
        last, its first token (and the slot joins the decoding ones)."""
        index, d, steps = self.prefilling.popleft()
        self.started.add(index)
        if next(steps, StopIteration) is not StopIteration:
            self.prefilling.append((index, d, steps))
            return None
        self.started.discard(index)
        self.boundaries.pop(index, None)
        out = d.emit([d.anchor])
        d.tic = time.perf_counter()
        if not d.finished:
            self.active.append((index, d))
        else:
            self._leave(index, d)
        return SlotEvent(index, out, d.stats.finish_reason, d.stats)

    def _failed(self, index: int, d: Decoder, error: Exception) -> SlotEvent:
        """Drop a slot whose prefill raised: it leaves no snapshot, and the
        slots beside it, whose caches it never touched, go on."""
        self.prefilling = deque(p for p in self.prefilling if p[0] != index)
        for held in (self.configs, self.solo, self.boundaries):
            held.pop(index, None)
        self.started.discard(index)
        d.stats.finish_reason = "error"
        return SlotEvent(index, [], "error", d.stats, error)

    def _width_policy(self, ds: List[Decoder]) -> BatchPolicy:
        """The batch's width policy, made at its first cycle: pinned where a
        solo run would be (``block_size`` given, ``adaptive=False``, a
        ``tree_budget``), else adaptive on the pair's measured batch costs;
        the draft's block for cycles while a slot samples with the
        speculative rule (its text depends on the drafted widths)."""
        if self.policy is None:
            self.policy_shape = self.shape
            block_size, baseline, adaptive, tree_budget, _ = self.shape
            if baseline or self.draft is None:
                self.policy = BatchPolicy(1)
                return self.policy
            # Not pinned for slots sampling with the speculative rule: they are
            # handled per cycle below, and the adaptive policy outlives them.
            pinned = block_size is not None or not adaptive or tree_budget > 0
            costs = None if pinned else batch_costs(self.target, self.draft, ds[0].cache.kv_bits)
            self.policy = BatchPolicy(self.draft.block_size, costs, fixed=block_size)
        if self.policy.adaptive and any(d.spec for d in ds):
            return BatchPolicy(self.policy.max_width)  # the adaptive one resumes once they leave
        return self.policy

    def _alone(self) -> List[SlotEvent]:
        """The one decoding slot runs as a solo generation does: its own
        loop and width policy (:func:`~mlx_dflash.decode.make_policy`), one
        of the loop's yields per step (a drafted cycle, or a pipelined plain
        step), so a batch of one is the solo loop. A second slot joining
        pauses that loop between two yields (:meth:`Decoder.pause`); the
        request's acceptance evidence is the same object in both policies."""
        index, d = self.active[0]
        if self.lone is None:
            c = self.configs[index]
            policy = self.solo.get(index)
            if policy is None:
                draft = None if c.baseline else self.draft
                policy = self.solo[index] = make_policy(self.target, draft, c, d.sampler, d.cache.kv_bits)
                batch = self.policy
                if batch is not None and batch.adaptive and policy.adaptive and index in batch.acc:
                    policy.acc = batch.acc[index]  # evidence from its batched cycles
            if d.draft is not None:
                d.stats.policy = f"batch of up to {self.max_batch}, alone: {policy.describe()}"
            self.lone = (index, decode_loop(d, policy, c.profile))
        out = next(self.lone[1], None)
        if d.finished:
            next(self.lone[1], None)  # the loop's end: its timing and switch lines in the stats
            self.lone = None
            self.active = []
        return [SlotEvent(index, out or [], d.stats.finish_reason, d.stats)]

    def _undo_queued(self) -> None:
        """Take back the queued plain step: every slot's cache returns to its
        snapshot (only that slot's arrays: siblings are untouched)."""
        if self.queued is not None:
            for d, snap in self.queued[0]:
                d.cache.restore(snap)
            self.queued = None

    def _take_queued(self, ds: List[Decoder]) -> Optional[Tuple[mx.array, Optional[mx.array]]]:
        """The queued step's logits and features for ``ds`` if it ran for
        exactly them or a superset (slots that left were undone as they
        finished), in order; else undo it."""
        if self.queued is None:
            return None
        pairs, logits, feats = self.queued
        rows = {id(d): b for b, (d, _) in enumerate(pairs)}
        if len(ds) > len(pairs) or any(id(d) not in rows for d in ds):
            self._undo_queued()
            return None
        self.queued = None
        if len(ds) < len(pairs):
            idx = mx.array([rows[id(d)] for d in ds])
            logits, feats = logits[idx], (None if feats is None else feats[idx])
        return logits, feats

    @staticmethod
    def _next_is_plain(policy: BatchPolicy) -> bool:
        """Whether the batch's next cycle is surely a plain step: no draft
        (or a width of 1), or a plain run with more than this cycle left."""
        return policy.max_width <= 1 or (policy.adaptive and policy.plain_left >= 2)

    def _cycle(self) -> List[SlotEvent]:
        if self.lone is not None:  # another slot joined the one decoding alone: pause its loop
            index, loop = self.lone
            loop.close()
            dict(self.active)[index].pause()
            self.lone = None
        ds: List[Decoder] = [d for _, d in self.active]
        policy = self._width_policy(ds)
        if policy.adaptive:
            for index, solo in self.solo.items():
                if solo.adaptive:
                    policy.acc.setdefault(index, solo.acc)  # one request, one acceptance record
        # A slot's context end bounds every slot's width; its max_tokens does
        # not: rows past it are verified and not emitted (emit stops there).
        room = min(d.max_context - d.pos for d in ds)
        left = [(i, d.max_tokens - d.stats.generated_tokens) for i, d in self.active]
        W = policy.plan(left, room) if ds[0].draft is not None else 1  # baseline: plain steps
        # Adaptive widths verify the first W of the full block (as solo: a
        # shorter DFlash block proposes other tokens); pinned ones draft W.
        plan = Plan(max(W, 1), block=policy.max_width if policy.adaptive else 0)
        tree_budget = self.shape[3]
        if tree_budget and W > 1:  # a tree per slot, of the same node count, drafted from a block of W
            plan = Plan(tree_budget + 1, tree=True, block=W)
        # A plain step queued last cycle is used if this one is plain for the
        # same slots; any other cycle first takes it back.
        pipelined = plan.width == 1 and not any(d.sampler.needs_context or d.profile for d in ds)
        queued = self._take_queued(ds) if pipelined else None
        if not pipelined:
            self._undo_queued()
        t0 = time.perf_counter()
        parents = None
        if plan.tree:  # the slots' draft logits in one forward, a tree built from each slot's own
            items = [(d.draft_context(), d.anchor, d.pos, d.dcache) for d in ds]
            drafts = draft_logits_slots(self.draft, items, plan.block)
            props = [d.propose(plan, Proposal(plan, logits=lg)) for d, lg in zip(ds, drafts)]
            parents = [p.tree.parents for p in props]
            if len({len(p) for p in parents}) > 1:
                raise RuntimeError(f"trees of {sorted({len(p) for p in parents})} nodes in one batch")
        elif plan.width > 1:
            B = max(plan.block, plan.width)
            items = [(d.draft_context(), d.anchor, d.pos, d.dcache, d.sampler, d.spec) for d in ds]
            props = [
                Proposal(plan, drafted=t[: plan.width - 1], q=None if q is None else q[: plan.width - 1])
                for t, q in propose_slots(self.draft, items, B)
            ]
        else:
            props = [Proposal(plan) for _ in ds]
        shadow = None
        if plan.width == 1 and getattr(policy, "shadow", False):  # drafted, not verified: scored later
            items = [(d.draft_context(), d.anchor, d.pos, d.dcache, d.sampler, False) for d in ds]
            shadow = [t for t, _ in propose_slots(self.draft, items, policy.max_width)]
        t1 = time.perf_counter()
        slots = SlotBatch([d.cache for d in ds])
        if queued is not None:
            logits, feats = queued
        else:
            if plan.tree:
                tokens = mx.array([p.tree.tokens for p in props], dtype=mx.int32)
            else:
                tokens = mx.stack([d.block_input(p) for d, p in zip(ds, props)])
            logits, feats = self.target.forward_slots(
                tokens, slots, capture=ds[0].capture, record=plan.width > 1, parents=parents
            )
        if pipelined:
            # Each slot's pick, as judge makes it; the next plain step is queued
            # on them before the host reads them (as the solo plain steps are).
            picks = mx.stack([d.sampler(logits[b], [d.pos + 1]).astype(mx.int32) for b, d in enumerate(ds)])
            if self._next_is_plain(policy):
                snaps = [d.cache.snapshot() for d in ds]
                nxt = self.target.forward_slots(picks, SlotBatch([d.cache for d in ds]), capture=ds[0].capture)
                mx.async_eval(*(a for a in nxt if a is not None))
                self.queued = (list(zip(ds, snaps)), *nxt)
            rows = picks.tolist()
            verified = [Verified([d.anchor], rows[b], None if feats is None else feats[b]) for b, d in enumerate(ds)]
        else:
            verdicts = [d.picks(p, logits[b]) for b, (d, p) in enumerate(zip(ds, props))]
            mx.eval([x for d, p, v in zip(ds, props, verdicts) for x in d.pending_reads(p, v)])  # one host sync
            verified = [
                d.judge(p, logits[b], None if feats is None else feats[b], v)
                for b, (d, p, v) in enumerate(zip(ds, props, verdicts))
            ]
        t2 = time.perf_counter()
        paths = [d.accept(p, v) for d, p, v in zip(ds, props, verified)]
        for (index, d), t in zip(self.active, shadow or ()):
            policy.shadows[index] = (d.pos, t.tolist())
        if plan.width > 1:
            slots.rollback([len(path) for path in paths], paths if plan.tree else None)
        events = []
        desc = policy.describe(self.max_batch) if ds[0].draft is not None else "batch, plain"
        if tree_budget and ds[0].draft is not None:
            desc = f"batch of up to {self.max_batch}, pinned (tree of {tree_budget} per slot)"
        for (index, d), p, v, path in zip(self.active, props, verified, paths):
            out = d.commit(p, v, path, rolled_back=True)
            st = d.stats
            st.policy = desc
            st.draft_time += t1 - t0  # the batch's draft, verify and rollback time
            st.verify_time += t2 - t1
            st.rollback_time += time.perf_counter() - t2
            st.add_cycle(len(out), plan.width, d.tic)  # tokens past EOS or max_tokens are no output
            if not d.finished and d.room() < 1:
                st.finish_reason = "length"  # context full
            if d.finished and self.queued is not None:  # its queued row is undone; the others' stand
                snap = next(sn for q, sn in self.queued[0] if q is d)
                d.cache.restore(snap)
            events.append(SlotEvent(index, out, st.finish_reason, st))
        booked = [(i, n, len(path)) for (i, n), path in zip(left, paths)]
        policy.observe(booked, 0.0 if shadow else time.perf_counter() - t0)  # a plain cycle's time: without the draft
        if getattr(policy, "shadows", None):
            policy.score_shadows(
                [(i, d.max_tokens - d.stats.generated_tokens, d.history) for i, d in self.active], room
            )
        self.active = [(i, d) for i, d in self.active if not d.finished]
        if not self.active:
            self.queued = None  # every slot's row was undone as it finished
        return events


def batch_generate(
    engine,
    prompts: Sequence[Union[str, Sequence[int]]],
    config: Optional[GenerationConfig] = None,
    *,
    max_batch: int = 8,
    configs: Optional[Sequence[Optional[GenerationConfig]]] = None,
    prefix_cache=None,
    chat_template: bool = False,
    system: Optional[str] = None,
    chat_template_config: Optional[dict] = None,
    prefill_response: Optional[str] = None,
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
    snapshotted into it when it leaves. ``chat_template``, ``system`` and
    ``chat_template_config`` and ``prefill_response``: each text prompt
    through the chat template, as :func:`mlx_dflash.stream_generate` takes them.

    Greedy, and sampling with ``accept_rule="equality"``, give each request
    the tokens :func:`mlx_dflash.generate` gives it alone. One verify width
    per cycle for the whole batch (:class:`BatchPolicy`), pinned by
    ``block_size``; ``tree_budget``: a DDTree per slot (no ``auto_tree``).
    """
    check_engine(engine, prefix_cache)
    if engine.stage is not None:
        raise DFlashError("batch_generate does not run on a pipeline-split target")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise DFlashError(f"prompts must be a list of prompts (texts or token id lists), got {type(prompts).__name__}")
    if configs is not None and (isinstance(configs, GenerationConfig) or not isinstance(configs, Sequence)):
        raise DFlashError("configs must be a list with one GenerationConfig (or None) per prompt")
    if configs is not None and len(configs) != len(prompts):
        raise DFlashError(f"{len(configs)} configs for {len(prompts)} prompts")
    engine.config(config, **options)  # the call's options: an error in them is no one prompt's
    tok = engine.tokenizer
    if prefix_cache is not None:
        prefix_cache.bind(engine)
    batch = BatchDecoder(
        engine.target, engine.draft, max_batch=max_batch, eos_token_ids=tok.eos_token_ids, prefix_cache=prefix_cache
    )
    for i, prompt in enumerate(prompts):
        own = configs[i] if configs is not None and configs[i] is not None else config
        try:
            ids = engine.encode(
                prompt,
                chat_template=chat_template,
                system=system,
                chat_template_config=chat_template_config,
                prefill_response=prefill_response,
            )
            boundary = (
                prefix_cache.stable_boundary(tok, ids, chat_template_config) if prefix_cache is not None else None
            )
            batch.add(ids, engine.config(own, **options), prefix_boundary=boundary)
        except DFlashError as e:
            raise DFlashError(f"prompt {i}: {e}") from None
    tokens = [[] for _ in prompts]
    stats = [None] * len(prompts)
    while not batch.done:
        for ev in batch.step():
            if ev.error is not None:
                if isinstance(ev.error, DFlashError):
                    raise DFlashError(f"prompt {ev.index}: {ev.error}") from None
                raise ev.error
            tokens[ev.index].extend(ev.tokens)
            stats[ev.index] = ev.stats
    results = []
    detok = Detokenizer(tok)
    for toks, st in zip(tokens, stats):
        detok.reset()
        for t in toks:
            if t not in tok.eos_token_ids:
                detok.add_token(t)
        detok.finalize()
        results.append(GenerationResult(detok.text, toks, st))
    return results


# `serve --max-batch` when not given: bench/batch.py's pick (best aggregate
# tok/s, slowest request not later; bench/results/batch.md); the server
# lowers it to what memory holds.
DEFAULT_MAX_BATCH = 8


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
