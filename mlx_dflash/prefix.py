"""Prefix snapshots: a request that shares a prefix with an earlier one
restores the target (and draft) state instead of prefilling it again.

Design:

- A *snapshot* is the state after the first ``n`` tokens of a sequence, at a
  committed-token boundary: attention KV rows [0, n), every DeltaNet layer's
  recurrent and conv state, and the draft's context cache (its K/V rows within
  its window), so speculation after a restore accepts what it would cold.
  It is keyed by the ``n`` token ids themselves; lookup compares them in full
  (never a hash alone) and takes the longest snapshot whose tokens start the
  prompt, leaving at least one prompt token to prefill (its logits give the
  first reply token).
- *Thick/thin split*: attention KV is position-local, so rows [0, m) of a
  longer sequence are exactly the KV of its first m tokens. KV is stored once
  per conversation in *segments* (rows [start, end), right-sized copies, each
  chained to the segment holding the rows before it); a snapshot only points
  at a segment and a row count. Recurrent state is exact only where it was
  taken, so each snapshot holds its own (fixed size per layer). An
  unwindowed draft's context K/V is position-local too and lives in the
  segments; a windowed draft's rows are kept per snapshot. Restoring
  copies the KV rows into a fresh cache buffer: later decoding never writes
  into a snapshot (MLX arrays are values; the copy is the only writable one).
- *Where snapshots are taken*: the stable prompt boundary (the prompt minus
  the generation-prompt tail a chat template appends, e.g.
  ``<|im_start|>assistant\\n``, which the next turn renders as part of the
  history or differently; without a tail, one token before the end), rungs
  every ``rung_interval`` tokens of a long prefill (recurrent state only: a
  request that diverges mid-history resumes from the last rung below the
  divergence) and the end of generation (prompt + reply).
- The store sees the caches only through ``cache.LayerCache``: sequence
  caches (attention KV, float or quantized; an unwindowed draft) give row
  ranges for segments, fixed-size ones (DeltaNet, a windowed draft) their
  whole state, each as opaque arrays plus a JSON meta, which is also what
  the file holds. A cache holds one KV format (``--kv-bits``).
- Memory: LRU eviction by the bytes of the arrays held (each shared segment
  counted once); the default budget is ``DEFAULT_MEMORY_FRACTION`` of device
  memory. Snapshots stay on the device; only ``save`` reads them back.
"""

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import State, describe, first_rows, piece_rows
from .errors import DFlashError, is_int, writable_file
from .files import written_whole

DEFAULT_MEMORY_FRACTION = 0.25  # of device (unified) memory
# Rungs fall on multiples of this (the default prefill chunk), so they split
# no prefill forward; bench/results/prefix-cache.md measures the interval.
RUNG_STEP = 512
FILE_FORMAT = "mlx-dflash-prefix-cache"
FILE_VERSION = "3"  # 2: the checksum covers the metadata too; 3: opaque cache states + meta


def device_memory() -> int:
    """Bytes of memory the device can use (unified memory on Apple silicon)."""
    try:
        size = mx.device_info().get("memory_size")
        if size:
            return int(size)
    except Exception:  # older mlx or a backend without device_info
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _Segment:
    """Rows [start, end) of one conversation's sequence caches: ``layers``
    maps each sequence layer of the target to its state piece, ``draft`` is
    the same rows of an unwindowed draft's context (or None). Rows before
    ``start`` come from ``parent`` (whose end is >= start)."""

    __slots__ = ("start", "end", "parent", "layers", "draft")

    def __init__(
        self,
        start: int,
        end: int,
        parent: Optional["_Segment"],
        layers: Dict[int, State],
        draft: Optional[State] = None,
    ):
        self.start, self.end, self.parent, self.layers, self.draft = start, end, parent, layers, draft

    def own_arrays(self) -> List[mx.array]:
        out = [a for arrays, _ in self.layers.values() for a in arrays]
        return out + (self.draft[0] if self.draft is not None else [])

    def has_draft_rows(self, n: int) -> bool:
        return all(seg.draft is not None for seg, _, _ in self.pieces(n))

    def pieces(self, n: int) -> List[Tuple["_Segment", int, int]]:
        """(segment, lo, hi) covering rows [0, n), in order."""
        out, seg = [], self
        while seg is not None and n > 0:
            hi = min(n, seg.end)
            if hi > seg.start:
                out.append((seg, seg.start, hi))
                n = seg.start
            seg = seg.parent
        if n > 0:
            raise RuntimeError("prefix segment chain does not reach row 0")
        return out[::-1]


@dataclass
class _Snapshot:
    tokens: Tuple[int, ...]
    seg: Optional[_Segment]
    layers: Dict[int, State]  # the fixed-size layers' states (DeltaNet)
    draft_layout: Optional[dict]  # the draft cache's layout(); None: no draft state
    draft: Optional[State]  # the draft's own state; None: its rows are in the segment chain
    kind: str  # "boundary", "rung" or "end"
    used: int = 0

    @property
    def n(self) -> int:
        return len(self.tokens)

    def own_arrays(self) -> List[mx.array]:
        out = [a for arrays, _ in self.layers.values() for a in arrays]
        return out + (self.draft[0] if self.draft is not None else [])

    def arrays(self) -> List[mx.array]:
        out = self.own_arrays()
        seg = self.seg
        while seg is not None:
            out += seg.own_arrays()
            seg = seg.parent
        return out


def _chain_has_draft_rows(base) -> bool:
    seg, upto = base
    return seg is None or upto == 0 or seg.has_draft_rows(upto)


def _take(tokens, cache, dcache, base, kind: str) -> _Snapshot:
    """A snapshot of ``cache`` (and ``dcache``) as they are now: the
    fixed-size states copied; sequence rows are added to a segment at commit.
    An unwindowed draft's rows go there too when the chain below holds its
    rows (see ``_commit``)."""
    fixed = {i: c.snapshot_state() for i, c in enumerate(cache.layers) if not c.sequence}
    layout, dstate = None, None
    if dcache is not None:
        layout = dcache.layout()
        if not (dcache.sequence and _chain_has_draft_rows(base)):
            dstate = dcache.snapshot_state()
    return _Snapshot(tuple(int(t) for t in tokens), None, fixed, layout, dstate, kind)


class PrefixRun:
    """One generation's link to the cache: what it restored, where its own
    KV segment ends, and the end-of-generation snapshot."""

    def __init__(self, pc: "PrefixCache", cache, draft, dcache, base: Tuple[Optional[_Segment], int]):
        self.pc, self.cache, self.draft, self.dcache = pc, cache, draft, dcache
        self.base = base  # (segment chain, rows of the cache it already holds)
        self.finished = False

    def finish(self, tokens: Sequence[int], pending_features: Optional[mx.array] = None) -> None:
        """Snapshot the cache at its committed boundary (``cache.offset`` rows
        of ``tokens``). ``pending_features``: target features of committed
        rows the draft has not consumed yet."""
        if self.finished:
            return
        self.finished = True
        n = self.cache.offset
        # Fewer tokens than rows: it verified past its EOS or max_tokens, and
        # those rows' tokens were never handed out, so no snapshot names them.
        if n <= self.base[1] or self.cache.block or len(tokens) < n:
            return
        d = self.dcache
        if d is not None:
            if pending_features is not None and pending_features.shape[0] > 0:
                d = d.fork()  # the generation's own cache is left as it is
                self.draft.add_context(pending_features, d)
            if d.length != n:
                return  # draft context out of step: no consistent snapshot here
        snap = _take(tokens[:n], self.cache, d, self.base, "end")
        self.pc._commit(self.cache, self.base, [snap], d)


class PrefixCache:
    """Prefix snapshots of target (and draft) state, shared across requests.

    ``max_bytes``: memory budget for the snapshot arrays (default
    ``DEFAULT_MEMORY_FRACTION`` of device memory); least recently used
    snapshots are evicted first. ``rung_interval``: a long prefill leaves a
    snapshot every this many tokens (0 = none). Default: the smallest
    multiple of ``RUNG_STEP`` (512) whose attention KV takes at least the
    memory of one rung's recurrent state, so rungs never cost more memory
    than the history they index (512 for the embedded pair; larger for
    models with many DeltaNet layers per attention layer).

    The cache holds states of one KV format (``--kv-bits``), set by its
    first use or by the file it was loaded from.
    """

    def __init__(self, max_bytes: Optional[int] = None, rung_interval: Optional[int] = None):
        if max_bytes is None:
            max_bytes = int(DEFAULT_MEMORY_FRACTION * device_memory())
        for name, v in (("budget", max_bytes), ("rung interval", rung_interval)):
            if v is not None and not is_int(v):
                raise DFlashError(f"prefix cache {name} must be an integer, got {v!r}")
        if max_bytes <= 0:
            raise DFlashError(f"prefix cache budget must be positive, got {max_bytes} bytes")
        if rung_interval is not None and rung_interval < 0:
            raise DFlashError(f"rung interval must be >= 0, got {rung_interval}")
        self.max_bytes = int(max_bytes)
        self.rung_interval = rung_interval  # None: chosen per model at first use
        self._snaps: List[_Snapshot] = []
        self._lock = threading.RLock()  # requests from several threads may share one cache
        self._clock = 0
        self._min_bytes: Dict[Tuple[int, str], int] = {}
        self._tails: Dict[Tuple[int, str], Tuple[object, Tuple[int, ...]]] = {}
        self._target = None  # snapshots belong to one model
        self._engine = None
        self._fingerprint = None
        self._layout: Optional[List[dict]] = None  # the target cache layers' layouts

    def bind(self, engine) -> None:
        """Tie the cache to ``engine``'s model (done by ``stream_generate``).
        Another engine is accepted only if its model has the same fingerprint."""
        if self._engine is engine:
            return
        if self._engine is not None or self._target is not None:
            if self._target is not engine.target:
                if self._fingerprint is None and self._engine is not None:
                    self._fingerprint = fingerprint(self._engine)
                if self._fingerprint is None or fingerprint(engine) != self._fingerprint:
                    raise DFlashError(
                        "this prefix cache holds snapshots of another model; use one PrefixCache per model"
                    )
        self._engine, self._target = engine, engine.target

    # --- bookkeeping ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (each shared array counted once)."""
        seen = {}
        with self._lock:
            for s in self._snaps:
                for a in s.arrays():
                    seen[id(a)] = a.nbytes
        return sum(seen.values())

    def clear(self) -> None:
        with self._lock:
            self._snaps.clear()

    def snapshots(self) -> List[Tuple[int, str]]:
        """(tokens, kind) of each snapshot, least recently used first."""
        with self._lock:
            return [(s.n, s.kind) for s in sorted(self._snaps, key=lambda s: s.used)]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _evict(self) -> None:
        while self._snaps and self.nbytes > self.max_bytes:
            self._snaps.remove(min(self._snaps, key=lambda s: s.used))

    # --- lookup ----------------------------------------------------------------
    def lookup(self, prompt: Sequence[int], *, draft_layout: Optional[dict] = None) -> Optional[_Snapshot]:
        """The longest snapshot whose tokens start ``prompt`` and leave at
        least one token to prefill (with a draft state of ``draft_layout``
        when one is given)."""
        prompt = tuple(int(t) for t in prompt)
        best = None
        with self._lock:
            for s in self._snaps:
                n = s.n
                if n >= len(prompt) or (best is not None and n <= best.n):
                    continue
                if draft_layout is not None and s.draft_layout != draft_layout:
                    continue
                if s.tokens == prompt[:n]:
                    best = s
        return best

    def snapshot_points(self, prompt: Sequence[int], boundary: Optional[int] = None, start: int = 0) -> set:
        """The prompt lengths a prefill of ``prompt`` from ``start`` takes
        snapshots at: its stable ``boundary`` (default: all but the last
        token) and every ``rung_interval`` tokens before it."""
        P = len(prompt)
        boundary = P - 1 if boundary is None else min(boundary, P - 1)
        points = {boundary}
        if self.rung_interval:
            points.update(range(self.rung_interval, boundary, self.rung_interval))
        return {p for p in points if start < p < P}

    def stable_boundary(self, tokenizer, ids: Sequence[int], template_args: Optional[dict] = None) -> int:
        """Tokens of ``ids`` before the chat template's generation-prompt tail
        (the part the next turn renders differently; ``template_args``: extra
        template arguments such as enable_thinking); without one, all but the last."""
        args = template_args or {}
        key = (id(tokenizer), json.dumps(args, sort_keys=True, default=str))
        if key not in self._tails or self._tails[key][0] is not tokenizer:
            self._tails[key] = (tokenizer, _generation_tail(tokenizer, args))
        tail = self._tails[key][1]
        n = len(ids)
        if tail and n > len(tail) and tuple(ids[n - len(tail) :]) == tail:
            return n - len(tail)
        return n - 1

    # --- prefill / restore -------------------------------------------------------
    def _check_format(self, cache, adopt: bool = True) -> None:
        """Snapshots restore only into a cache of their layout (float or
        quantized KV of the same bits). ``adopt``: an empty cache takes
        ``cache``'s layout (else it is only compared)."""
        ours = [c.layout() for c in cache.layers]
        with self._lock:
            if self._layout is None or not self._snaps:
                if adopt:
                    self._layout = ours
                return
            theirs = self._layout
        if theirs != ours:
            i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), 0)
            raise DFlashError(
                f"this prefix cache holds snapshots of a {describe(theirs[i])} cache; this generation uses "
                f"{describe(ours[i])} (--kv-bits): use one prefix cache (or prompt cache file) per KV format"
            )

    def check_budget(self, target, kv_bits: Optional[int] = None) -> None:
        """A DFlashError now if the budget cannot hold one snapshot of
        ``target`` (with ``kv_bits`` KV), or the snapshots held are of
        another KV format, rather than at every prompt later."""
        cache = target.make_cache(kv_bits=kv_bits) if kv_bits else target.make_cache()
        self._check_budget(target, cache)
        self._check_format(cache, adopt=False)

    def _check_budget(self, target, cache) -> None:
        if self._target is None:
            self._target = target
        elif self._target is not target:
            raise DFlashError("this prefix cache holds snapshots of another model; use one PrefixCache per model")
        key = (id(target), json.dumps([c.layout() for c in cache.layers]))
        if key not in self._min_bytes:
            probe = cache.empty()
            target.forward([0], probe, logits="none")
            mx.eval(probe.state())
            self._min_bytes[key] = sum(a.nbytes for a in probe.state())
            if self.rung_interval is None:
                row = sum(c.nbytes() for c in probe.layers if c.sequence)
                rec = self._min_bytes[key] - row
                steps = -(-rec // max(row * RUNG_STEP, 1))
                self.rung_interval = RUNG_STEP * max(1, steps)
        need = self._min_bytes[key]
        if self.max_bytes < need:
            raise DFlashError(
                f"prefix cache budget of {self.max_bytes} bytes is too small for one snapshot "
                f"of this model (at least {need} bytes: its recurrent state and one KV row)"
            )

    def _restore(self, snap: _Snapshot, cache, dcache) -> None:
        n = snap.n
        pieces = snap.seg.pieces(n)
        for i, c in enumerate(cache.layers):
            if c.sequence:
                c.restore_state([first_rows(seg.layers[i], hi - lo) for seg, lo, hi in pieces])
            else:
                c.restore_state([snap.layers[i]])
        cache.restored(n)
        if dcache is not None:
            if snap.draft is None:  # its rows are in the segment chain
                dcache.restore_state([first_rows(seg.draft, hi - lo) for seg, lo, hi in pieces])
            else:
                dcache.restore_state([snap.draft])

    def prefill(self, target, prompt: Sequence[int], cache, **options):
        """:meth:`prefill_steps` run to its end (``options`` as it takes them):
        returns (last-row logits [1, V], a :class:`PrefixRun`)."""
        *_, out = self.prefill_steps(target, prompt, cache, **options)
        return out

    def prefill_steps(
        self,
        target,
        prompt: Sequence[int],
        cache,
        *,
        draft=None,
        dcache=None,
        capture: Sequence[int] = (),
        chunk_size: int = 512,
        boundary: Optional[int] = None,
        stats=None,
    ):
        """Restore the longest matching snapshot into the empty ``cache`` (and
        ``dcache``), prefill the rest of ``prompt`` (``target.prefill_steps``,
        which calls back here at the stable boundary and rungs to take
        snapshots); the draft consumes the prompt's features here. One chunk
        per step, so a batch runs its other slots' cycles in between: yields
        None after each chunk but the last, then (last-row logits [1, V], a
        :class:`PrefixRun`)."""
        self._check_format(cache)
        self._check_budget(target, cache)
        if draft is not None and not hasattr(draft, "add_context"):
            raise DFlashError("this draft cannot be used with a prefix cache (no add_context)")
        prompt = [int(t) for t in prompt]
        start, base = 0, (None, 0)
        with self._lock:
            snap = self.lookup(prompt, draft_layout=dcache.layout() if dcache is not None else None)
            if snap is not None:
                self._restore(snap, cache, dcache)
                snap.used = self._tick()
                start, base = snap.n, (snap.seg, snap.n)
        if stats is not None:
            stats.cached_tokens = start
        points = self.snapshot_points(prompt, boundary, start)
        layout = dcache.layout() if dcache is not None else None
        with self._lock:  # a snapshot serves this run if its draft state fits it (or it needs none)
            have = {s.tokens for s in self._snaps if layout is None or s.draft_layout == layout}
        points = {p for p in points if tuple(prompt[:p]) not in have}
        taken = []

        def at_point(e: int) -> List[mx.array]:
            taken.append(_take(prompt[:e], cache, dcache, base, "boundary" if e == boundary else "rung"))
            return taken[-1].own_arrays()

        consume = None
        if draft is not None and dcache is not None:

            def consume(f: mx.array) -> List[mx.array]:
                draft.add_context(f, dcache)
                return dcache.state()

        for out in target.prefill_steps(
            prompt[start:],
            cache,
            capture=capture if consume is not None else (),
            chunk_size=chunk_size,
            consume=consume,
            points=sorted(points),
            at_point=at_point,
        ):
            if out is None:
                yield None
        logits, _ = out
        if taken:
            base = self._commit(cache, base, taken, dcache)
        yield logits, PrefixRun(self, cache, draft, dcache, base)

    def _commit(self, cache, base, snaps: List[_Snapshot], dcache=None):
        """Store ``snaps`` (all prefixes of the cache's tokens) with one new
        segment for rows the chain lacks; an unwindowed draft's context rows
        (``dcache``, holding at least those rows) go into it too when the
        chain holds the draft's rows below, so its snapshots share them.
        Returns the new base."""
        seg, upto = base
        end = max(s.n for s in snaps)
        share = dcache is not None and dcache.sequence and dcache.rows >= end and _chain_has_draft_rows(base)
        if any(s.draft_layout is not None and s.draft is None for s in snaps) and not share:
            raise RuntimeError("a snapshot's draft rows have no segment to go to")
        if end > upto:
            layers = {i: c.snapshot_state(upto, end) for i, c in enumerate(cache.layers) if c.sequence}
            dstate = dcache.snapshot_state(upto, end) if share else None
            seg = _Segment(upto, end, seg, layers, dstate)
            mx.eval(seg.own_arrays())
        for s in snaps:
            s.seg = seg
            mx.eval(s.own_arrays())
        with self._lock:
            for s in snaps:
                s.used = self._tick()
                # A snapshot of the same tokens replaces an older one that it serves for:
                # one with the same draft state, or none (another draft window's stays).
                self._snaps = [
                    o
                    for o in self._snaps
                    if o.tokens != s.tokens or (o.draft_layout is not None and o.draft_layout != s.draft_layout)
                ]
                self._snaps.append(s)
            self._evict()
        return seg, end

    # --- files ---------------------------------------------------------------------
    def save(self, path, engine=None) -> None:
        """Write every snapshot to a safetensors file, with the fingerprint of
        the model (config, tokenizer and weights; ``engine`` defaults to the
        one the cache was used with) so :meth:`load` refuses it for another
        model, and a checksum of the data. Each cache state is stored as its
        arrays plus its JSON meta (the index). Written atomically."""
        if not isinstance(path, (str, os.PathLike)):
            raise DFlashError(f"save: path must be a file path, got {type(path).__name__}")
        path = Path(path).expanduser()
        writable_file(path, "prefix cache file")
        if engine is not None and (not hasattr(engine, "target") or not hasattr(engine, "tokenizer")):
            raise DFlashError(f"engine must be an Engine (mlx_dflash.load() gives one), got {type(engine).__name__}")
        engine = engine if engine is not None else self._engine
        if engine is None:
            raise DFlashError("save: this prefix cache was never used with an engine; pass engine=")
        self.bind(engine)  # the fingerprint written must be the model's whose snapshots these are
        with self._lock:
            snaps = sorted(self._snaps, key=lambda s: s.used)
        segs, seg_ids = [], {}
        for sn in snaps:
            chain, seg = [], sn.seg
            while seg is not None and id(seg) not in seg_ids:
                chain.append(seg)
                seg = seg.parent
            for seg in reversed(chain):
                seg_ids[id(seg)] = len(segs)
                segs.append(seg)
        arrays = {}

        def put(prefix: str, state: Optional[State]):
            if state is None:
                return None
            for k, a in enumerate(state[0]):
                arrays[f"{prefix}.{k}"] = a
            return [len(state[0]), state[1]]

        index = {"layout": self._layout, "segments": [], "snapshots": []}
        for j, seg in enumerate(segs):
            index["segments"].append(
                {
                    "start": seg.start,
                    "end": seg.end,
                    "parent": seg_ids[id(seg.parent)] if seg.parent is not None else None,
                    "layers": [[i, *put(f"seg{j}.{i}", st)] for i, st in sorted(seg.layers.items())],
                    "draft": put(f"seg{j}.d", seg.draft),
                }
            )
        for j, sn in enumerate(snaps):
            arrays[f"snap{j}.tokens"] = mx.array(list(sn.tokens), dtype=mx.int32)
            index["snapshots"].append(
                {
                    "n": sn.n,
                    "kind": sn.kind,
                    "segment": seg_ids[id(sn.seg)],
                    "layers": [[i, *put(f"snap{j}.{i}", st)] for i, st in sorted(sn.layers.items())],
                    "draft_layout": sn.draft_layout,
                    "draft": put(f"snap{j}.d", sn.draft),
                }
            )
        meta = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "fingerprint": json.dumps(fingerprint(engine), sort_keys=True),
            "index": json.dumps(index),
            "rung_interval": "" if self.rung_interval is None else str(self.rung_interval),
        }
        meta["checksum"] = _checksum(arrays, meta)
        try:
            with written_whole(path, suffix=".safetensors") as tmp:
                mx.save_safetensors(str(tmp), arrays, metadata=meta)
        except (RuntimeError, OSError) as e:  # MLX says RuntimeError for a file it cannot open
            raise DFlashError(f"cannot write the prefix cache to {path}: {e}") from None

    @classmethod
    def load(cls, path, engine, max_bytes: Optional[int] = None) -> "PrefixCache":
        """Read a file written by :meth:`save` for ``engine``'s model. A file
        for another model, a truncated or corrupt one raise
        :class:`~mlx_dflash.errors.DFlashError` (nothing is half-loaded).
        Snapshots beyond ``max_bytes`` are dropped, least recently used first."""
        if not hasattr(engine, "target") or not hasattr(engine, "tokenizer"):  # (api imports this module)
            raise DFlashError(f"engine must be an Engine (mlx_dflash.load() gives one), got {type(engine).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise DFlashError(f"load: path must be a file path, got {type(path).__name__}")
        path = Path(path).expanduser()
        if not path.exists():
            raise DFlashError(f"prompt cache file not found: {path}")
        if not path.is_file():  # a FIFO or a device would block or read as junk
            raise DFlashError(f"prompt cache file {path} is not a regular file")
        try:
            # safetensors whatever the name: MLX would go by the extension
            arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
            mx.eval(list(arrays.values()))
        except Exception as e:
            raise DFlashError(f"cannot read prompt cache file {path}: truncated or corrupt ({e})") from None
        if meta.get("format") != FILE_FORMAT:
            raise DFlashError(f"{path} is not an mlx-dflash prompt cache file")
        if meta.get("version") != FILE_VERSION:
            raise DFlashError(
                f"{path}: unsupported prompt cache version {meta.get('version')!r} "
                f"(this version reads {FILE_VERSION}; delete the file to start a new one)"
            )
        try:
            theirs = json.loads(meta["fingerprint"])
            index = json.loads(meta["index"])
            checksum = meta["checksum"]
            rung = int(meta["rung_interval"]) if meta.get("rung_interval") else None
        except (KeyError, ValueError) as e:
            raise DFlashError(f"cannot read prompt cache file {path}: corrupt metadata ({e})") from None
        if _checksum(arrays, meta) != checksum:
            raise DFlashError(f"prompt cache file {path} is corrupt (checksum mismatch)")
        ours = fingerprint(engine)
        diff = [k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        if diff:
            hint = ""
            if diff in (["target_weights"], ["draft", "target_weights"]):
                hint = (
                    "; a file keeps the weights as loaded, so the same model at another dtype differs too "
                    "(--dtype, or load()'s float32 cast of the embedded pair against its folders given by path)"
                )
            raise DFlashError(
                f"prompt cache file {path} was made for another model "
                f"({', '.join(d.replace('_', ' ') for d in diff)} differ{hint})"
            )

        def get(prefix: str, entry) -> Optional[State]:
            if entry is None:
                return None
            count, state_meta = entry
            return [arrays[f"{prefix}.{k}"] for k in range(count)], state_meta

        try:
            pc = cls(max_bytes=max_bytes, rung_interval=rung)
            pc._layout = index["layout"]
            segs = []
            for j, e in enumerate(index["segments"]):
                parent = segs[e["parent"]] if e["parent"] is not None else None
                if (e["start"] > 0) != (parent is not None) or (parent is not None and parent.end < e["start"]):
                    raise ValueError(f"segment {j} does not extend its parent")
                layers = {int(i): get(f"seg{j}.{i}", [count, m]) for i, count, m in e["layers"]}
                draft = get(f"seg{j}.d", e["draft"])
                for st in list(layers.values()) + ([draft] if draft is not None else []):
                    if piece_rows(st) != e["end"] - e["start"]:
                        raise ValueError(f"segment {j} has the wrong number of rows")
                segs.append(_Segment(e["start"], e["end"], parent, layers, draft))
            for j, e in enumerate(index["snapshots"]):
                toks = arrays[f"snap{j}.tokens"].tolist()
                seg = segs[e["segment"]]
                if len(toks) != e["n"] or seg.end < e["n"]:
                    raise ValueError(f"snapshot {j} is inconsistent")
                seg.pieces(e["n"])
                layers = {int(i): get(f"snap{j}.{i}", [count, m]) for i, count, m in e["layers"]}
                draft = get(f"snap{j}.d", e["draft"])
                if e["draft_layout"] is not None and draft is None and not seg.has_draft_rows(e["n"]):
                    raise ValueError(f"snapshot {j}: draft rows missing")
                pc._snaps.append(
                    _Snapshot(tuple(toks), seg, layers, e["draft_layout"], draft, e["kind"], used=pc._tick())
                )
            _check_layout(pc._snaps, pc._layout, engine.target.make_cache())
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
            raise DFlashError(f"cannot read prompt cache file {path}: corrupt ({e})") from None
        had = len(pc._snaps)
        pc._evict()
        if had and not pc._snaps:  # said now, not at the next generation
            raise DFlashError(
                f"a prefix cache budget of {pc.max_bytes} bytes holds none of the {had} snapshots in {path}; "
                "give a larger budget (--prompt-cache-bytes)"
            )
        pc._engine, pc._target, pc._fingerprint = engine, engine.target, ours
        return pc


def _check_layout(snaps: List[_Snapshot], layout: Optional[List[dict]], probe) -> None:
    """Every snapshot has state for exactly the target's layers (``probe``:
    a cache of the model), each of the file's layout."""
    if not snaps:
        return
    if layout is None or len(layout) != len(probe.layers):
        raise ValueError("layer layout differs from the model's")
    seq = {i for i, c in enumerate(probe.layers) if c.sequence}
    fixed = set(range(len(probe.layers))) - seq
    for s in snaps:
        seg_layers = {i for seg, _, _ in s.seg.pieces(s.n) for i in seg.layers}
        if set(s.layers) != fixed or seg_layers != seq:
            raise ValueError("layer layout differs from the model's")
        states = list(s.layers.items()) + [(i, st) for seg, _, _ in s.seg.pieces(s.n) for i, st in seg.layers.items()]
        for i, (_, m) in states:
            if {k: v for k, v in m.items() if k in layout[i]} != layout[i]:
                raise ValueError(f"layer {i}'s state is not of the file's layout")


def _checksum(arrays: Dict[str, mx.array], meta: Dict[str, str]) -> str:
    """SHA-256 over every metadata entry but the checksum (the index says
    which rows a snapshot restores) and every tensor's name, dtype, shape
    and bytes."""
    import numpy as np

    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for k in sorted(arrays):
        a = arrays[k]
        h.update(f"{k}:{a.dtype}:{a.shape};".encode())
        h.update(np.array(a.reshape(-1).view(mx.uint8), copy=False).tobytes())
    return h.hexdigest()


def tree_digest(params) -> str:
    """Names, shapes, dtypes, the first and last elements and the sum of every
    tensor (reading all the bytes of a large model twice would be slow)."""
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    flat = sorted(tree_flatten(params), key=lambda kv: kv[0])
    sums = []
    for k in range(0, len(flat), 32):  # in batches: bounded temporaries on a large model
        batch = [mx.sum(a.astype(mx.float32)) for _, a in flat[k : k + 32]]
        mx.eval(batch)
        sums += batch
    for (name, a), total in zip(flat, sums):
        v = a.reshape(-1)
        h.update(f"{name}:{a.dtype}:{a.shape}:{total.item()!r};".encode())
        h.update(np.array(mx.concatenate([v[:64], v[-64:]]).astype(mx.float32)).tobytes())
    return h.hexdigest()


def fingerprint(engine) -> Dict[str, Optional[str]]:
    """What identifies the model a snapshot belongs to: target config,
    tokenizer (vocabulary and chat template), target weights, draft."""

    def sha(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()

    tok = engine.tokenizer
    out = {
        "target_config": sha(engine.target.config),
        "tokenizer": sha([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", None)]),
        "target_weights": tree_digest(engine.target.model.parameters()),
        "draft": None,
    }
    if engine.draft is not None:
        import dataclasses

        out["draft"] = sha([dataclasses.asdict(engine.draft.config), tree_digest(engine.draft.parameters())])
    return out


def _generation_tail(tokenizer, template_args: dict) -> Tuple[int, ...]:
    """Token ids the chat template appends for the generation prompt (same
    for any user text), or () when there is no template or no stable tail."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ()
    tails = set()
    for text in ("a", "hello there"):
        msgs = [{"role": "user", "content": text}]
        try:
            without = list(
                tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True, **template_args)
            )
            with_ = list(
                tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **template_args)
            )
        except Exception:  # a template that rejects this conversation
            return ()
        k = 0
        while k < min(len(without), len(with_)) and without[k] == with_[k]:
            k += 1
        tails.add(tuple(with_[k:]))
    return tails.pop() if len(tails) == 1 else ()
