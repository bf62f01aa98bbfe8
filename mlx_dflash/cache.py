"""Per-layer caches of the target (attention KV, float or quantized; DeltaNet
state) and what verify records for rollback.

Every per-layer cache, the draft's context cache included
(:class:`~mlx_dflash.models.draft.DraftCache`), follows one protocol
(:class:`LayerCache`), which is all the prefix store (``prefix.py``) knows
of them. Arrays keep a leading batch dimension [B, ...]; B is 1 in a
cache. Several requests decode together as a :class:`SlotBatch` of caches.
"""

import math
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .errors import DFlashError
from .kernels.conv import conv_state_rollback, conv_state_rollback_slots
from .kernels.fused_exp import STRETCH_ROWS, attention, attention_stretches, row_exact
from .kernels.gated_delta import gated_delta_rollback, gated_delta_rollback_layers, gated_delta_rollback_slots

KV_BITS = (4, 8)
KV_GROUP_SIZE = 64  # mlx-lm's default kv_group_size
# Query rows (verify and prefill blocks) from which a CPU attends over the
# dequantized quantized-KV rows: below, dequantizing (about two single-row
# quantized attentions) costs more than the per-row quantized matmuls
# (measured side by side at 256-8192 keys; at 2 and 3 rows it was close).
DEQUANT_MIN_ROWS = 4

# An opaque piece of cache state: arrays, and a JSON-able dict saying what
# they hold (the cache's ``layout()`` plus counts such as ``rows``).
State = Tuple[List[mx.array], dict]


class LayerCache:
    """The operations every per-layer cache offers.

    - ``sequence``: True when the cache holds one row per position, rows
      [0, rows) along axis 2 of [B, H, rows, ...] arrays (attention KV, an
      unwindowed draft context). Rows [a, b) of such a cache depend only on
      the tokens before b, so a prefix store can share them between
      snapshots. False: a fixed-size state, exact only where it was taken.
    - appending: a sequence cache takes new rows after those it holds (KV:
      ``append(k, v)``; the draft's context: ``write(layer, start, k, v)``);
      a fixed-size state is replaced by the forward that advances it.
    - ``rows``: positions held (sequence caches).
    - ``truncate(n)``: keep the first ``n`` rows (sequence caches).
    - ``rollback(start, n_keep, path)``: after a recorded block that began at
      row ``start``, keep its first ``n_keep`` rows, or the block rows on
      ``path`` (tree verify, root first). Where it applies.
    - ``snapshot_state(a, b)``: an opaque :data:`State` (right-sized copies:
      nothing later written into the cache reaches it). Sequence caches give
      rows [a, b); fixed-size ones their whole state.
    - ``restore_state(pieces)``: replace the contents by the states given
      (sequence caches: consecutive pieces from row 0; fixed-size: one).
      A piece of another ``layout()`` is refused.
    - ``layout()``: JSON-able description of the stored format (not of the
      contents): two caches of equal layout exchange states.
    - ``state()``: the arrays held (to evaluate); ``nbytes()`` their bytes.
    """

    sequence = False

    def layout(self) -> dict:
        raise NotImplementedError

    def state(self) -> List[mx.array]:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of what is held (not spare capacity)."""
        return sum(a.nbytes for a in self.state())

    def _check(self, pieces: Sequence[State]) -> None:
        want = self.layout()
        for _, meta in pieces:
            got = {k: v for k, v in meta.items() if k in want}
            if got != want:
                raise DFlashError(f"cannot restore a {describe(meta)} state into a {describe(want)} cache")


def describe(layout: dict) -> str:
    """A layout in words, for error messages."""
    kind = layout.get("type", "?")
    if kind == "kv":
        return f"{layout['bits']}-bit KV" if layout.get("bits") else "full-precision KV"
    return kind


def first_rows(state: State, n: int) -> State:
    """The first ``n`` rows of a sequence cache's state piece."""
    arrays, meta = state
    return [a[:, :, :n] for a in arrays], {**meta, "rows": n}


def piece_rows(state: State) -> int:
    """Rows of a sequence cache's state piece (its meta and arrays agree)."""
    arrays, meta = state
    rows = meta["rows"]
    if any(a.ndim < 3 or a.shape[2] != rows for a in arrays):
        raise ValueError(f"a state piece of {rows} rows holds arrays of other row counts")
    return rows


def _copy(x: mx.array) -> mx.array:
    """A right-sized copy: a slice (or ``mx.contiguous`` of one) would keep
    its whole source buffer alive."""
    return mx.array(x)


class Rows:
    """A group of arrays [B, H, capacity, ...] grown together in steps of
    ``step`` rows along axis 2. Which rows are held is the owner's business;
    rows past them are scratch, overwritten by the next write."""

    step = 256

    def __init__(self, n: int):
        self.bufs: List[Optional[mx.array]] = [None] * n

    def write(self, start: int, new: Sequence[mx.array]) -> List[mx.array]:
        """Write ``new`` (one array per buffer, same row count) at row
        ``start``; returns views of rows [0, start + T)."""
        end = start + new[0].shape[2]
        first = self.bufs[0]
        if first is None or end > first.shape[2]:
            cap = ((end + self.step - 1) // self.step) * self.step
            grown = []
            for old, x in zip(self.bufs, new):
                buf = mx.zeros(x.shape[:2] + (cap,) + x.shape[3:], x.dtype)
                if old is not None and start > 0:
                    buf[:, :, :start] = old[:, :, :start]
                grown.append(buf)
            self.bufs = grown
        rows = (slice(None), slice(None), slice(start, end))
        for buf, x in zip(self.bufs, new):
            buf[rows] = x
        held = (slice(None), slice(None), slice(0, end))
        return [b[held] for b in self.bufs]

    def held(self, n: int) -> List[mx.array]:
        """Views of rows [0, n) (empty when nothing was written)."""
        return [] if self.bufs[0] is None else [b[:, :, :n] for b in self.bufs]

    def gather(self, start: int, idx: Sequence[int]) -> None:
        """Rows ``idx[i]`` move to ``start + i``."""
        sel = mx.array(list(idx), dtype=mx.int32)  # an empty list would be float32
        for b in self.bufs:
            if b is not None:
                b[:, :, start : start + len(idx)] = b[:, :, sel]

    def copy(self, a: int, b: int) -> List[mx.array]:
        return [_copy(x[:, :, a:b]) for x in self.bufs]

    def load(self, pieces: Sequence[Sequence[mx.array]]) -> int:
        """Buffers holding the pieces' rows one after another (room for more
        after them); returns the row count."""
        n = sum(p[0].shape[2] for p in pieces)
        cap = (n // self.step + 1) * self.step
        out = []
        for j in range(len(self.bufs)):
            parts = [p[j] for p in pieces]
            x = parts[0]
            pad = mx.zeros(x.shape[:2] + (cap - n,) + x.shape[3:], x.dtype)
            out.append(mx.concatenate(parts + [pad], axis=2))
        self.bufs = out
        return n


class KVBuffer(LayerCache):
    """Attention keys/values [B, Hkv, capacity, D]; rows >= offset are garbage.

    Truncation (rollback) only moves ``offset``: the rejected rows are
    overwritten by the next append.
    """

    sequence = True

    def __init__(self):
        self.buf = Rows(2)
        self.offset = 0

    @property
    def rows(self) -> int:
        return self.offset

    @property
    def keys(self) -> Optional[mx.array]:
        return self.buf.bufs[0]

    @property
    def values(self) -> Optional[mx.array]:
        return self.buf.bufs[1]

    def layout(self) -> dict:
        return {"type": "kv", "bits": None}

    def append(self, k: mx.array, v: mx.array):
        """Append rows k, v [B, H, T, D]; returns the keys and values of all rows held."""
        keys, values = self.buf.write(self.offset, (k, v))
        self.offset += k.shape[2]
        return keys, values

    def compact(self, start: int, rows) -> None:
        """Move block rows ``start + rows[i]`` to ``start + i`` (an accepted tree path)."""
        self.buf.gather(start, [start + r for r in rows])

    def truncate(self, length: int) -> None:
        self.offset = min(self.offset, length)

    def rollback(self, start: int, n_keep: int, path=None) -> None:
        if path is not None:
            self.compact(start, path)
        self.truncate(start + n_keep)

    def snapshot(self):
        return self.offset

    def restore(self, snap) -> None:
        self.truncate(snap)

    def state(self) -> List[mx.array]:
        return self.buf.held(self.offset)

    def snapshot_state(self, a: int = 0, b: Optional[int] = None) -> State:
        b = self.offset if b is None else b
        if not 0 <= a <= b <= self.offset:
            raise ValueError(f"rows [{a}, {b}) outside the {self.offset} held")
        return self.buf.copy(a, b), {**self.layout(), "rows": b - a}

    def restore_state(self, pieces: Sequence[State]) -> None:
        self._check(pieces)
        self.offset = self.buf.load([arrays for arrays, _ in pieces])

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask, verify: bool = False) -> mx.array:
        """Append the block's k, v and attend q [B, H, T, D] over everything
        held (``verify``: a verify block's rows, fused_exp.attention)."""
        keys, values = self.append(k, v)
        return attention(q, keys, values, scale, mask, decode_block=verify)


def check_kv_bits(bits: Optional[int], head_dim: Optional[int] = None) -> None:
    if bits is None:
        return
    if bits not in KV_BITS:
        raise DFlashError(f"kv_bits (--kv-bits) must be 4 or 8 (or omitted for full precision), got {bits}")
    if head_dim is not None:
        if head_dim % 32:
            raise DFlashError(f"--kv-bits needs an attention head dim divisible by 32; this model's is {head_dim}")
        m = head_dim
        while m % 2 == 0:
            m //= 2
        if m not in (1, 3, 5, 7):  # what mx.hadamard_transform supports: m * 2^k, m in 1, 12, 20, 28
            raise DFlashError(f"--kv-bits: no Walsh-Hadamard transform of size {head_dim}")


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
    """mx.dequantize of affine-quantized rows [..., D * bits / 32] (the same
    values, bit for bit), by shifts, masks and one multiply-add per value:
    on a CPU 1.1-3.3x faster than mx.dequantize at 1k-32k cached rows (1.5x
    at 32k; bench/results/kv-attention.md), which a long context's verify
    pays per attention layer."""
    per = 32 // bits
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    q = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [..., D / per, per]
    q = q.reshape(*scales.shape, group_size).astype(scales.dtype)
    return (q * scales[..., None] + biases[..., None]).reshape(*packed.shape[:-1], -1)


class QuantizedKVBuffer(KVBuffer):
    """Attention K/V stored quantized (``bits`` 8 or 4, affine groups along
    the head dim, as mlx-lm's quantized KV cache), K rotated by an orthonormal
    Walsh-Hadamard transform first: the rotation spreads outlier channels
    over the group so they quantize with less error, and since q.k = (Hq).(Hk)
    the queries are rotated alike and attention is unchanged in exact
    arithmetic. Rows are quantized one by one when appended, so truncation,
    tree compaction and snapshots move quantized rows exactly as
    :class:`KVBuffer` moves float ones (six arrays instead of two: packed
    keys, scales, biases, then the same for values).
    """

    def __init__(self, bits: int = 8, group_size: int = KV_GROUP_SIZE):
        check_kv_bits(bits)
        self.bits = bits
        self.group_size = group_size
        self.buf = Rows(6)
        self.offset = 0

    @property
    def keys(self) -> List[Optional[mx.array]]:
        return self.buf.bufs[:3]  # packed, scales, biases

    @property
    def values(self) -> List[Optional[mx.array]]:
        return self.buf.bufs[3:]

    def layout(self) -> dict:
        return {"type": "kv", "bits": self.bits, "group_size": self.group_size}

    def _group(self, D: int) -> int:
        return self.group_size if D % self.group_size == 0 else 32

    def _rotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x, scale=1.0 / math.sqrt(x.shape[-1]))

    def append(self, k: mx.array, v: mx.array):
        """Rotate and quantize k, v [B, H, T, D] and append them; returns the
        (packed, scales, biases) triples of all rows held."""
        gs = self._group(k.shape[-1])
        qk = list(mx.quantize(self._rotate(k), group_size=gs, bits=self.bits))
        qv = list(mx.quantize(v, group_size=gs, bits=self.bits))
        held = self.buf.write(self.offset, qk + qv)
        self.offset += k.shape[2]
        return held[:3], held[3:]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask, verify: bool = False) -> mx.array:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        keys, values = self.append(k, v)
        gs = self._group(q.shape[-1])
        if q.shape[2] >= DEQUANT_MIN_ROWS and mx.default_device() != mx.gpu and not row_exact(q.dtype):
            # A CPU's quantized matmul dequantizes the keys once per query row:
            # a 16-row verify cost 10x a plain step's attention at 32k keys
            # (docs/kv-quant.md). Dequantized once, the rows share one float
            # matmul; the float copy lives for this call only (a verify's, a
            # stretch at a time). Half-precision rows keep the quantized path,
            # which verify must match bit for bit.
            q = self._rotate(q)
            L = keys[0].shape[2]
            if verify and L > STRETCH_ROWS:

                def floats(rows, a):
                    return dequantize(*(x[:, :, a : a + STRETCH_ROWS] for x in rows), group_size=gs, bits=self.bits)

                parts = [(floats(keys, a), floats(values, a)) for a in range(0, L, STRETCH_ROWS)]
                return attention_stretches(q, parts, scale, mask)
            kf = dequantize(*keys, group_size=gs, bits=self.bits)
            vf = dequantize(*values, group_size=gs, bits=self.bits)
            return attention(q, kf, vf, scale, mask, decode_block=verify)
        return quantized_scaled_dot_product_attention(
            self._rotate(q), keys, values, scale=scale, mask=mask, group_size=gs, bits=self.bits
        )

    def dequantized(self) -> Tuple[mx.array, mx.array]:
        """K (rotated back) and V of the rows held, as floats (diagnostics, tests)."""
        gs = self._group(self._head_dim())
        held = self.state()
        k = mx.dequantize(*held[:3], group_size=gs, bits=self.bits)
        return self._rotate(k), mx.dequantize(*held[3:], group_size=gs, bits=self.bits)

    def _head_dim(self) -> int:
        return self.keys[0].shape[-1] * 32 // self.bits


class DeltaNetState(LayerCache):
    """Gated DeltaNet layer state (fixed size: ``sequence`` is False).

    conv: [B, K-1, C] the last K-1 pre-conv qkv rows (input dtype).
    ssm:  [B, Hv, Dv, Dk] recurrent state, fp32.
    tape: set by a recording forward: (ssm before the block, k, g, delta,
          conv_in) -- enough to restore both states after any prefix.
    """

    def __init__(self):
        self.conv: Optional[mx.array] = None
        self.ssm: Optional[mx.array] = None
        self.tape = None

    def layout(self) -> dict:
        return {"type": "deltanet"}

    def rollback(self, start: int, n_keep: int, path=None) -> None:
        """Keep the first ``n_keep`` tokens of the recorded block, or (tree
        verify) the tokens on ``path`` (block rows, root first; n_keep ==
        len(path)). ``start`` is not needed: the tape holds the block."""
        if path is None:
            DeltaNetState.rollback_chain([self], n_keep)
            return
        ssm0, k, g, delta, conv_in, K = self.tape
        self.tape = None
        P = mx.array(path)
        k, g, delta = k[:, P], g[:, P], delta[:, P]
        conv_in = mx.concatenate([conv_in[:, : K - 1], conv_in[:, K - 1 + P]], axis=1)
        self.ssm = gated_delta_rollback(ssm0, k, g, delta, n_keep, stepwise=row_exact(k.dtype))
        self.conv = conv_state_rollback(conv_in, n_keep, K)

    @staticmethod
    def rollback_chain(states: List["DeltaNetState"], n: int) -> None:
        """:meth:`rollback` of several layers' chain blocks to the same ``n``,
        their recurrent states in one batched call."""
        if not states:
            return
        tapes = [st.tape for st in states]
        for st in states:
            st.tape = None
        if n == tapes[0][3].shape[1]:
            return  # everything accepted
        # A half-precision verify ran stepwise (fused_exp.row_exact): replay its steps.
        ssms = gated_delta_rollback_layers([t[:4] for t in tapes], n, stepwise=row_exact(tapes[0][1].dtype))
        for st, tape, ssm in zip(states, tapes, ssms):
            st.ssm = ssm
            st.conv = conv_state_rollback(tape[4], n, tape[5])

    def snapshot(self):
        return (self.conv, self.ssm, self.tape)  # arrays are immutable: references suffice

    def restore(self, snap) -> None:
        self.conv, self.ssm, self.tape = snap

    def state(self) -> List[mx.array]:
        return [x for x in (self.conv, self.ssm) if x is not None]

    def snapshot_state(self, a: int = 0, b: Optional[int] = None) -> State:
        if self.conv is None or self.ssm is None:
            raise ValueError("no DeltaNet state to snapshot (nothing was run)")
        return [_copy(self.conv), _copy(self.ssm)], self.layout()

    def restore_state(self, pieces: Sequence[State]) -> None:
        self._check(pieces)
        if len(pieces) != 1 or len(pieces[0][0]) != 2:
            raise ValueError("a DeltaNet state is one piece of two arrays (conv, ssm)")
        self.conv, self.ssm = pieces[0][0]
        self.tape = None


class TargetCache:
    """Per-layer caches of the target plus the number of committed positions."""

    def __init__(self, is_linear: List[bool], kv_bits: Optional[int] = None, kv_group_size: int = KV_GROUP_SIZE):
        check_kv_bits(kv_bits)
        self.is_linear = list(is_linear)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        attn = (lambda: QuantizedKVBuffer(kv_bits, kv_group_size)) if kv_bits else KVBuffer
        self.layers: List[LayerCache] = [DeltaNetState() if lin else attn() for lin in is_linear]
        self.offset = 0  # positions held (including an unrolled-back block)
        self.block = 0  # tokens of the last recorded block, 0 if none pending

    def empty(self) -> "TargetCache":
        """A new, empty cache of the same layers and format."""
        return TargetCache(self.is_linear, self.kv_bits, self.kv_group_size)

    def rollback(self, n_keep: int, path=None) -> None:
        """After a recorded forward of ``self.block`` tokens, keep ``n_keep``:
        the first ones (chain), or the block rows on ``path`` (tree verify,
        root first; their KV is compacted to contiguous positions)."""
        if self.block == 0:
            raise RuntimeError("rollback without a recorded block")
        if not 1 <= n_keep <= self.block:
            raise ValueError(f"n_keep={n_keep} outside 1..{self.block}")
        if path is not None and len(path) != n_keep:
            raise ValueError(f"path of {len(path)} rows for n_keep={n_keep}")
        start = self.offset - self.block
        chain = []
        for c in self.layers:
            if path is None and isinstance(c, DeltaNetState):
                chain.append(c)  # rolled back together below
            else:
                c.rollback(start, n_keep, path)
        DeltaNetState.rollback_chain(chain, n_keep)
        self.offset = start + n_keep
        self.block = 0

    def restored(self, n: int) -> None:
        """Every layer was given the state of the first ``n`` positions
        (``restore_state``): the cache now holds those, no block pending."""
        self.offset, self.block = n, 0

    def snapshot(self):
        """A cheap handle on the current state (references, no copies)."""
        return (self.offset, self.block, [c.snapshot() for c in self.layers])

    def restore(self, snap) -> None:
        """Return to a :meth:`snapshot` taken on this cache (later appends undone)."""
        self.offset, self.block, layers = snap
        for c, s in zip(self.layers, layers):
            c.restore(s)

    def state(self) -> List[mx.array]:
        out = []
        for c in self.layers:
            out.extend(c.state())
        return out

    def kv_nbytes(self) -> int:
        """Bytes of attention K/V held (the part that grows with the context)."""
        return sum(c.nbytes() for c in self.layers if c.sequence)


class SlotBatch:
    """Requests decoding together, one :class:`TargetCache` (B = 1) per slot.

    ``Target.forward_slots`` runs a block of the same width for every slot;
    each slot's KV stays in its own buffers (attention runs per slot, as a
    solo forward does), while the DeltaNet layers run with the slots stacked
    along the batch and leave their tapes here, slot dimension first, for
    :meth:`rollback` with a kept count per slot. Each slot's own
    ``DeltaNetState`` gets its rows of the stacked result (and of the tape,
    so a slot's own ``TargetCache.rollback`` works too). A slot's arrays are
    never written in place, so nothing done to one slot reaches another.
    """

    def __init__(self, caches: Sequence[TargetCache]):
        self.caches = list(caches)
        self.tapes = {}  # layer -> (ssm0, k, g, delta, conv_in, K, ssm after the block), slots stacked
        self.block = 0  # width of the last recorded block, 0 if none pending

    def __len__(self) -> int:
        return len(self.caches)

    def recorded(self, block: int, tapes: dict) -> None:
        self.block, self.tapes = block, tapes
        for c in self.caches:
            c.block = block

    def rollback(self, ns: Sequence[int], paths: Optional[Sequence[Sequence[int]]] = None) -> None:
        """After a recorded :meth:`Target.forward_slots`, slot b keeps the
        first ``ns[b]`` tokens of its block (chain), or with ``paths`` (a
        tree per slot) the block rows on ``paths[b]`` (root first, ``ns[b]``
        of them; its KV compacted), each as its solo rollback."""
        ns = [int(n) for n in ns]
        if self.block == 0:
            raise RuntimeError("rollback without a recorded block")
        if len(ns) != len(self.caches):
            raise ValueError(f"{len(ns)} kept counts for {len(self.caches)} slots")
        if not all(1 <= n <= self.block for n in ns):
            raise ValueError(f"kept counts {ns} outside 1..{self.block}")
        if paths is not None:
            paths = [[int(t) for t in p] for p in paths]
            if len(paths) != len(ns) or any(len(p) != n for p, n in zip(paths, ns)):
                raise ValueError(f"paths of {[len(p) for p in paths]} rows for kept counts {ns}")
        starts = [c.offset - self.block for c in self.caches]
        for i in range(len(self.caches[0].layers)):
            tape = self.tapes.get(i)
            if tape is None:  # attention: each slot truncates (a tree: compacts) its own KV
                for b, (c, start, n) in enumerate(zip(self.caches, starts, ns)):
                    c.layers[i].rollback(start, n, None if paths is None else paths[b])
                continue
            ssm0, k, g, delta, conv_in, K, final = tape
            ssm = gated_delta_rollback_slots(ssm0, k, g, delta, final, ns, stepwise=row_exact(k.dtype), paths=paths)
            if paths is None:
                conv = conv_state_rollback_slots(conv_in, ns, K)
            else:  # the last K-1 rows of the conv state followed by the path's rows
                idx = [(list(range(K - 1)) + [K - 1 + t for t in p])[-(K - 1) :] for p in paths]
                conv = mx.take_along_axis(conv_in, mx.array(idx, dtype=mx.int32)[:, :, None], axis=1)
            for b, c in enumerate(self.caches):
                st = c.layers[i]
                st.ssm, st.conv, st.tape = ssm[b : b + 1], conv[b : b + 1], None
        for c, start, n in zip(self.caches, starts, ns):
            c.offset, c.block = start + n, 0
        self.block, self.tapes = 0, {}

    def state(self) -> List[mx.array]:
        return [a for c in self.caches for a in c.state()]
