"""Target cache: attention KV, DeltaNet state, and what verify records for rollback.

Batch size is 1 throughout (one generation per cache).
"""

import math
from typing import List, Optional, Tuple

import mlx.core as mx

from .errors import DFlashError
from .kernels.conv import conv_state_rollback
from .kernels.fused_exp import attention, row_exact
from .kernels.gated_delta import gated_delta_rollback, gated_delta_rollback_layers

KV_BITS = (4, 8)
KV_GROUP_SIZE = 64  # mlx-lm's default kv_group_size


class KVBuffer:
    """Attention keys/values [1, Hkv, capacity, D]; positions >= offset are garbage.

    Truncation (rollback) only moves ``offset``: the rejected rows are
    overwritten by the next append.
    """

    step = 256

    def __init__(self):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0

    def append(self, k: mx.array, v: mx.array) -> Tuple[mx.array, mx.array]:
        T = k.shape[2]
        end = self.offset + T
        if self.keys is None or end > self.keys.shape[2]:
            cap = ((end + self.step - 1) // self.step) * self.step
            nk = mx.zeros((k.shape[0], k.shape[1], cap, k.shape[3]), k.dtype)
            nv = mx.zeros((v.shape[0], v.shape[1], cap, v.shape[3]), v.dtype)
            if self.keys is not None and self.offset > 0:
                nk[:, :, : self.offset] = self.keys[:, :, : self.offset]
                nv[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = nk, nv
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def compact(self, start: int, rows) -> None:
        """Move block rows ``start + rows[i]`` to ``start + i`` (an accepted tree path)."""
        idx = mx.array([start + r for r in rows])
        n = len(rows)
        self.keys[:, :, start : start + n] = self.keys[:, :, idx]
        self.values[:, :, start : start + n] = self.values[:, :, idx]

    def truncate(self, length: int) -> None:
        self.offset = min(self.offset, length)

    def snapshot(self):
        return self.offset

    def restore(self, snap) -> None:
        self.truncate(snap)

    def state(self) -> List[mx.array]:
        if self.keys is None:
            return []
        return [self.keys[:, :, : self.offset], self.values[:, :, : self.offset]]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask, verify: bool = False) -> mx.array:
        """Append the block's k, v and attend q [1, H, T, D] over everything
        held (``verify``: a verify block's rows, fused_exp.attention)."""
        keys, values = self.append(k, v)
        return attention(q, keys, values, scale, mask, decode_block=verify)

    def nbytes(self) -> int:
        """Bytes of the rows held (not the spare capacity)."""
        return sum(a.nbytes for a in self.state())


def _grow(parts: List[Optional[mx.array]], new: List[mx.array], offset: int, step: int) -> List[mx.array]:
    """Buffers [1, H, cap, *] holding ``offset`` rows, grown in ``step``s to fit ``new``."""
    end = offset + new[0].shape[2]
    if parts[0] is not None and end <= parts[0].shape[2]:
        return parts
    cap = ((end + step - 1) // step) * step
    out = []
    for old, n in zip(parts, new):
        buf = mx.zeros(n.shape[:2] + (cap,) + n.shape[3:], n.dtype)
        if old is not None and offset > 0:
            buf[:, :, :offset] = old[:, :, :offset]
        out.append(buf)
    return out


def check_kv_bits(bits: Optional[int], head_dim: Optional[int] = None) -> None:
    if bits is None:
        return
    if bits not in KV_BITS:
        raise DFlashError(f"--kv-bits must be 4 or 8 (or omitted for full precision), got {bits}")
    if head_dim is not None:
        if head_dim % 32:
            raise DFlashError(f"--kv-bits needs an attention head dim divisible by 32; this model's is {head_dim}")
        m = head_dim
        while m % 2 == 0:
            m //= 2
        if m not in (1, 3, 5, 7):  # what mx.hadamard_transform supports: m * 2^k, m in 1, 12, 20, 28
            raise DFlashError(f"--kv-bits: no Walsh-Hadamard transform of size {head_dim}")


class QuantizedKVBuffer:
    """Attention K/V stored quantized (``bits`` 8 or 4, affine groups along
    the head dim, as mlx-lm's quantized KV cache), K rotated by an orthonormal
    Walsh-Hadamard transform first: the rotation spreads outlier channels
    over the group so they quantize with less error, and since q.k = (Hq).(Hk)
    the queries are rotated alike and attention is unchanged in exact
    arithmetic. Rows are quantized one by one when appended, so truncation
    and tree compaction move quantized rows exactly as :class:`KVBuffer`
    moves float ones.
    """

    step = 256

    def __init__(self, bits: int = 8, group_size: int = KV_GROUP_SIZE):
        check_kv_bits(bits)
        self.bits = bits
        self.group_size = group_size
        self.keys: List[Optional[mx.array]] = [None, None, None]  # packed, scales, biases
        self.values: List[Optional[mx.array]] = [None, None, None]
        self.offset = 0

    def _group(self, D: int) -> int:
        return self.group_size if D % self.group_size == 0 else 32

    def _rotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x, scale=1.0 / math.sqrt(x.shape[-1]))

    def append(self, k: mx.array, v: mx.array):
        """Rotate and quantize k, v [1, H, T, D]; returns the (packed, scales,
        biases) triples of all rows held."""
        gs = self._group(k.shape[-1])
        qk = list(mx.quantize(self._rotate(k), group_size=gs, bits=self.bits))
        qv = list(mx.quantize(v, group_size=gs, bits=self.bits))
        end = self.offset + k.shape[2]
        self.keys = _grow(self.keys, qk, self.offset, self.step)
        self.values = _grow(self.values, qv, self.offset, self.step)
        for buf, new in zip(self.keys + self.values, qk + qv):
            buf[:, :, self.offset : end] = new
        self.offset = end
        return [a[:, :, :end] for a in self.keys], [a[:, :, :end] for a in self.values]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask, verify: bool = False) -> mx.array:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        keys, values = self.append(k, v)
        return quantized_scaled_dot_product_attention(
            self._rotate(q), keys, values, scale=scale, mask=mask, group_size=self._group(q.shape[-1]), bits=self.bits
        )

    def dequantized(self) -> Tuple[mx.array, mx.array]:
        """K (rotated back) and V of the rows held, as floats (diagnostics, tests)."""
        gs = self._group(self._head_dim())
        ks = [a[:, :, : self.offset] for a in self.keys]
        vs = [a[:, :, : self.offset] for a in self.values]
        k = mx.dequantize(*ks, group_size=gs, bits=self.bits)
        return self._rotate(k), mx.dequantize(*vs, group_size=gs, bits=self.bits)

    def _head_dim(self) -> int:
        return self.keys[0].shape[-1] * 32 // self.bits

    def compact(self, start: int, rows) -> None:
        idx = mx.array([start + r for r in rows])
        n = len(rows)
        for buf in self.keys + self.values:
            buf[:, :, start : start + n] = buf[:, :, idx]

    def truncate(self, length: int) -> None:
        self.offset = min(self.offset, length)

    def snapshot(self):
        return self.offset

    def restore(self, snap) -> None:
        self.truncate(snap)

    def state(self) -> List[mx.array]:
        if self.keys[0] is None:
            return []
        return [a[:, :, : self.offset] for a in self.keys + self.values]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())


class DeltaNetState:
    """Gated DeltaNet layer state.

    conv: [1, K-1, C] the last K-1 pre-conv qkv rows (input dtype).
    ssm:  [1, Hv, Dv, Dk] recurrent state, fp32.
    tape: set by a recording forward: (ssm before the block, k, g, delta,
          conv_in) -- enough to restore both states after any prefix.
    """

    def __init__(self):
        self.conv: Optional[mx.array] = None
        self.ssm: Optional[mx.array] = None
        self.tape = None

    def rollback(self, n: int, path=None) -> None:
        """Keep the first ``n`` tokens of the recorded block, or (tree verify)
        the tokens on ``path`` (block rows, root first; n == len(path))."""
        if path is None:
            DeltaNetState.rollback_chain([self], n)
            return
        ssm0, k, g, delta, conv_in, K = self.tape
        self.tape = None
        P = mx.array(path)
        k, g, delta = k[:, P], g[:, P], delta[:, P]
        conv_in = mx.concatenate([conv_in[:, : K - 1], conv_in[:, K - 1 + P]], axis=1)
        self.ssm = gated_delta_rollback(ssm0, k, g, delta, n, stepwise=row_exact(k.dtype))
        self.conv = conv_state_rollback(conv_in, n, K)

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


class TargetCache:
    """Per-layer caches of the target plus the number of committed positions."""

    def __init__(self, is_linear: List[bool], kv_bits: Optional[int] = None, kv_group_size: int = KV_GROUP_SIZE):
        check_kv_bits(kv_bits)
        attn = (lambda: QuantizedKVBuffer(kv_bits, kv_group_size)) if kv_bits else KVBuffer
        self.kv_bits = kv_bits
        self.layers = [DeltaNetState() if lin else attn() for lin in is_linear]
        self.offset = 0  # positions held (including an unrolled-back block)
        self.block = 0  # tokens of the last recorded block, 0 if none pending

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
        new_offset = start + n_keep
        for c in self.layers:
            if isinstance(c, (KVBuffer, QuantizedKVBuffer)):
                if path is not None:
                    c.compact(start, path)
                c.truncate(new_offset)
            elif path is not None:
                c.rollback(n_keep, path)
        if path is None:
            DeltaNetState.rollback_chain([c for c in self.layers if isinstance(c, DeltaNetState)], n_keep)
        self.offset = new_offset
        self.block = 0

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
        return sum(c.nbytes() for c in self.layers if not isinstance(c, DeltaNetState))
