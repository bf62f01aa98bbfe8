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

from .cache import DeltaNetState, KVBuffer
from .errors import DFlashError

DEFAULT_MEMORY_FRACTION = 0.25  # of device (unified) memory
# Rungs fall on multiples of this (the default prefill chunk), so they split
# no prefill forward; bench/results/prefix-cache.md measures the interval.
RUNG_STEP = 512
FILE_FORMAT = "mlx-dflash-prefix-cache"
FILE_VERSION = "2"  # 2: the checksum covers the metadata too


def device_memory() -> int:
    """Bytes of memory the device can use (unified memory on Apple silicon)."""
    try:
        size = mx.device_info().get("memory_size")
        if size:
            return int(size)
    except Exception:  # older mlx or a backend without device_info
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _copy(x: mx.array) -> mx.array:
    """A right-sized copy: a slice (or ``mx.contiguous`` of one) would keep
    its whole source buffer alive."""
    return mx.array(x)


class _Segment:
    """Attention KV rows [start, end) of one conversation; rows before
    ``start`` come from ``parent`` (whose end is >= start). ``dkv``: the
    same rows of an unwindowed draft's context K/V (also position-local),
    or None."""

    __slots__ = ("start", "end", "parent", "kv", "dkv")

    def __init__(
        self,
        start: int,
        end: int,
        parent: Optional["_Segment"],
        kv: Dict[int, Tuple[mx.array, mx.array]],
        dkv: Optional[List[Tuple[mx.array, mx.array]]] = None,
    ):
        self.start, self.end, self.parent, self.kv, self.dkv = start, end, parent, kv, dkv

    def has_draft_rows(self, n: int) -> bool:
        return all(seg.dkv is not None for seg, _, _ in self.pieces(n))

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
class _DraftState:
    keys: Optional[List[mx.array]]  # None: rows [0, length) are in the segment chain (``dkv``)
    values: Optional[List[mx.array]]
    positions: List[int]
    length: int
    window: Optional[Tuple[int, int]]

    def own_arrays(self) -> List[mx.array]:
        return (self.keys + self.values) if self.keys is not None else []


@dataclass
class _Snapshot:
    tokens: Tuple[int, ...]
    seg: Optional[_Segment]
    recurrent: Dict[int, Tuple[mx.array, mx.array]]  # DeltaNet layer -> (conv, ssm)
    draft: Optional[_DraftState]
    kind: str  # "boundary", "rung" or "end"
    used: int = 0

    @property
    def n(self) -> int:
        return len(self.tokens)

    def arrays(self) -> List[mx.array]:
        out = [a for pair in self.recurrent.values() for a in pair]
        if self.draft is not None:
            out += self.draft.own_arrays()
        seg = self.seg
        while seg is not None:
            out += [a for pair in seg.kv.values() for a in pair]
            out += [a for pair in (seg.dkv or []) for a in pair]
            seg = seg.parent
        return out


def _chain_has_draft_rows(base) -> bool:
    seg, upto = base
    return seg is None or upto == 0 or seg.has_draft_rows(upto)


def _draft_state(dcache) -> _DraftState:
    # The held rows are views of buffers grown in steps: copy them, so a
    # snapshot keeps (and counts) only its rows.
    return _DraftState(
        [_copy(k) for k in dcache.keys],
        [_copy(v) for v in dcache.values],
        list(dcache.positions),
        dcache.length,
        dcache.window,
    )


def _recurrent(cache) -> Dict[int, Tuple[mx.array, mx.array]]:
    return {i: (_copy(c.conv), _copy(c.ssm)) for i, c in enumerate(cache.layers) if isinstance(c, DeltaNetState)}


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
        if n <= self.base[1] or self.cache.block:
            return
        dstate = None
        if self.dcache is not None:
            d = self.dcache
            if pending_features is not None and pending_features.shape[0] > 0:
                from .models.draft import DraftCache

                d = DraftCache(list(d.keys), list(d.values), list(d.positions), d.length, d.window)
                self.draft.add_context(pending_features, d)
            if d.length != n:
                return  # draft context out of step: no consistent snapshot here
            dstate = _draft_state(d)
        snap = _Snapshot(tuple(int(t) for t in tokens[:n]), None, _recurrent(self.cache), dstate, "end")
        self.pc._commit(self.cache, self.base, [snap], d if self.dcache is not None else None)


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
    """

    def __init__(self, max_bytes: Optional[int] = None, rung_interval: Optional[int] = None):
        if max_bytes is None:
            max_bytes = int(DEFAULT_MEMORY_FRACTION * device_memory())
        if max_bytes <= 0:
            raise DFlashError(f"prefix cache budget must be positive, got {max_bytes} bytes")
        if rung_interval is not None and rung_interval < 0:
            raise DFlashError(f"rung interval must be >= 0, got {rung_interval}")
        self.max_bytes = int(max_bytes)
        self.rung_interval = rung_interval  # None: chosen per model at first use
        self._snaps: List[_Snapshot] = []
        self._lock = threading.RLock()  # requests from several threads may share one cache
        self._clock = 0
        self._min_bytes: Dict[int, int] = {}
        self._tails: Dict[Tuple[int, str], Tuple[object, Tuple[int, ...]]] = {}
        self._target = None  # snapshots belong to one model
        self._engine = None
        self._fingerprint = None

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
    def lookup(self, prompt: Sequence[int], *, draft_window=None, need_draft: bool = False) -> Optional[_Snapshot]:
        """The longest snapshot whose tokens start ``prompt`` and leave at
        least one token to prefill (with a usable draft state if needed)."""
        prompt = tuple(int(t) for t in prompt)
        best = None
        with self._lock:
            for s in self._snaps:
                n = s.n
                if n >= len(prompt) or (best is not None and n <= best.n):
                    continue
                if need_draft and (s.draft is None or s.draft.window != draft_window):
                    continue
                if s.tokens == prompt[:n]:
                    best = s
        return best

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
    def _check_budget(self, target) -> None:
        if self._target is None:
            self._target = target
        elif self._target is not target:
            raise DFlashError("this prefix cache holds snapshots of another model; use one PrefixCache per model")
        key = id(target)
        if key not in self._min_bytes:
            probe = target.make_cache()
            target.forward([0], probe, logits="none")
            mx.eval(probe.state())
            self._min_bytes[key] = sum(a.nbytes for a in probe.state())
            if self.rung_interval is None:
                row = sum(a.nbytes for c in probe.layers if isinstance(c, KVBuffer) for a in c.state())
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
            if isinstance(c, KVBuffer):
                ks = [seg.kv[i][0][:, :, : hi - lo] for seg, lo, hi in pieces]
                vs = [seg.kv[i][1][:, :, : hi - lo] for seg, lo, hi in pieces]
                cap = (n // c.step + 1) * c.step
                pad = ks[0].shape[:2] + (cap - n,) + ks[0].shape[3:]
                c.keys = mx.concatenate(ks + [mx.zeros(pad, ks[0].dtype)], axis=2)
                pad = vs[0].shape[:2] + (cap - n,) + vs[0].shape[3:]
                c.values = mx.concatenate(vs + [mx.zeros(pad, vs[0].dtype)], axis=2)
                c.offset = n
            else:
                c.conv, c.ssm = snap.recurrent[i]
                c.tape = None
        cache.offset, cache.block = n, 0
        if dcache is not None:
            d = snap.draft
            if d.keys is None:
                dp = snap.seg.pieces(d.length)
                dcache.keys = [
                    mx.concatenate([seg.dkv[i][0][:, :, : hi - lo] for seg, lo, hi in dp], axis=2)
                    for i in range(len(dp[0][0].dkv))
                ]
                dcache.values = [
                    mx.concatenate([seg.dkv[i][1][:, :, : hi - lo] for seg, lo, hi in dp], axis=2)
                    for i in range(len(dp[0][0].dkv))
                ]
            else:
                dcache.keys, dcache.values = list(d.keys), list(d.values)
            dcache.positions, dcache.length = list(d.positions), d.length

    def prefill(
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
        ``dcache``), prefill the rest of ``prompt``, snapshot the stable
        boundary and rungs. The draft consumes the prompt's features here.
        Returns (last-row logits [1, V], a :class:`PrefixRun`)."""
        self._check_budget(target)
        if draft is not None and not hasattr(draft, "add_context"):
            raise DFlashError("this draft cannot be used with a prefix cache (no add_context)")
        prompt = [int(t) for t in prompt]
        P = len(prompt)
        window = dcache.window if dcache is not None else None
        start, base = 0, (None, 0)
        with self._lock:
            snap = self.lookup(prompt, draft_window=window, need_draft=dcache is not None)
            if snap is not None:
                self._restore(snap, cache, dcache)
                snap.used = self._tick()
                start, base = snap.n, (snap.seg, snap.n)
        if stats is not None:
            stats.cached_tokens = start
        boundary = P - 1 if boundary is None else min(boundary, P - 1)
        points = set()
        if self.rung_interval:
            points.update(range(self.rung_interval, boundary, self.rung_interval))
        points.add(boundary)
        points = {p for p in points if start < p < P}
        with self._lock:
            have = {s.tokens for s in self._snaps}
        points = {p for p in points if tuple(prompt[:p]) not in have}
        cuts = sorted(points | set(range(start + chunk_size, P, chunk_size)) | {P})
        # An unwindowed draft's rows go into the KV segment at commit (see
        # _commit): rungs then need no draft arrays of their own.
        shared = dcache is not None and dcache.window is None and _chain_has_draft_rows(base)
        taken = []
        s, logits = start, None
        for e in cuts:
            logits, f = target.forward(
                prompt[s:e], cache, capture=capture if draft is not None else (), logits="last" if e == P else "none"
            )
            if draft is not None:
                draft.add_context(f, dcache)
            new = []
            if e in points:
                dstate = None
                if dcache is not None:
                    dstate = (
                        _DraftState(None, None, list(dcache.positions), dcache.length, None)
                        if shared
                        else _draft_state(dcache)
                    )
                taken.append(
                    _Snapshot(
                        tuple(prompt[:e]), None, _recurrent(cache), dstate, "boundary" if e == boundary else "rung"
                    )
                )
                new = taken[-1].arrays()
            # Bound the lazy graph: materialise each chunk's cache (as Target.prefill).
            extra = (dcache.keys + dcache.values) if dcache is not None else []
            mx.eval(cache.state(), [a for a in extra if a is not None], new, logits if logits is not None else [])
            s = e
        if taken:
            base = self._commit(cache, base, taken, dcache)
        return logits, PrefixRun(self, cache, draft, dcache, base)

    def _commit(self, cache, base, snaps: List[_Snapshot], dcache=None):
        """Store ``snaps`` (all prefixes of the cache's tokens) with one new
        KV segment for rows the chain lacks; an unwindowed draft's context
        rows (``dcache``, holding at least those rows) go into it too, so
        its snapshots share them. Returns the new base."""
        seg, upto = base
        end = max(s.n for s in snaps)
        share = dcache is not None and dcache.window is None and dcache.length >= end and _chain_has_draft_rows(base)
        if end > upto:
            kv = {}
            for i, c in enumerate(cache.layers):
                if isinstance(c, KVBuffer):
                    kv[i] = (_copy(c.keys[:, :, upto:end]), _copy(c.values[:, :, upto:end]))
            dkv = None
            if share:
                dkv = [(_copy(k[:, :, upto:end]), _copy(v[:, :, upto:end])) for k, v in zip(dcache.keys, dcache.values)]
            seg = _Segment(upto, end, seg, kv, dkv)
            mx.eval([a for pair in kv.values() for a in pair], [a for pair in (dkv or []) for a in pair])
        for s in snaps:
            s.seg = seg
            if share and s.draft is not None and s.draft.window is None:
                s.draft.keys = s.draft.values = None
            mx.eval([a for pair in s.recurrent.values() for a in pair], s.draft.own_arrays() if s.draft else [])
        with self._lock:
            for s in snaps:
                s.used = self._tick()
                # A snapshot of the same tokens replaces the older one.
                self._snaps = [o for o in self._snaps if o.tokens != s.tokens]
                self._snaps.append(s)
            self._evict()
        return seg, end

    # --- files ---------------------------------------------------------------------
    def save(self, path, engine=None) -> None:
        """Write every snapshot to a safetensors file, with the fingerprint of
        the model (config, tokenizer and weights; ``engine`` defaults to the
        one the cache was used with) so :meth:`load` refuses it for another
        model, and a checksum of the data. Written atomically."""
        path = Path(path)
        engine = engine if engine is not None else self._engine
        if engine is None:
            raise DFlashError("save: this prefix cache was never used with an engine; pass engine=")
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
        arrays, index = {}, {"segments": [], "snapshots": []}
        for j, seg in enumerate(segs):
            index["segments"].append(
                {
                    "start": seg.start,
                    "end": seg.end,
                    "parent": seg_ids[id(seg.parent)] if seg.parent is not None else None,
                    "layers": sorted(seg.kv),
                    "draft_layers": len(seg.dkv) if seg.dkv is not None else None,
                }
            )
            for i, (k, v) in seg.kv.items():
                arrays[f"seg{j}.k{i}"], arrays[f"seg{j}.v{i}"] = k, v
            for i, (k, v) in enumerate(seg.dkv or []):
                arrays[f"seg{j}.dk{i}"], arrays[f"seg{j}.dv{i}"] = k, v
        for j, sn in enumerate(snaps):
            entry = {
                "n": sn.n,
                "kind": sn.kind,
                "segment": seg_ids[id(sn.seg)],
                "layers": sorted(sn.recurrent),
                "draft": None,
            }
            arrays[f"snap{j}.tokens"] = mx.array(list(sn.tokens), dtype=mx.int32)
            for i, (conv, ssm) in sn.recurrent.items():
                arrays[f"snap{j}.conv{i}"], arrays[f"snap{j}.ssm{i}"] = conv, ssm
            if sn.draft is not None:
                d = sn.draft
                entry["draft"] = {
                    "length": d.length,
                    "window": list(d.window) if d.window else None,
                    "layers": len(d.keys) if d.keys is not None else None,
                }
                arrays[f"snap{j}.dpos"] = mx.array(d.positions, dtype=mx.int32)
                for i, (k, v) in enumerate(zip(d.keys or [], d.values or [])):
                    arrays[f"snap{j}.dk{i}"], arrays[f"snap{j}.dv{i}"] = k, v
            index["snapshots"].append(entry)
        meta = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "fingerprint": json.dumps(fingerprint(engine), sort_keys=True),
            "index": json.dumps(index),
            "rung_interval": "" if self.rung_interval is None else str(self.rung_interval),
        }
        meta["checksum"] = _checksum(arrays, meta)
        tmp = path.with_name(path.name + ".tmp.safetensors")
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path, engine, max_bytes: Optional[int] = None) -> "PrefixCache":
        """Read a file written by :meth:`save` for ``engine``'s model. A file
        for another model, a truncated or corrupt one raise
        :class:`~mlx_dflash.errors.DFlashError` (nothing is half-loaded).
        Snapshots beyond ``max_bytes`` are dropped, least recently used first."""
        path = Path(path)
        if not path.is_file():
            raise DFlashError(f"prompt cache file not found: {path}")
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
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
            raise DFlashError(
                f"prompt cache file {path} was made for another model "
                f"({', '.join(d.replace('_', ' ') for d in diff)} differ)"
            )
        try:
            pc = cls(max_bytes=max_bytes, rung_interval=rung)
            segs = []
            for j, e in enumerate(index["segments"]):
                parent = segs[e["parent"]] if e["parent"] is not None else None
                if (e["start"] > 0) != (parent is not None) or (parent is not None and parent.end < e["start"]):
                    raise ValueError(f"segment {j} does not extend its parent")
                kv = {int(i): (arrays[f"seg{j}.k{i}"], arrays[f"seg{j}.v{i}"]) for i in e["layers"]}
                dkv = None
                if e.get("draft_layers") is not None:
                    dkv = [(arrays[f"seg{j}.dk{i}"], arrays[f"seg{j}.dv{i}"]) for i in range(e["draft_layers"])]
                rows = [a.shape[2] for pair in list(kv.values()) + (dkv or []) for a in pair]
                if any(r != e["end"] - e["start"] for r in rows):
                    raise ValueError(f"segment {j} has the wrong number of rows")
                segs.append(_Segment(e["start"], e["end"], parent, kv, dkv))
            for j, e in enumerate(index["snapshots"]):
                toks = arrays[f"snap{j}.tokens"].tolist()
                seg = segs[e["segment"]]
                if len(toks) != e["n"] or seg.end < e["n"]:
                    raise ValueError(f"snapshot {j} is inconsistent")
                seg.pieces(e["n"])
                rec = {int(i): (arrays[f"snap{j}.conv{i}"], arrays[f"snap{j}.ssm{i}"]) for i in e["layers"]}
                d = None
                if e["draft"] is not None:
                    de = e["draft"]
                    shared = de["layers"] is None
                    d = _DraftState(
                        None if shared else [arrays[f"snap{j}.dk{i}"] for i in range(de["layers"])],
                        None if shared else [arrays[f"snap{j}.dv{i}"] for i in range(de["layers"])],
                        arrays[f"snap{j}.dpos"].tolist(),
                        de["length"],
                        tuple(de["window"]) if de["window"] else None,
                    )
                    if shared and (de["length"] > seg.end or not seg.has_draft_rows(de["length"])):
                        raise ValueError(f"snapshot {j}: draft rows missing")
                pc._snaps.append(_Snapshot(tuple(toks), seg, rec, d, e["kind"], used=pc._tick()))
            _check_layout(pc._snaps, engine.target)
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
            raise DFlashError(f"cannot read prompt cache file {path}: corrupt ({e})") from None
        pc._evict()
        pc._engine, pc._target, pc._fingerprint = engine, engine.target, ours
        return pc


def _check_layout(snaps: List[_Snapshot], target) -> None:
    """Every snapshot has state for exactly the target's layers."""
    kv_layers = {i for i, lin in enumerate(target.is_linear) if not lin}
    lin_layers = {i for i, lin in enumerate(target.is_linear) if lin}
    for s in snaps:
        if set(s.recurrent) != lin_layers or set(s.seg.kv) != kv_layers:
            raise ValueError("layer layout differs from the model's")


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


def _tree_digest(params) -> str:
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
        "target_weights": _tree_digest(engine.target.model.parameters()),
        "draft": None,
    }
    if engine.draft is not None:
        import dataclasses

        out["draft"] = sha([dataclasses.asdict(engine.draft.config), _tree_digest(engine.draft.parameters())])
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
