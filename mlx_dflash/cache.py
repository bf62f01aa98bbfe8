"""Target cache: attention KV, DeltaNet state, and what verify records for rollback.

Batch size is 1 throughout (one generation per cache).
"""

from typing import List, Optional, Tuple

import mlx.core as mx

from . import kernels


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
        ssm0, k, g, delta, conv_in, K = self.tape
        self.tape = None
        if path is None:
            if n == delta.shape[1]:
                return  # everything accepted: the forward's state is already right
        else:
            P = mx.array(path)
            k, g, delta = k[:, P], g[:, P], delta[:, P]
            conv_in = mx.concatenate([conv_in[:, : K - 1], conv_in[:, K - 1 + P]], axis=1)
        self.ssm = kernels.gated_delta_rollback(ssm0, k, g, delta, n)
        self.conv = kernels.conv_state_rollback(conv_in, n, K)

    def snapshot(self):
        return (self.conv, self.ssm, self.tape)  # arrays are immutable: references suffice

    def restore(self, snap) -> None:
        self.conv, self.ssm, self.tape = snap

    def state(self) -> List[mx.array]:
        return [x for x in (self.conv, self.ssm) if x is not None]


class TargetCache:
    """Per-layer caches of the target plus the number of committed positions."""

    def __init__(self, is_linear: List[bool]):
        self.layers = [DeltaNetState() if lin else KVBuffer() for lin in is_linear]
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
            if isinstance(c, KVBuffer):
                if path is not None:
                    c.compact(start, path)
                c.truncate(new_offset)
            else:
                c.rollback(n_keep, path)
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
