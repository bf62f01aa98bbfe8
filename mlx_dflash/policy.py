"""Per-cycle choice of the verify width from measured costs and online acceptance.

A cycle that verifies B tokens (the anchor and B-1 drafts) costs
``T_draft(B) + T_verify(B) + T_rollback`` and commits ``E(B) = 1 + sum_k
prod_{d<=k} p_d`` tokens on average, where ``p_d`` is the probability that
the draft at depth d is accepted given depth d-1 was. A plain step (B = 1)
costs ``T_plain`` and commits one token. The policy picks the width with the
most expected tokens per second. While it decodes plainly the draft still
proposes now and then (a shadow draft, scored against the tokens plain
decoding commits), so the way back to drafting rests on measured acceptance.
Observed cycle times correct the measured costs only as far as they differ
from what the machine's current load explains, so a stall that slows every
width alike does not change the choice. Verify costs grow with the context
(each row attends over it), so the same acceptance gives narrower blocks
deep in a long context.

The costs are measured once per (model, machine, mlx version, KV format) in
a few forwards and cached as JSON in the user's cache folder; see
docs/policy.md.
"""

import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from .files import write_text
from .models.draft import propose

CACHE_FILE = "costs.json"
READ_ROWS = (32, 128)  # context rows a draft forward reads when its cost of reading them is measured
FORMAT = 10  # bump when what is measured changes (2: context slopes; 3: at 2048 tokens; 4: per-verify term;
#            5: verify blocks use the fused exp and a batched rollback, so old curves overprice them;
#            6: CPU verifies over quantized KV attend over it dequantized once, far cheaper deep in a context;
#            7: the draft's cost per context row it reads; 8: the draft's cost is its proposal as the
#            loop runs it, a DFlash 2 selector's walk included, which the logits alone underprice by a third;
#            9: a plain step is one of a run in flight, and a run's fill (its first step's host work) a term of
#            its own: a whole run over its steps overpriced long runs by ~7% and a 4-step calibration run read
#            dearer than drafted cycles; and the draft's reading of rows measured at 32 and 128 rows: priced
#            at 32 rows' rate, 128 rows came out 1.5x dear, and a first cycle reading its prompt 8% dear;
#            10: a verify at every width of the ladder (3, 6, 12 too): odd row counts ran dearer than the
#            next power of two on a CPU, and interpolating between 2, 4 and 8 priced them cheaper)


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
    vocab = getattr(draft, "vocab", None)  # a restricted head costs less
    if vocab is not None:
        h.update(b"vocab:" + memoryview(vocab).tobytes())
    # Compiled and plain-ops forwards cost differently.
    h.update(f"compiled:{getattr(target, 'compiled', False)}:{getattr(draft, 'compiled', False)}".encode())
    return h.hexdigest()[:24]


# --- the cost model ----------------------------------------------------------------


def ladder_widths(top: int) -> List[int]:
    """2, 3, 4, 6, 8, 12, 16, 24, 32, ... (powers of two and three halves of
    them) below ``top``, and ``top``: the drafted widths the policy considers."""
    out, w = {top}, 2
    while w < top:
        out.add(w)
        if 3 * w // 2 < top:
            out.add(3 * w // 2)
        w *= 2
    return sorted(x for x in out if x >= 2)


def interpolate(table: Dict[int, float], x: int) -> float:
    """Piecewise-linear in x through the measured points (flat beyond them)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[xs[-1]]


# What a change between plain steps and drafted cycles costs beyond its
# parts, in plain steps: bench/switch_cost.py fits 0.23-0.40 on three pairs
# (a CPU). The curve times each part alone, so it cannot see this; a plain
# step is the unit, as what a change costs (the first of a new kind of
# forward) scales with what a forward costs.
CHANGE_STEPS = 0.3


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
    # Seconds per committed row the draft reads into its context (beyond the
    # one a block reads after each plain step): a drafted cycle reads the rows
    # the cycle before committed, a shadow draft every row since the last.
    # ``reads``: rows -> seconds of reading that many, where measured (a
    # forward's rows share its work, so per row it costs less the more rows
    # it reads); ``draft_row`` is then the rate beyond the last of them.
    draft_row: float = 0.0
    reads: Dict[int, float] = field(default_factory=dict)
    # Seconds a run of plain steps pays once: its first step's host work, which
    # no step before it overlaps (``plain`` is a step of a run in flight).
    plain_fill: float = 0.0
    # What generations in this process observed of drafted cycles against plain
    # steps (Policy.fixes; not stored in the file: another run, another load).
    fixes: List[float] = field(default_factory=list, compare=False, repr=False)
    # Widths (and "tree") whose first cycle has run in this process: that one
    # traced the width's compiled forwards, so it is not timed; later
    # generations on this curve time theirs (Policy.timed).
    warm: Set = field(default_factory=set, compare=False, repr=False)
    # Where this curve is cached (file, model key, machine, when measured), when
    # it came from or went to the cache: a curve found measured under load is
    # marked stale there (forget_costs).
    origin: Optional[Tuple[str, str, str, str]] = field(default=None, compare=False, repr=False)

    @property
    def change(self) -> float:
        """Seconds a change between plain steps and drafted cycles costs beyond
        its parts (``CHANGE_STEPS`` plain steps; not measured with the curve)."""
        return CHANGE_STEPS * self.plain

    def full_draft(self) -> float:
        """Seconds of a draft forward at its full block: every drafted cycle
        and every shadow draft runs one (see Policy.plan)."""
        return interpolate(self.draft, max(self.draft))

    def read(self, rows: float) -> float:
        """Seconds for the draft to read ``rows`` committed rows into its context."""
        if not self.reads:
            return self.draft_row * max(rows, 0)
        top = max(self.reads)
        if rows > top:
            return self.reads[top] + self.draft_row * (rows - top)
        return interpolate({0: 0.0, **self.reads}, max(rows, 0))

    def shadow(self, rows: float) -> float:
        """Seconds of a shadow draft that first reads ``rows`` committed rows."""
        return self.full_draft() + self.read(rows)

    def plain_at(self, context: int = 0) -> float:
        return self.plain + self.per_key_plain * max(context - self.context, 0)

    def plain_run(self, steps: int, context: int = 0) -> float:
        """Seconds for a run of ``steps`` plain steps after ``context`` tokens."""
        return self.plain_fill + steps * self.plain_at(context)

    def cycle(self, width: int, context: int = 0) -> float:
        """Seconds for one cycle of ``width`` tokens (1: a plain step) at ``context`` tokens."""
        if width <= 1:
            return self.plain_at(context)
        # The draft always runs at its full block (see Policy.plan), so its cost
        # does not shrink with the width; only the verify does.
        return self.full_draft() + interpolate(self.verify, width) + self.rollback + self._deeper(width, context)

    def tree_cycle(self, nodes: int, context: int = 0) -> float:
        return self.full_draft() + interpolate(self.tree, nodes) + self.rollback + self._deeper(nodes, context)

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
            "draft_row": self.draft_row,
            "reads": self.reads,
            "plain_fill": self.plain_fill,
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
            draft_row=float(d.get("draft_row", 0.0)),
            reads=ints(d.get("reads", {})),
            plain_fill=float(d.get("plain_fill", 0.0)),
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
        ladder = ladder_widths(Bmax) if Bmax >= 2 else []
        capture = draft.target_layer_ids
        long_context = min(long_context, target.max_context // 2)

        def scratch(n):  # a scratch cache holding n tokens, dropped after
            c = target.make_cache(kv_bits=kv_bits) if kv_bits else target.make_cache()
            m = min(n, context)
            _, f = target.prefill([(7 * i + 3) % V for i in range(m)], c, capture=capture)
            if n > m:
                # A long context repeats the short one's KV rows: attention costs
                # the same whatever the keys hold, and a real 2048-token prefill
                # took 26 s of the first run on mlx-cpu's bundled BLAS.
                for layer in c.layers:
                    if layer.sequence:
                        layer.restore_state([layer.snapshot_state(0, m)] * -(-n // m))
                        layer.truncate(n)
                c.restored(n)
            mx.eval(f, c.state())
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

        def draft_at(B, rows=1):
            # The block's tokens as a drafted cycle or a shadow proposes them
            # (a DFlash 2 draft's selector walks its candidates after the logits).
            dcache = draft.make_cache()
            mx.eval(propose(draft, feats, 9, context, B, dcache)[0])
            pos = [context]
            # More rows than the scratch context holds repeat its features: the cost is the same.
            rows_in = mx.concatenate([feats] * -(-rows // feats.shape[0]))[-rows:]

            def run():
                toks, _ = propose(draft, rows_in, 9, pos[0] + rows, B, dcache)
                pos[0] += rows
                mx.eval(toks)

            return run

        # Runs of 2 and 8 steps: their difference is 6 steps in flight, the rest the fill.
        parts = {("plain", 0): plain_run, ("plain", 2): lambda: plain_run(2)}
        parts.update({("verify", B): verify_at(B) for B in ladder})
        parts.update({("draft", B): draft_at(B) for B in widths})
        parts.update({("draft-read", n): draft_at(Bmax, n) for n in READ_ROWS})
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
        # Verifies as measured: a wider one may cost less (Policy.ladder then skips the narrower).
        verify = {n: best[("verify", n)] for n in ladder}
        per_key_verify = per_key_plain = per_key_base = 0.0
        if deep:
            extra = long_context - context
            # A line through the extra cost at 2 rows and at Bmax rows.
            wide = max(best[("long-verify", Bmax)] - verify[Bmax], 0.0) / extra
            narrow = max(best[("long-verify", 2)] - verify[2], 0.0) / extra
            per_key_verify = max(wide - narrow, 0.0) / max(Bmax - 2, 1)
            per_key_base = max(narrow - 2 * per_key_verify, 0.0)
            per_key_plain = max(best[("long-plain", 0)] - best[("plain", 0)], 0.0) / (8 * extra)
        # Reading n rows, beyond the one every draft forward reads.
        reads = _monotone({n: max(best[("draft-read", n)] - best[("draft", Bmax)], 0.0) for n in READ_ROWS})
        step = (best[("plain", 0)] - best[("plain", 2)]) / 6
        if step <= 0:  # timings too noisy to split: a run of 8 over its steps, no fill
            step = best[("plain", 0)] / 8
        return cls(
            step,
            verify,
            table("draft"),
            min(rollback),
            table("tree"),
            context=context,
            per_key_verify=per_key_verify,
            per_key_plain=per_key_plain,
            per_key_base=per_key_base,
            draft_row=max(reads[READ_ROWS[-1]] - reads[READ_ROWS[-2]], 0.0) / (READ_ROWS[-1] - READ_ROWS[-2]),
            reads=reads,
            plain_fill=max(best[("plain", 0)] - 8 * step, 0.0),
        )


FIX_SAMPLES = 9  # the correction's memory (samples of drafted against plain cycle times)
# How far the correction may scale drafted cycles against plain steps, either
# way. The curve's parts were timed taking turns on this machine, so drafted
# cycles run off it relative to plain steps by tens of percent at most
# (0.94-1.05 here); a median beyond 1.5 is likelier a run of stalled samples
# than a price, and it keeps the draft off, and with it the samples that
# would bring it back (a noisy-clock replay sat plain at 0.49 of the best).
CORRECTION_BOUND = 1.5


def recent_median(xs: List[float], most: int = 5) -> float:
    """The median of the last ``most`` samples, at least 5 counted (missing
    ones as 1: no correction, no load). With up to 5 samples two odd ones
    never move it and three in a row do; a longer memory (the correction's
    FIX_SAMPLES) moves less on a short run of noisy ones: each correction
    sample is one drafted cycle against one plain run, 10-20% apart from
    run to run on a busy machine, and a correction that wanders by that much
    drafts where plain decoding pays, or the reverse."""
    xs = list(xs[-most:])
    xs = sorted(xs + [1.0] * (5 - len(xs)))
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


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
            None if getattr(draft, "vocab", None) is None else draft.vocab.size,
            tuple(sorted(tree_sizes)),
            str(path),
            stamp,
        )

    if memo_key() in _MEMO:  # this process read it already (and the file is unchanged)
        return _MEMO[memo_key()], False
    fp = cost_key(target, draft, kv_bits)
    mid = machine_id()
    entries = read_entries(path)
    want_tree = {int(n) for n in tree_sizes}
    for e in entries:
        if (
            e.get("model") == fp
            and e.get("machine") == mid
            and e.get("mlx") == mx.__version__
            and e.get("format") == FORMAT
            and not e.get("stale")
        ):
            try:
                costs = CostModel.from_dict(e["costs"])
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # a damaged entry: measured again below, and replaced
            if want_tree <= set(costs.tree):
                costs.origin = (str(path), fp, mid, str(e.get("measured")))
                _MEMO[memo_key()] = costs
                return costs, False
    costs = CostModel.measure(target, draft, kv_bits=kv_bits, tree_sizes=sorted(want_tree))
    mine = [e for e in entries if e.get("model") == fp and e.get("machine") == mid]
    entry = {
        "model": fp,
        "machine": mid,
        "mlx": mx.__version__,
        "format": FORMAT,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "costs": costs.to_dict(),
    }
    if any(e.get("stale") for e in mine):
        entry["remeasured"] = True  # it replaces a curve dropped as measured under load: kept for good
    costs.origin = (str(path), fp, mid, entry["measured"])
    write_entries(path, [e for e in entries if e not in mine][-31:] + [entry])
    _MEMO[memo_key()] = costs
    return costs, True


def read_entries(path: Path, key: str = "entries") -> list:
    """The list of dict entries under ``key`` in a JSON cache file; [] when the
    file is missing, damaged or of another shape."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    entries = data.get(key) if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def write_json(path: Path, data) -> bool:
    """Replace a cache file whole (``files.written_whole``); False where the
    folder is read-only."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(data, indent=1))
    except OSError:
        return False
    return True


def write_entries(path: Path, entries: List[dict]) -> bool:
    return write_json(path, {"entries": entries})


def forget_costs(costs: CostModel) -> bool:
    """Mark ``costs``' entry in the on-disk cache stale and drop it from
    this process's memo, so the next generation measures the pair again;
    for a curve found measured under load (:meth:`Policy.drifted`). A curve
    measured again that way is never dropped a second time: one that reads
    fast however it is measured is kept. Returns whether the entry was marked."""
    if costs.origin is None:
        return False
    path, fp, mid, stamp = costs.origin
    entries = read_entries(Path(path))
    mine = [
        e
        for e in entries
        if e.get("model") == fp and e.get("machine") == mid and str(e.get("measured")) == stamp and not e.get("stale")
    ]
    if not mine or any(e.get("remeasured") for e in mine):
        return False
    for e in mine:
        e["stale"] = True
    if not write_entries(Path(path), entries):
        return False  # a read-only folder: the curve stays, and so does its load correction
    costs.origin = None
    for k in [k for k, v in _MEMO.items() if v is costs]:
        del _MEMO[k]
    return True


# --- the policy ---------------------------------------------------------------------

SWITCH_MARGIN = 0.2
NEVER = 1 << 30  # a shadow countdown that never runs out


def evidence_margin(blocks: float) -> float:
    """How many times plain decoding's rate drafting must beat to leave it,
    on ``blocks`` blocks of acceptance evidence: ``1 + SWITCH_MARGIN /
    sqrt(blocks)``. A few lucky looks must not start cycles that cost
    several plain steps each where the draft only nearly pays."""
    return 1.0 + SWITCH_MARGIN / math.sqrt(max(blocks, 0.5))


@dataclass
class Plan:
    """What the next cycle does: ``width`` tokens verified (1 = plain steps,
    ``steps`` of them), as a chain or a tree of ``width`` nodes."""

    width: int
    steps: int = 1
    tree: bool = False
    block: int = 0  # the draft block the proposals come from (0: the width; trees: their candidates)
    shadow: int = 0  # plain steps: a shadow draft per this many of them (0: none)


class Acceptance:
    """Per-depth conditional acceptance p_d from counts decayed by ``decay``
    per observed block, shrunk by ``weight`` pseudo-observations toward the
    estimate one depth up (``prior`` at depth 1): a depth never tried is
    expected to do as the deepest one seen, so an oracle draft is widened
    step by step and a useless one is not."""

    def __init__(self, depths: int, prior: float = 0.6, weight: float = 1.0, decay: float = 0.98, stale: float = 0.85):
        self.hits = [0.0] * (depths + 1)
        self.trials = [0.0] * (depths + 1)
        self.prior, self.weight, self.decay, self.stale = prior, weight, decay, stale

    def observe(self, drafted: int, accepted: int, decay: Optional[float] = None) -> None:
        self.forget(self.decay if decay is None else decay)
        tested = min(accepted + 1, drafted)
        for d in range(1, tested + 1):
            self.trials[d] += 1
            self.hits[d] += d <= accepted
        # Depths this block did not reach go stale faster: a width kept narrow
        # after one early miss deeper down would otherwise never look again,
        # so their estimate drifts back to the one a depth up.
        for d in range(tested + 1, len(self.hits)):
            self.hits[d] *= self.stale
            self.trials[d] *= self.stale

    def copy(self) -> "Acceptance":
        out = Acceptance(len(self.hits) - 1, self.prior, self.weight, self.decay, self.stale)
        out.hits, out.trials = list(self.hits), list(self.trials)
        return out

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
    every ``tree_every`` drafted cycles while chains win).

    Evidence while plain: plain runs (``plain_run`` steps) carry shadow
    drafts: the first a block after the switch to plain, then twice as far
    apart each time, up to one per ``shadow_every`` plain tokens (sooner
    again while the last one looked promising, as far as their budget of
    ``shadow_share`` of plain decoding's time allows); ``shadowed`` books
    each and ends the run as soon as drafting pays on that evidence, by a
    margin that shrinks as the evidence grows (:meth:`margin`). Where the
    draft nearly pays, the next look is a drafted cycle instead (a probe):
    its expected loss against plain decoding is then under ``probe_share``
    of a shadow's cost, it commits what it gets right, and one verdict for
    plain after it ends it.

    Changes: a change between plain steps and drafted cycles costs
    ``costs.change`` beyond its parts; :meth:`rates` spreads it over the
    stretch it would start (:meth:`stretch`: a block leaving plain
    decoding, a plain run leaving drafting), so drafting must repay the
    change within a block to start, and near the end of a generation the
    policy keeps the kind it runs unless changing saves more.

    Costs under load: the measured curve already compares the widths under
    the same conditions (its parts take turns). Observed cycle times correct
    it only by what they compare alike: at each change between plain steps
    and drafted cycles, the two neighbouring observations (each over its
    modelled cost) give one sample of how far drafted cycles are off
    relative to plain steps (an observation serves one sample at most, so
    a stalled cycle, drafted or a plain run, between two changes gives
    one), and the median of the last 9 such samples (at least 5 counted),
    kept within 1.5x either way (``CORRECTION_BOUND``), scales every
    drafted width. A stretch of inflated timings slows both sides of a
    pair alike, except the one pair that straddles its start or end, so it
    moves the machine's load (reported) and not the choice."""

    plain_run = 64  # plain steps before the policy looks again (a shadow may end a run sooner)
    warmup_cycles = 1
    full_look = 4.0  # the first warm-up cycle drafts the full block if it costs at most this many plain steps
    full_look_ratio = 1.5  # ... and at most this many times the cycle of the width the prior pays best at
    # Plain steps first: the first ``settle_steps`` untimed (see __init__), then
    # the calibration run, timed; four in all, so the warm-up looks where it did
    # when all four were timed (one token later, it missed on a bench prompt
    # where it had hit, and the replay's ratio there fell from 1.18 to 1.01).
    settle_steps = 1
    calibration_steps = 3
    tree_every = 32  # drafted cycles between two looks at the tree while chains win
    shadow_share = 0.02  # at most this share of plain decoding's time goes to shadow drafts
    shadow_decay = 0.8  # evidence kept per shadow block scored (they come far apart: a few make a memory)
    promising = 0.75  # a shadow whose evidence gets drafting this close to paying is checked again soon
    # After a shadow, the next look is a drafted cycle (a probe) where, on the
    # evidence so far, it is expected to lose at most this share of what a
    # shadow costs against plain decoding (see :meth:`probe_loss`).
    probe_share = 0.5
    shadow_bank = 2.0  # shadow drafts that may be spent ahead of their share (the first ones of a plain stretch)
    # A generation whose cycles ran this much faster than the curve says finds
    # the curve measured under load (a curve the machine matches reads about 1).
    stale_load = 0.7

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
        # Before them a plain step that is not timed: the first after the
        # prompt pays one-off work (what the prefill left lazy, first
        # allocations), and timed with the calibration run it read ~8% dear
        # against the drafted cycle after it, a bias in every generation's
        # sample of the correction.
        self.settle: Optional[Plan] = None if costs is None else Plan(1, steps=self.settle_steps)
        self.warmup = self.warmup_cycles  # first drafted cycles, taken even where one slow cycle would say plain
        self.plain_votes = 0
        self.loads: List[float] = []  # recent observed / modelled times, drafted ones over the correction
        # Recent samples of (drafted observed / modelled) / (plain observed / modelled),
        # carried from one generation to the next of the same cost curve in this
        # process: each generation's calibration steps and first drafted cycles
        # give one, so a curve that is off on this machine now is corrected even
        # where a generation never switches between plain and drafting.
        self.fixes: List[float] = costs.fixes if costs is not None else []
        # The last timed cycle's kind, observed / modelled, and whether a sample of the correction used it.
        self.prev: Optional[Tuple[str, float, bool]] = None
        # The first cycle at a width is not timed: in a fresh process it
        # includes tracing that width's compiled forwards (tens of ms). Kept
        # per process with the curve, as the traces are.
        self.warm_widths = costs.warm if costs is not None else set()
        self.context = 0  # tokens in the target cache now (set by plan)
        self.tokens = 0  # committed so far
        self.shadows = 0  # shadow drafts scored
        self.run_shadows = 0  # of them, in the plain run not yet timed (its time includes theirs)
        self.shadow_gap = max_width  # plain tokens from one shadow draft to the next (doubles while they fail)
        self.unread = 0  # committed rows the draft has not read yet (set by plan)
        # The shadows' budget, in seconds: each plain token earns ``shadow_share`` of
        # a plain step, each shadow spends what it costs (its block and the rows it
        # reads), at most ``shadow_bank`` shadows' worth saved. However soon a
        # promising one asks to look again, they cost at most their share.
        self.shadow_credit = self.bank() if costs is not None else 0.0
        # The bank is an advance on what later plain tokens earn; on a short
        # generation it would outrun them (64 tokens spent 1.6 times the
        # share), so shadows are also held to the share of the whole
        # generation's tokens (probes are not: they commit tokens).
        self.horizon = 0  # the generation's length as the last plan saw it: committed + room
        self.spent = 0.0  # seconds of shadow drafts so far
        self.waited = 0  # plain tokens before the next (or in-flight) shadow draft starts
        self.last = 0  # the width of the last plan (0: none yet)
        self.probing = False  # the next plan is a probe (one drafted cycle; one verdict for plain ends it)
        self.probe_note = ""  # why it is (for the switch line)
        self.probe_now = False  # the plan just made is a probe
        self.reason = "calibration"  # why the next plan is what it is (for the switch lines)
        self.switches: List[str] = []  # one line per change of width: from, to and why

    @property
    def adaptive(self) -> bool:
        return self.costs is not None

    @property
    def shadow_every(self) -> int:
        """Plain tokens between two shadow drafts: as many as keep their cost
        (the block, and the rows it reads: one per plain token) under
        ``shadow_share`` of plain decoding's, at least a block apart (one in
        flight at a time) and at most ``plain_run``, which is also the
        spacing where reading a row alone costs more than the share."""
        c = self.costs
        spare = self.earned() - c.draft_row
        n = c.full_draft() / spare if spare > 0 else self.plain_run
        return int(min(max(n, self.max_width), self.plain_run))

    def earned(self) -> float:
        """Seconds of shadow budget one plain token earns."""
        return self.shadow_share * self.costs.plain

    def allowance(self) -> float:
        """Seconds the rest of this generation may spend on shadow drafts:
        ``shadow_share`` of all its tokens' plain time, less what they have
        spent."""
        return self.earned() * self.horizon - self.spent

    def bank(self) -> float:
        """Seconds of shadow budget that may be saved: ``shadow_bank`` shadow
        drafts that each read a block of rows."""
        return self.shadow_bank * self.costs.shadow(self.max_width)

    def correction(self) -> float:
        """How much dearer drafted cycles run than the measured curve says, relative to plain steps."""
        return min(max(recent_median(self.fixes, FIX_SAMPLES), 1 / CORRECTION_BOUND), CORRECTION_BOUND)

    def load(self) -> float:
        """How much slower the machine runs now than when the curve was measured (1: as measured)."""
        return recent_median(self.loads)

    def drifted(self) -> bool:
        """Whether this generation ran well faster than the curve says
        (``load() < stale_load`` over 5 samples): the curve was measured
        while something else held the machine, and is worth measuring again.
        (Slower than measured is today's load: that says nothing of the curve.)"""
        return self.adaptive and len(self.loads) >= 5 and self.load() < self.stale_load

    def cost(self, width: int, rows: float = 0.0) -> float:
        """Seconds per cycle of ``width`` (1: a plain step) under the conditions
        the curve was measured in, its draft reading ``rows`` committed rows,
        drafted widths corrected by what observed times said about them
        relative to plain steps."""
        if width == 1:  # a step of a run as long as plain runs go, its fill shared out
            return self.costs.plain_run(self.plain_run, self.context) / self.plain_run
        return (self.costs.cycle(width, self.context) + self.costs.read(rows)) * self.correction()

    def ladder(self, room: int) -> List[int]:
        """The drafted widths considered: 2, 3, 4, 6, 8, 12, 16, 24, 32, ...
        (powers of two and three times them) up to the block, and the room
        left. Each width a forward has not run yet costs a trace of every
        layer's compiled pieces (milliseconds per layer), so a ladder with
        neighbours at most 1.5x apart keeps that to a few traces per process
        at little loss of fit."""
        top = min(self.max_width, room)
        out = ladder_widths(top)
        # A width whose verify was measured dearer than a wider one's is left
        # out: the wider verifies more for less (on a CPU, 3 and 5-7 rows ran
        # dearer than 4 and 8; drafted at 3 a draft right at depth 3 lost 18%
        # to a pinned 4).
        v = self.costs.verify if self.costs is not None else {}
        return [B for B in out if not (B in v and any(w > B and w in v and v[w] <= v[B] for w in out))]

    def rates(self, room: int, acc: Optional[Acceptance] = None) -> Dict[int, float]:
        """Expected committed tokens per second (load-free) of B = 1 and each
        ladder width, on ``acc`` (default: the acceptance estimate now). The
        kind not running now (plain steps or drafted cycles) also pays a
        change to it, spread over the tokens a stretch of it may run
        (:meth:`stretch`)."""
        per = self.costs.change / self.stretch() if self.last else 0.0
        out = {1: 1.0 / (self.cost(1) + (per if self.last > 1 else 0.0))}
        top = min(self.max_width, room)
        if top < 2:
            return out
        ladder = set(self.ladder(room))
        into = per if self.last == 1 else 0.0
        e, reach = 1.0, 1.0
        for B, p in enumerate((acc or self.acc).probs(top - 1), start=2):
            reach *= p
            e += reach
            if B in ladder:
                # The next draft reads the rows this cycle commits.
                out[B] = e / (self.cost(B, rows=e) + e * into)
        return out

    def stretch(self) -> int:
        """Tokens a change made now is spread over, at most the room the last
        plan saw. Leaving plain decoding, a block: the evidence that drafting
        pays (a shadow, often) speaks for the next block, and a drafted
        stretch that starts on it may end after one (in the replay, spread
        over a plain run's 64 tokens instead, runs under 0.97 at the real
        shape rose from 29% to 32%). Leaving drafting, a plain run."""
        span = self.max_width if self.last == 1 else self.plain_run
        return max(min(self.horizon - self.tokens, span), 1)

    def best_width(self, room: int, drafted: bool = False) -> int:
        """argmax over the ladder's B (and B = 1 unless ``drafted``) of their
        :meth:`rates` (E(B) / cost(B), a change to the kind not running now
        priced), plain's rate raised by :meth:`margin` while decoding plainly."""
        r = self.rates(room)
        if drafted and len(r) > 1:
            del r[1]
        elif self.last == 1:
            r[1] *= self.margin()
        return max(r, key=lambda B: (r[B], -B))

    def margin(self, acc: Optional[Acceptance] = None) -> float:
        """How much better than plain decoding drafting must look to leave it:
        :func:`evidence_margin` of the blocks of evidence in ``acc`` (default:
        the estimate now; a shadow or a cycle weighs one block, less as it ages)."""
        return evidence_margin((acc or self.acc).trials[1])

    def shadow_verdict(self, acc: Optional[Acceptance] = None) -> Tuple[float, float]:
        """(the best drafted width's rate, plain decoding's rate times the
        margin) on ``acc``: what a shadow's evidence is judged by."""
        r = self.rates(self.max_width, acc)
        plain = r.pop(1) * self.margin(acc)
        return (max(r.values()) if r else 0.0), plain

    def plan(self, room: int, context: int = 0, unread: int = 0) -> Plan:
        """The next cycle, given ``room`` tokens left (before max_tokens or the
        context end), ``context`` tokens already in the target's cache and
        ``unread`` committed rows the draft has not read yet."""
        self.context = context
        self.unread = unread
        self.horizon = self.tokens + room
        self.probe_now = False
        p = self._plan(room)
        if self.adaptive and p.width != self.last:
            self._switched(p, room)
        self.last = p.width
        return p

    def _plan(self, room: int) -> Plan:
        if room <= 1 or self.max_width <= 1:
            self.reason = "one token left"
            return Plan(1, steps=max(room, 1))
        if not self.adaptive:
            if self.tree_budget > 0:
                return Plan(self.tree_budget + 1, tree=True, block=min(self.fixed or self.max_width, room))
            return Plan(min(self.fixed or self.max_width, room))
        if self.probing:
            # One drafted cycle as the next look (``shadowed``): a first verdict
            # for plain after it ends it, as one after the warm-up does.
            self.probing = False
            self.probe_now = True
            self.plain_votes = 1
            self.reason = self.probe_note
            return self._chain(self.best_width(room, drafted=True))
        if self.settle is not None and self.tokens == 0:
            return self.settle
        if self.plain_left > 0:  # the calibration steps (no shadow: they time plain steps alone)
            return Plan(1, steps=min(self.plain_left, room))
        if self.warmup > 0:
            # Drafted whatever plain steps would do, to see the draft at work.
            # The first look is at the full block where that costs at most
            # ``full_look`` plain steps and ``full_look_ratio`` times the
            # cycle the prior pays best at: evidence at every depth at once,
            # so a draft right for whole blocks is drafted at full width from
            # the next cycle instead of widened a step at a time (on 128
            # tokens of an easy text that cost a fifth of the speed). Where a
            # wide verify is dear (a slow BLAS, a long context, a mixture of
            # experts, whose block reads every expert its rows pick), only as
            # wide as pays best under the acceptance known so far (the prior
            # at first). The ratio compares drafted cycles alone, so a load
            # that slows them alike does not move it.
            self.reason = "warm-up"
            top = min(self.max_width, room)
            best = self.best_width(room, drafted=True)
            if (
                self.warmup == self.warmup_cycles
                and self.cost(top) <= self.full_look * self.cost(1)
                and self.cost(top) <= self.full_look_ratio * self.cost(best)
            ):
                return self._chain(top)
            return self._chain(best)
        B = self.best_width(room)
        if B == 1:
            # Two such verdicts in a row before a plain run: one unlucky cycle
            # does not switch the draft off.
            self.plain_votes += 1
            if self.plain_votes >= 2 or room < self.max_width or self.last == 1:
                self.plain_votes = 0
                self.reason = "evidence"
                if self.last != 1:  # a new plain stretch: the first shadow comes a block in
                    self.shadow_gap = self.max_width
                    self._next_shadow(self.shadow_gap, unread=self.unread)
                return Plan(1, steps=min(self.plain_run, room), shadow=self.waited)
            self.reason = "evidence (a first vote for plain)"
            return self._chain(self.best_width(room, drafted=True))
        self.plain_votes = 0
        self.reason = "shadow evidence" if self.last == 1 and self.shadows else "evidence"
        if self.auto_tree and room >= self.max_width:
            self.since_tree += 1
            chain = self.acc.expected(B) / self.cost(B, rows=self.acc.expected(B))
            if self.tree_kept is None or self.since_tree >= self.tree_every or self.tree_rate() > chain:
                self.since_tree = 0
                return Plan(self.auto_tree + 1, tree=True, block=self.max_width)
        return self._chain(B)

    def tree_rate(self) -> float:
        """Expected tokens per second of a tree cycle: its committed tokens so
        far (before any: as the widest chain) over its cost (measured, corrected
        as drafted cycles are)."""
        kept = self.tree_kept if self.tree_kept is not None else self.acc.expected(self.max_width)
        cost = (self.costs.tree_cycle(self.auto_tree + 1, self.context) + self.costs.read(kept)) * self.correction()
        return kept / cost

    def _chain(self, width: int) -> Plan:
        """A chain of ``width`` drafted from the full block: a DFlash draft's
        block rows attend to each other, so a shorter block proposes other
        (worse) tokens than the block it was trained on, and per-depth
        acceptance measured at one width would not hold at another."""
        return Plan(width, block=self.max_width)

    def _switched(self, p: Plan, room: int) -> None:
        """A line for ``--verbose``: the change of width, why, the candidates'
        expected tokens per second at the current load, and the acceptance evidence."""
        load = self.load()
        rates = " ".join(f"{'plain' if B == 1 else B}:{r / load:.0f}" for B, r in self.rates(room).items())
        probs = " ".join(f"{x:.2f}" for x in self.acc.probs(min(4, self.max_width - 1)))
        seen = f"{self.acc.trials[1]:.1f} blocks' weight" + (f", {self.shadows} shadow" if self.shadows else "")
        frm = "start" if self.last == 0 else ("plain" if self.last == 1 else f"B{self.last}")
        to = "plain" if p.width == 1 else ("tree" if p.tree else f"B{p.width}")
        why = self.reason + (f", {room} tokens left" if 1 < room < self.max_width else "")
        if self.last == 1 and p.width > 1 and self.warmup == 0 and not self.probe_now:
            # leaving plain on evidence: the margin it cleared
            why += f", margin x{self.margin():.2f}"
        self.switches.append(
            f"token {self.tokens}: {frm} -> {to} ({why}); expected tok/s {rates}; "
            f"p1..: {probs} ({seen}); load x{load:.2f}"
        )

    def timed(self, plan: Plan, committed: int, seconds: float, read: int = 0) -> None:
        """Recalibrate from the wall time of a cycle (or a run of plain steps,
        ``committed`` tokens) up to the start of the next, in which the draft
        read ``read`` committed rows."""
        shadows, self.run_shadows = self.run_shadows, 0
        if not self.adaptive or seconds <= 0 or plan is self.settle:
            return
        w = "tree" if plan.tree else plan.width
        if w != 1 and w not in self.warm_widths:
            self.warm_widths.add(w)
            return
        kind = "plain" if w == 1 else "draft"
        if plan.tree:
            model = self.costs.tree_cycle(plan.width, self.context)
        else:
            model = self.costs.cycle(plan.width, self.context)
        if w == 1:  # a run of plain steps, and the shadow drafts it carried
            model = self.costs.plain_run(committed, self.context) + shadows * self.costs.full_draft()
        model += self.costs.read(read)
        ratio = seconds / model
        # Neighbours of a change: alike conditions. Each observation serves one
        # sample at most: a drafted cycle between two plain runs (a warm-up, a
        # probe) would give two, and one stall there two samples as far off.
        paired = self.prev is not None and self.prev[0] != kind and not self.prev[2]
        if paired:
            drafted, plain = (ratio, self.prev[1]) if kind == "draft" else (self.prev[1], ratio)
            self.fixes.append(min(max(drafted / plain, 1 / 3), 3.0))
            del self.fixes[:-FIX_SAMPLES]
        self.prev = (kind, ratio, paired)
        self.loads = (self.loads + [ratio / (self.correction() if kind == "draft" else 1.0)])[-5:]

    def observe(self, plan: Plan, committed: int) -> None:
        """Book a cycle: ``committed`` tokens (plain steps: one each)."""
        if not self.adaptive:
            return
        self.tokens += committed
        if plan.tree:
            self.tree_kept = committed if self.tree_kept is None else 0.8 * self.tree_kept + 0.2 * committed
            return
        if plan.width == 1:
            if plan is not self.settle:
                self.plain_left = max(self.plain_left - committed, 0)
            return
        self.acc.observe(plan.width - 1, committed - 1)
        if self.warmup > 0:
            self.warmup -= 1
            if self.warmup == 0:
                # The warm-up's cycles are evidence already: a first verdict for
                # plain after them is not one unlucky cycle.
                self.plain_votes = 1

    def shadowed(self, drafted: int, accepted: int, read: int = 0, partial: bool = False) -> Optional[int]:
        """Book a shadow draft (``drafted`` tokens compared with what plain
        decoding committed, ``accepted`` of them matching before the first
        miss; it read ``read`` committed rows first); returns the plain steps
        before the next one, or 0 when, on this evidence, drafting pays or
        the next look is a probe (:meth:`probe_loss`; the plain run ends).

        ``partial``: the shadow's block is not all committed yet and its
        first ``drafted`` tokens were all right. Booked (and 0 returned) only
        if drafting pays on that much already; else None: nothing is booked
        and the shadow stays in flight. A draft right for whole blocks is
        back after two or three plain tokens instead of a block of them."""
        if partial:
            seen = self.acc.copy()
            seen.observe(drafted, drafted, decay=self.shadow_decay)
            best, plain = self.shadow_verdict(seen)
            if best <= plain:
                return None
        self.acc.observe(drafted, accepted, decay=self.shadow_decay)
        self.shadows += 1
        self.run_shadows += 1
        # Its budget: the plain steps before it earned, it spent its cost, the steps it ran earned.
        bank, earned = self.bank(), self.earned()
        self.shadow_credit = min(self.shadow_credit + self.waited * earned, bank) - self.costs.shadow(read)
        self.spent += self.costs.shadow(read)
        self.shadow_credit = min(self.shadow_credit + drafted * earned, bank)
        best, plain = self.shadow_verdict()
        if best > plain:
            return 0
        loss = self.probe_loss()
        if loss <= self.probe_share * self.costs.shadow(self.max_width) and loss <= self.shadow_credit:
            self.shadow_credit -= loss  # a probe's expected loss is spent from the shadows' budget
            self.probing = True
            self.probe_note = (
                f"probe: expected loss {loss / self.costs.plain:.2f} plain steps, "
                f"a shadow {self.costs.shadow(self.max_width) / self.costs.plain:.2f}"
            )
            return 0
        if best > self.promising * plain:
            return self._next_shadow(1, counted=1, unread=drafted)
        # Soon after a switch to plain the text may turn at any time (an early
        # bad stretch must not cost a short generation); the longer shadows
        # fail, the rarer they get. Counted from now: the next one starts
        # ``shadow_gap`` tokens after this one did.
        self.shadow_gap = min(2 * self.shadow_gap, self.shadow_every)
        return self._next_shadow(max(self.shadow_gap - drafted, 1), counted=1, unread=drafted)

    def probe_loss(self) -> float:
        """Seconds a drafted cycle at the best width is expected to lose against
        plain decoding on the acceptance known now: its cost (with the change
        into drafting spread as :meth:`rates` spreads it) less the time plain
        steps take for the tokens it is expected to commit. Where the
        draft nearly pays, that is less than a shadow costs, and the cycle
        commits tokens besides: the cheaper look. Load-free, as :meth:`cost` is."""
        r = self.rates(self.max_width)
        plain = r.pop(1)
        if not r:
            return math.inf
        B = max(r, key=lambda b: (r[b], -b))
        return self.cost(B, rows=self.acc.expected(B)) * max(1.0 - r[B] / plain, 0.0)

    def _next_shadow(self, steps: int, counted: int = 0, unread: int = 0) -> int:
        """The countdown to the next shadow draft: at least ``steps``, and
        as many as the budget needs to afford it (:data:`NEVER` where no
        wait does: reading the rows that pile up costs more than they earn).
        ``counted``: steps of the countdown that are not plain tokens yet
        (the decoder counts the step a shadow is scored in as the first);
        ``unread``: rows the draft has not read now (a shadow reads them and
        one per plain token it waits)."""
        c, earned, bank = self.costs, self.earned(), self.bank()

        def spare(w: int) -> float:  # the budget after ``w`` plain tokens, less the shadow's cost then
            return min(self.shadow_credit + w * earned, bank, self.allowance()) - c.shadow(unread + w)

        wait = max(steps - counted, 0)
        # Searched, not solved: reading rows costs more per row below the
        # first measured count than beyond it (a forward's rows share its
        # work), so a wait worked out at one rate fell short, came out as
        # NEVER, and a plain stretch after a drafted one had no shadow left.
        # Past where the budget reaches the bank the rows only cost more.
        last = max(wait, math.ceil((bank - self.shadow_credit) / earned)) if earned > 0 else wait
        while spare(wait) < -1e-12:
            if wait >= last:
                self.waited = 0
                return NEVER
            wait += 1
        self.waited = wait
        return wait + counted

    def describe(self) -> str:
        if not self.adaptive:
            return f"pinned ({'tree of ' + str(self.tree_budget) if self.tree_budget else 'block ' + str(self.fixed or self.max_width)})"
        c = self.costs
        ratios = " ".join(f"B{B}:{c.cycle(B) / c.plain:.2f}" for B in sorted(c.verify))
        tree = f"; chains or a tree of {self.auto_tree}" if self.auto_tree else ""
        return (
            f"adaptive (cycle cost / plain step: {ratios}; plain step {c.plain * 1e3:.2f} ms; "
            f"a context row read by the draft {c.draft_row / c.plain:.3f}; "
            f"a shadow draft per {self.shadow_every} plain tokens{tree})"
        )
