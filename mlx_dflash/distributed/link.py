"""The wire between ranks: a ring of ``mx.distributed`` send/recv, one
header message per hop (1 KB, the meta ints inline), then the hidden states;
a watchdog ends a rank whose receive waits too long."""

import os
import sys
import threading
import time
from typing import List, Optional, Tuple

import mlx.core as mx

from ..errors import DFlashError, check_positive

_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
HEADER = 8  # op, T, n_meta, width, dtype, n_pre, n_capture, flags
INLINE = 248  # meta ints carried in the header message itself (a 1 KB message)
OP_FORWARD, OP_SYNC, OP_STOP = 1, 2, 3
PRE_RESET, PRE_ROLLBACK, PRE_RESTORE = 1, 2, 3
FLAG_RECORD, FLAG_TREE = 1, 2


class Link:
    """Messages to the next rank / from the previous one, with a watchdog.

    ``bounded`` receives (inside a generation) that wait more than
    ``timeout`` seconds end the process with an error line: the main thread
    is blocked inside MLX then, so only another thread can notice.
    """

    def __init__(self, group, timeout: float = 60.0):
        check_positive(timeout, "--pipeline-timeout", "number of seconds")
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout = timeout
        self.prev = (self.rank + 1) % self.size  # where messages come from
        self.next = (self.rank - 1) % self.size  # where they go
        self._waiting: Optional[Tuple[int, float]] = None
        self.broken = False  # a receive or send failed: the ring is gone
        threading.Thread(target=self._watch, daemon=True, name="pipeline-watchdog").start()

    def _watch(self):
        while True:
            time.sleep(min(0.2, self.timeout / 4))
            w = self._waiting
            if w is not None and time.monotonic() > w[1]:
                sys.stderr.write(
                    f"error: rank {self.rank}: no message from rank {w[0]} for {self.timeout:g} s "
                    "(a rank is stuck or the link dropped); ending this rank\n"
                )
                sys.stderr.flush()
                os._exit(2)

    def _eval(self, arrays, src: int, bounded: bool):
        self._waiting = (src, time.monotonic() + self.timeout) if bounded else None
        try:
            mx.eval(*arrays)
        except RuntimeError as e:
            self.broken = True
            raise DFlashError(
                f"rank {self.rank}: lost the link to rank {src} ({e}); a rank died or the network dropped"
            ) from None
        finally:
            self._waiting = None

    def send(self, header: List[int], meta=None, payload: Optional[mx.array] = None):
        """``header`` fields, ``meta`` ints (a list or an int32 array, inline in the
        header message when short) and a float ``payload``: one or two messages."""
        n_meta = header[2]
        parts = [mx.array(header, dtype=mx.int32)]
        if n_meta and n_meta <= INLINE:
            parts.append(meta if isinstance(meta, mx.array) else mx.array(meta, dtype=mx.int32))
            parts.append(mx.zeros((INLINE - n_meta,), mx.int32))
        else:
            parts.append(mx.zeros((INLINE,), mx.int32))
        msgs = [mx.concatenate(parts)]
        if n_meta > INLINE:
            msgs.append(meta if isinstance(meta, mx.array) else mx.array(meta, dtype=mx.int32))
        if header[3]:
            msgs.append(payload)
        # One eval per message: independent sends in one graph may go out in any order.
        for m in msgs:
            self._eval([mx.distributed.send(m, self.next, group=self.group)], self.next, True)

    def recv(self, bounded: bool = True):
        """(header fields, meta list, payload or None) from the previous rank."""
        h = mx.distributed.recv((HEADER + INLINE,), mx.int32, self.prev, group=self.group)
        self._eval([h], self.prev, bounded)
        ints = h.tolist()
        header = ints[:HEADER]
        op, T, n_meta, width, dt = header[:5]
        if op not in (OP_FORWARD, OP_SYNC, OP_STOP) or not 0 <= dt < len(_DTYPES):
            raise DFlashError(f"rank {self.rank}: garbled message from rank {self.prev}: {header}")
        meta = ints[HEADER : HEADER + n_meta] if n_meta <= INLINE else None
        payload = None
        if meta is None:
            m = mx.distributed.recv((n_meta,), mx.int32, self.prev, group=self.group)
            self._eval([m], self.prev, True)
            meta = m.tolist()
        if width:
            payload = mx.distributed.recv((T, width), _DTYPES[dt], self.prev, group=self.group)
            self._eval([payload], self.prev, True)
        return header, meta, payload

    def barrier(self):
        """All ranks reach this point (no time bound: loading can take long)."""
        self._eval([mx.distributed.all_sum(mx.array(1.0), group=self.group)], self.prev, False)


def dtype_code(dt) -> int:
    return _DTYPES.index(dt) if dt in _DTYPES else 0


def init_group(backend: str = "ring"):
    """The ``mx.distributed`` group of an ``mlx.launch`` run (a clear error without one)."""
    if not mx.distributed.is_available():
        raise DFlashError("mx.distributed is not available in this MLX build")
    try:
        group = mx.distributed.init(strict=False, backend=backend)
    except RuntimeError as e:
        raise DFlashError(f"cannot join the distributed group: {e}") from None
    if group.size() < 2:
        raise DFlashError(
            "--pipeline needs 2 or more processes: run under `mlx.launch --backend ring -n N` or with a hostfile"
        )
    return group
