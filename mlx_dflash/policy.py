"""Per-cycle choice of the verify width from measured costs and online acceptance.

A cycle that verifies B tokens (the anchor and B-1 drafts) costs
``T_draft(B) + T_verify(B) + T_rollback`` and commits ``E(B) = 1 + sum_k
prod_{d<=k} p_d`` tokens on average, where ``p_d`` is the probability that
the draft at depth d is accepted given depth d-1 was. A plain step (B = 1)
costs ``T_plain`` and commits one token. The policy picks the width with the
most expected tokens per second; when that is 1 it decodes plainly (no draft
forward at all) and re-probes with one drafted cycle (as wide as pays
under the prior acceptance) after a run of plain steps that doubles each
time the probe does not pay. Verify costs grow with the context (each row
attends over it), so the same acceptance gives narrower blocks deep in a
long context.

The costs are measured once per (model, machine, mlx version, KV format) in
a few forwards and cached as JSON in the user's cache folder; see
docs/policy.md.
"""

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

CACHE_FILE = "costs.json"
FORMAT = 5  # bump when what is measured changes (2: context slopes; 3: at 2048 tokens; 4: per-verify term;
#            5: verify blocks use the fused exp and a batched rollback, so old curves overprice them)


# --- where the curve is cached, and for what ------------------------------------


def default_cache_dir() -> Path:
    """The per-user cache folder (XDG on Linux, ~/Library/Caches on macOS)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-dflash"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-dflash"


def machine_id() -> str:
    """What makes timings differ between machines: host, CPU, device, BLAS."""
    from . import blas

    mid = ""
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            mid = Path(p).read_text().strip()
            break
        except OSError:
            pass
    parts = [
        mid or platform.node(),
        platform.machine(),
        platform.processor(),
        str(os.cpu_count()),
        str(mx.default_device()),
        blas.describe(),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _param_digest(module, h) -> None:
    """Names, shapes, dtypes and a sample of the values of every parameter."""
    for name, p in tree_flatten(module.parameters()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.reshape(-1)
        h.update(memoryview(mx.array(flat[:16]).astype(mx.float32) if p.dtype == mx.bfloat16 else flat[:16]).tobytes())


def cost_key(target, draft, kv_bits: Optional[int] = None) -> str:
    """The cost cache's key: the pair (config, parameter shapes and samples), the KV format
    and whether the forwards are compiled."""
    h = hashlib.sha256()
    h.update(json.dumps(getattr(target, "config", {}), sort_keys=True, default=str).encode())
    _param_digest(target.model, h)
    if hasattr(draft, "parameters"):
        _param_digest(draft, h)
    h.update(f"{type(draft).__name__}:{draft.block_size}:{list(draft.target_layer_ids)}:kv{kv_bits}".encode())
    # Compiled and plain-ops forwards cost differently.
    h.update(f"compiled:{getattr(target, 'compiled', False)}:{getattr(draft, 'compiled', False)}".encode())
    return h.hexdigest()[:24]


# --- the cost model ----------------------------------------------------------------


def _interp(table: Dict[int, float], x: int) -> float:
    """Piecewise-linear in x through the measured points (flat beyond them)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[xs[-1]]


@dataclass
class CostModel:
    """Seconds per plain step, and per cycle part at each measured width,
    after ``context`` tokens. Beyond that, per extra context token, a verify
    of B rows pays ``per_key_base + per_key_verify * B`` (reading the keys
    once, and each row's scores over them) and a plain step
    ``per_key_plain``: wide blocks get dearer deep in a long context, as
    much as the attention is compute-bound (a CPU) rather than bound by
    reading the cache (a GPU)."""

    plain: float
    verify: Dict[int, float]  # chain width B (anchor + B-1 drafts) -> recorded target forward
    draft: Dict[int, float]  # B -> draft forward
    rollback: float
    tree: Dict[int, float] = field(default_factory=dict)  # tree nodes (with root) -> verify
    context: int = 64
    per_key_verify: float = 0.0  # seconds per verified row per context token beyond ``context``
    per_key_base: float = 0.0  # seconds per verify per context token beyond ``context``, whatever its rows
    per_key_plain: float = 0.0  # seconds per plain step per context token beyond ``context``

    def plain_at(self, context: int = 0) -> float:
        return self.plain + self.per_key_plain * max(context - self.context, 0)

    def cycle(self, width: int, context: int = 0) -> float:
        """Seconds for one cycle of ``width`` tokens (1: a plain step) at ``context`` tokens."""
        if width <= 1:
            return self.plain_at(context)
        # The draft always runs at its full block (see Policy.plan), so its cost
        # does not shrink with the width; only the verify does.
        return (
            _interp(self.draft, max(self.draft))
            + _interp(self.verify, width)
            + self.rollback
            + self._deeper(width, context)
        )

    def tree_cycle(self, nodes: int, context: int = 0) -> float:
        return (
            _interp(self.draft, max(self.draft))
            + _interp(self.tree, nodes)
            + self.rollback
            + self._deeper(nodes, context)
        )

    def _deeper(self, rows: int, context: int) -> float:
        return (self.per_key_base + self.per_key_verify * rows) * max(context - self.context, 0)

    def to_dict(self) -> dict:
        return {
            "plain": self.plain,
            "verify": self.verify,
            "draft": self.draft,
            "rollback": self.rollback,
            "tree": self.tree,
            "context": self.context,
            "per_key_verify": self.per_key_verify,
            "per_key_plain": self.per_key_plain,
            "per_key_base": self.per_key_base,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        ints = lambda t: {int(k): float(v) for k, v in t.items()}
        return cls(
            float(d["plain"]),
            ints(d["verify"]),
            ints(d["draft"]),
            float(d["rollback"]),
            ints(d.get("tree", {})),
            context=int(d.get("context", 64)),
            per_key_verify=float(d.get("per_key_verify", 0.0)),
            per_key_plain=float(d.get("per_key_plain", 0.0)),
            per_key_base=float(d.get("per_key_base", 0.0)),
        )

    @classmethod
    def measure(
        cls,
        target,
        draft,
        *,
        kv_bits: Optional[int] = None,
        tree_sizes=(),
        context: int = 64,
        long_context: int = 2048,
        reps: int = 5,
    ) -> "CostModel":
        """Time each part on a scratch cache after ``context`` tokens, and the
        widest verify and a plain step again after ``long_context`` tokens
        (the per-key slopes; capped at half the model's context). The parts
        take turns within each repeat and each keeps its fastest run, so a
        machine busy with other work skews them alike rather than one alone."""
        V = target.vocab_size
        Bmax = draft.block_size
        widths = sorted({w for w in (2, 4, 8, 16, Bmax) if 2 <= w <= Bmax})
        capture = draft.target_layer_ids
        long_context = min(long_context, target.max_context // 2)

        def scratch(n):  # a scratch cache holding n tokens, dropped after
            c = target.make_cache(kv_bits=kv_bits) if kv_bits else target.make_cache()
            _, f = target.prefill([(7 * i + 3) % V for i in range(n)], c, capture=capture)
            mx.eval(f)
            return c, f

        cache, feats = scratch(context)
        rollback: List[float] = []

        def plain_run(n=8, cache=cache):
            # Pipelined as the plain loop runs: step i+1 queued before step i is read.
            # (The scratch cache just grows: no snapshot to restore, which a
            # pipeline-split target could not undo.)
            tok = mx.array([5], dtype=mx.int32)
            queued = None
            for _ in range(n):
                lg, f = target.forward(tok, cache, capture=capture)
                tok = mx.argmax(lg, axis=-1).astype(mx.int32)
                mx.async_eval(tok, f)
                if queued is not None:
                    queued.item()
                queued = tok
            queued.item()

        def verify_at(n, parents=None, cache=cache):
            tokens = [(11 * j + 1) % V for j in range(n)]

            def run():
                lg, f = target.forward(tokens, cache, capture=capture, record=True, parents=parents)
                mx.eval(mx.argmax(lg, axis=-1), f)
                t = time.perf_counter()
                cache.rollback(1, path=[0] if parents is not None else None)
                mx.eval(cache.state())
                rollback.append(time.perf_counter() - t)

            return run

        def draft_at(B):
            dcache = draft.make_cache()
            draft(feats, 9, context, B, dcache)
            pos = [context]

            def run():
                lg = draft(feats[-1:], 9, pos[0] + 1, B, dcache)
                pos[0] += 1
                mx.eval(mx.argmax(lg, axis=-1))

            return run

        parts = {("plain", 0): plain_run}
        parts.update({("verify", B): verify_at(B) for B in widths})
        parts.update({("draft", B): draft_at(B) for B in widths})
        for n in tree_sizes:
            parts[("tree", n)] = verify_at(n, [-1] + [(i - 1) // 2 for i in range(1, n)])
        # A pipeline-split target holds one cache at a time (a second resets
        # the other stages'): no second context there, the slopes stay 0.
        deep = long_context > context and getattr(target, "independent_caches", True)
        if deep:
            long_cache, _ = scratch(long_context)
            parts[("long-plain", 0)] = lambda: plain_run(cache=long_cache)
            for B in (2, Bmax):
                parts[("long-verify", B)] = verify_at(B, cache=long_cache)
        best = {k: float("inf") for k in parts}
        for r in range(reps + 1):  # the first round warms up (graph caches, allocator)
            for k, fn in parts.items():
                t = time.perf_counter()
                fn()
                if r:
                    best[k] = min(best[k], time.perf_counter() - t)
        table = lambda kind: _monotone({n: best[(k, n)] for k, n in best if k == kind})
        verify = table("verify")
        per_key_verify = per_key_plain = per_key_base = 0.0
        if deep:
            extra = long_context - context
            # A line through the extra cost at 2 rows and at Bmax rows.
            wide = max(best[("long-verify", Bmax)] - verify[Bmax], 0.0) / extra
            narrow = max(best[("long-verify", 2)] - verify[2], 0.0) / extra
            per_key_verify = max(wide - narrow, 0.0) / max(Bmax - 2, 1)
            per_key_base = max(narrow - 2 * per_key_verify, 0.0)
            per_key_plain = max(best[("long-plain", 0)] - best[("plain", 0)], 0.0) / (8 * extra)
        return cls(
            best[("plain", 0)] / 8,
            verify,
            table("draft"),
            min(rollback),
            table("tree"),
            context=context,
            per_key_verify=per_key_verify,
            per_key_plain=per_key_plain,
            per_key_base=per_key_base,
        )


def _recent_median(xs: List[float]) -> float:
    """The middle of a few recent samples (the upper one of an even count)."""
    return sorted(xs)[len(xs) // 2]


def _monotone(t: Dict[int, float]) -> Dict[int, float]:
    """A wider forward never costs less: running max over the sizes."""
    out, hi = {}, 0.0
    for n in sorted(t):
        hi = max(hi, t[n])
        out[n] = hi
    return out


_MEMO: Dict[Tuple, CostModel] = {}


def load_costs(
    target, draft, *, kv_bits: Optional[int] = None, tree_sizes=(), cache_dir: Optional[Path] = None
) -> Tuple[CostModel, bool]:
    """The pair's cost model, from the on-disk cache when it holds one for this
    model, machine and mlx version, else measured and stored. Returns (costs,
    measured_now)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / CACHE_FILE

    def memo_key():
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            stamp = None
        return (
            id(target),
            id(draft),
            getattr(target, "compiled", False),
            getattr(draft, "compiled", False),
            kv_bits,
            tuple(sorted(tree_sizes)),
            str(path),
            stamp,
        )

    if memo_key() in _MEMO:  # this process read it already (and the file is unchanged)
        return _MEMO[memo_key()], False
    fp = cost_key(target, draft, kv_bits)
    mid = machine_id()
    entries: List[dict] = []
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        entries = []
    want_tree = {int(n) for n in tree_sizes}
    for e in entries:
        if (
            e.get("model") == fp
            and e.get("machine") == mid
            and e.get("mlx") == mx.__version__
            and e.get("format") == FORMAT
        ):
            costs = CostModel.from_dict(e["costs"])
            if want_tree <= set(costs.tree):
                _MEMO[memo_key()] = costs
                return costs, False
    costs = CostModel.measure(target, draft, kv_bits=kv_bits, tree_sizes=sorted(want_tree))
    entries = [e for e in entries if not (e.get("model") == fp and e.get("machine") == mid)]
    entries.append(
        {
            "model": fp,
            "machine": mid,
            "mlx": mx.__version__,
            "format": FORMAT,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "costs": costs.to_dict(),
        }
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"entries": entries[-32:]}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    _MEMO[memo_key()] = costs
    return costs, True


# --- the policy ---------------------------------------------------------------------


@dataclass
class Plan:
    """What the next cycle does: ``width`` tokens verified (1 = plain steps,
    ``steps`` of them), as a chain or a tree of ``width`` nodes."""

    width: int
    steps: int = 1
    tree: bool = False
    block: int = 0  # the draft block the proposals come from (0: the width; trees: their candidates)


class Acceptance:
    """Per-depth conditional acceptance p_d from counts decayed by ``decay``
    per drafted cycle, shrunk by ``weight`` pseudo-observations toward the
    estimate one depth up (``prior`` at depth 1): a depth never tried is
    expected to do as the deepest one seen, so an oracle draft is widened
    step by step and a useless one is not."""

    def __init__(self, depths: int, prior: float = 0.6, weight: float = 1.0, decay: float = 0.95):
        self.hits = [0.0] * (depths + 1)
        self.trials = [0.0] * (depths + 1)
        self.prior, self.weight, self.decay = prior, weight, decay

    def observe(self, drafted: int, accepted: int) -> None:
        for d in range(1, len(self.hits)):
            self.hits[d] *= self.decay
            self.trials[d] *= self.decay
        for d in range(1, min(accepted + 1, drafted) + 1):
            self.trials[d] += 1
            self.hits[d] += d <= accepted

    def forget(self, keep: float) -> None:
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]

    def probs(self, depths: int) -> List[float]:
        out, p = [], self.prior
        for d in range(1, depths + 1):
            p = (self.hits[d] + self.weight * p) / (self.trials[d] + self.weight)
            out.append(p)
        return out

    def p(self, d: int) -> float:
        return self.probs(d)[-1]

    def expected(self, width: int) -> float:
        """Expected committed tokens of a chain of ``width`` (anchor + width-1 drafts)."""
        e, reach = 1.0, 1.0
        for p in self.probs(width - 1):
            reach *= p
            e += reach
        return e


class Policy:
    """Chooses each cycle's width. ``fixed`` (a width, or with ``tree_budget``
    a tree) pins it, as ``--block-size`` / ``--tree-budget`` do.
    ``auto_tree`` (adaptive only): also consider, each drafted cycle, a DDTree
    of that many draft nodes, priced by its measured cost (``costs.tree``
    must hold ``auto_tree + 1`` nodes) and judged by the tokens tree cycles
    have committed (a moving average; tried once after the warm-up and again
    every ``tree_every`` drafted cycles while chains win)."""

    first_plain_run = 16
    longest_plain_run = 256
    calibration_steps = 4
    tree_every = 32  # drafted cycles between two looks at the tree while chains win
    stale_after = 64  # committed tokens after which a drafted width's last times no longer count

    def __init__(
        self,
        max_width: int,
        costs: Optional[CostModel] = None,
        *,
        fixed: Optional[int] = None,
        tree_budget: int = 0,
        auto_tree: int = 0,
    ):
        self.max_width = max_width
        self.costs = costs
        self.fixed = fixed
        self.tree_budget = tree_budget
        self.auto_tree = auto_tree if costs is not None else 0
        self.tree_kept: Optional[float] = None  # moving average of tokens a tree cycle committed
        self.since_tree = 0  # drafted cycles since the last tree
        self.acc = Acceptance(max_width)
        # A few plain steps first: they time this machine's plain step now
        # (busy or idle) at the cost of nothing but a few undrafted tokens.
        self.plain_left = self.calibration_steps
        self.plain_run = self.first_plain_run
        self.probing = False
        self.warmup = 2  # first drafted cycles, taken even where one slow cycle would say plain
        self.plain_votes = 0
        # Costs measured at load are the prior; each width's real cycle time
        # (and the plain step's) replaces it as it is observed, and widths not
        # yet seen are scaled by how far the observed ones were off, so a
        # machine busier or idler than at measurement time still compares right.
        self.seen: Dict[object, List[float]] = {}  # width (or "tree") -> its last few cycle times
        # A width timed during a stall of the machine would look dear until it
        # ran again, and might never run again: its times expire once
        # ``stale_after`` tokens are committed without it, and the width is
        # priced from the measured curve (scaled as recent cycles ran) again.
        self.tokens = 0  # committed so far
        self.seen_at: Dict[object, int] = {}  # width (or "tree") -> ``tokens`` at its last time
        # The first cycle at a width is not timed: in a fresh process it
        # includes tracing that width's compiled forwards (tens of ms).
        self.warm_widths = set()  # widths whose first, untimed cycle has run
        self.ratios: Dict[str, List[float]] = {"plain": [], "draft": []}  # observed / modelled, recent
        self.context = 0  # tokens in the target cache now (set by plan)

    @property
    def adaptive(self) -> bool:
        return self.costs is not None

    def cost(self, width: int) -> float:
        """Seconds per cycle of ``width``: the median of its last 5 observed
        times (a stall of the machine moves it little), else the measured
        cost scaled as the observed ones were off."""
        ts = self.seen.get(width)
        if ts:
            t = _recent_median(ts)
            # A plain step never counts as dearer than measured at load:
            # erring toward plain decoding is the safe side.
            return min(t, self.costs.cycle(1, self.context)) if width == 1 else t
        return self.costs.cycle(width, self.context) * self.scale("plain" if width == 1 else "draft")

    def scale(self, kind: str) -> float:
        """How far observed cycle times ran from the model's (median of the last 5; 1 before any)."""
        r = self.ratios[kind]
        return _recent_median(r) if r else 1.0

    def ladder(self, room: int) -> List[int]:
        """The drafted widths considered: 2, 3, 4, 6, 8, 12, 16, 24, 32, ...
        (powers of two and three times them) up to the block, and the room
        left. Each width a forward has not run yet costs a trace of every
        layer's compiled pieces (milliseconds per layer), so a ladder with
        neighbours at most 1.5x apart keeps that to a few traces per process
        at little loss of fit."""
        top = min(self.max_width, room)
        out, w = {top}, 2
        while w < top:
            out.add(w)
            if 3 * w // 2 < top:
                out.add(3 * w // 2)
            w *= 2
        return sorted(x for x in out if x >= 2)

    def best_width(self, room: int, drafted: bool = False) -> int:
        """argmax over the ladder's B (and B = 1 unless ``drafted``) of E(B) / cost(B)."""
        best, rate = 1, (0.0 if drafted else 1.0 / self.cost(1))
        top = min(self.max_width, room)
        if top < 2:
            return best
        ladder = set(self.ladder(room))
        e, reach = 1.0, 1.0
        for B, p in enumerate(self.acc.probs(top - 1), start=2):
            reach *= p
            e += reach
            if B in ladder:
                r = e / self.cost(B)
                if r > rate:
                    best, rate = B, r
        return best

    def plan(self, room: int, context: int = 0) -> Plan:
        """The next cycle, given ``room`` tokens left (before max_tokens or the
        context end) and ``context`` tokens already in the target's cache."""
        self.context = context
        for w in [w for w, at in self.seen_at.items() if self.tokens - at > self.stale_after]:
            del self.seen[w], self.seen_at[w]
        if room <= 1 or self.max_width <= 1:
            return Plan(1, steps=max(room, 1))
        if not self.adaptive:
            if self.tree_budget > 0:
                return Plan(self.tree_budget + 1, tree=True, block=min(self.fixed or self.max_width, room))
            return Plan(min(self.fixed or self.max_width, room))
        if self.plain_left > 0:
            return Plan(1, steps=min(self.plain_left, room))
        if self.warmup > 0:
            # Drafted whatever plain steps would do, to see the draft at work,
            # but only as wide as pays best under the acceptance known so far
            # (the prior at first): where verifies are dear (a slow BLAS, a big
            # target, a long context) a full-width cycle costs many plain steps,
            # and a draft that keeps all its tokens is widened at once.
            return self._chain(self.best_width(room, drafted=True))
        if self.probing:
            # A fresh look at the draft, once per plain run (which doubles
            # while probes fail); old evidence is dropped so the probe alone
            # decides. Its width is the best under the prior alone: where
            # wide verifies are dear (deep in a long context) a failed probe
            # then costs little more than a plain step, and a probe that is
            # all accepted widens the next cycles step by step.
            self.acc.forget(0.0)
            return self._chain(self.best_width(room, drafted=True))
        B = self.best_width(room)
        if B == 1:
            # Two such verdicts in a row before a plain run: one slow cycle
            # on a busy machine does not switch the draft off.
            self.plain_votes += 1
            if self.plain_votes >= 2 or room < self.max_width:
                self.plain_votes = 0
                self.plain_left = self.plain_run
                return Plan(1, steps=min(self.plain_left, room))
            return self._chain(self.best_width(room, drafted=True))
        self.plain_votes = 0
        if self.auto_tree and room >= self.max_width:
            self.since_tree += 1
            chain = self.acc.expected(B) / self.cost(B)
            if self.tree_kept is None or self.since_tree >= self.tree_every or self.tree_rate() > chain:
                self.since_tree = 0
                return Plan(self.auto_tree + 1, tree=True, block=self.max_width)
        return self._chain(B)

    def tree_rate(self) -> float:
        """Expected tokens per second of a tree cycle: its committed tokens so
        far (before any: as the widest chain) over its observed cost (before
        any: the measured one, scaled as drafted cycles were off)."""
        ts = self.seen.get("tree")
        n = self.auto_tree + 1
        cost = _recent_median(ts) if ts else self.costs.tree_cycle(n, self.context) * self.scale("draft")
        kept = self.tree_kept if self.tree_kept is not None else self.acc.expected(self.max_width)
        return kept / cost

    def _chain(self, width: int) -> Plan:
        """A chain of ``width`` drafted from the full block: a DFlash draft's
        block rows attend to each other, so a shorter block proposes other
        (worse) tokens than the block it was trained on, and per-depth
        acceptance measured at one width would not hold at another."""
        return Plan(width, block=self.max_width)

    def timed(self, plan: Plan, committed: int, seconds: float) -> None:
        """Recalibrate from the wall time of a cycle (or a run of plain steps,
        ``committed`` tokens) up to the start of the next."""
        if not self.adaptive or seconds <= 0:
            return
        w = "tree" if plan.tree else plan.width
        if w != 1 and w not in self.warm_widths:
            self.warm_widths.add(w)
            return
        if w != 1:
            self.seen_at[w] = self.tokens
        if plan.tree:
            self.seen["tree"] = (self.seen.get("tree", []) + [seconds])[-5:]
            return
        t = seconds / (committed if w == 1 else 1)
        old = self.cost(w)
        t = min(max(t, old / 3), old * 3)
        self.seen[w] = (self.seen.get(w, []) + [t])[-5:]
        kind = "plain" if w == 1 else "draft"
        self.ratios[kind] = (self.ratios[kind] + [t / self.costs.cycle(w, self.context)])[-5:]

    def observe(self, plan: Plan, committed: int) -> None:
        """Book a cycle: ``committed`` tokens (plain steps: one each)."""
        if not self.adaptive:
            return
        self.tokens += committed
        if plan.tree:
            self.tree_kept = committed if self.tree_kept is None else 0.8 * self.tree_kept + 0.2 * committed
            return
        if plan.width == 1:
            self.plain_left = max(self.plain_left - committed, 0)
            if self.plain_left == 0 and self.warmup <= 0:
                self.probing = True
            return
        self.acc.observe(plan.width - 1, committed - 1)
        self.warmup -= 1
        if self.probing:
            # Drafting resumes if, on this probe's evidence, it pays; if not,
            # plain decoding resumes for twice as long before the next probe.
            self.probing = False
            if self.best_width(self.max_width) > 1:
                self.plain_run = self.first_plain_run
            else:
                self.plain_run = min(self.plain_run * 2, self.longest_plain_run)
                self.plain_left = self.plain_run

    def describe(self) -> str:
        if not self.adaptive:
            return f"pinned ({'tree of ' + str(self.tree_budget) if self.tree_budget else 'block ' + str(self.fixed or self.max_width)})"
        c = self.costs
        ratios = " ".join(f"B{B}:{c.cycle(B) / c.plain:.2f}" for B in sorted(c.verify))
        tree = f"; chains or a tree of {self.auto_tree}" if self.auto_tree else ""
        return f"adaptive (cycle cost / plain step: {ratios}; plain step {c.plain * 1e3:.2f} ms{tree})"
