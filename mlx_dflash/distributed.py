"""Pipeline-parallel targets over ``mx.distributed``, with DFlash on top.

The target's decoder layers are split into contiguous stages, one per rank of
the ``mx.distributed`` group (launched with ``mlx.launch``). As in mlx-lm,
rank 0 holds the *last* stage: rank N-1 embeds and runs the first layers,
hands its hidden states to rank N-2, ..., rank 0 runs the last layers, the
final norm and the head. Rank 0 also drives generation: it runs the ordinary
decode loop (``decode.generate_tokens``, plain, chain or tree, any sampler)
over a :class:`PipelineTarget` whose forward sends the block's token ids
around the ring (0 -> N-1 -> ... -> 1 -> 0) and finishes it locally; it holds
the draft (which borrows an embedding copy and the head), decides acceptance
once, and prints. Every hop is between ring neighbours.

Per hop one message of 1 KB holding the header and, inline, the ``meta``
ints (cache operations still to apply, capture layer ids, tree parents,
token ids), then the hidden states with the capture layers' features
appended (none on the hop that carries the token ids to the first stage).
Cache operations (reset, rollback to the accepted prefix or tree path, undo
of a queued plain step) ride on the next message, so a DFlash cycle and a
plain token each cost exactly one trip around the ring; every rank applies
them to its own layers, so all stages roll back identically.

A rank that dies closes its sockets: the ring backend then fails the pending
receive (about a second) and every rank exits with one ``error:`` line. A
link that goes silent is caught by a watchdog thread: a receive that waits
longer than ``timeout`` seconds during a generation ends the process.
"""

import atexit
import json
import os
import re
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import TargetCache
from .errors import DFlashError
from .models.qwen35 import Target, tree_inputs

# --- stage planning ---------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
_SKIP = ("mtp", "visual", "vision")  # multi-token-prediction heads and vision towers: not loaded


@dataclass
class Costs:
    """Parameter bytes of a target: per decoder layer, embedding, head, final norm."""

    layers: List[int]
    embed: int = 0
    head: int = 0  # 0 with tied embeddings (the head is the embedding)
    norm: int = 0

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head + self.norm


def costs_from_sizes(sizes: Dict[str, int], num_layers: int) -> Costs:
    """Group tensor byte sizes by layer (names as in HF/MLX folders or GGUF files)."""
    c = Costs([0] * num_layers)
    for name, n in sizes.items():
        if any(s in name for s in _SKIP):
            continue
        m = _LAYER.search(name)
        if m is not None:
            i = int(m.group(1))
            if i < num_layers:  # layers past the last are MTP layers, dropped at load
                c.layers[i] += n
        elif "embed_tokens" in name or name.startswith("token_embd"):
            c.embed += n
        elif "lm_head" in name or name.startswith("output."):
            c.head += n
        else:
            c.norm += n
    return c


def safetensors_sizes(folder) -> Dict[str, int]:
    """Tensor name -> bytes, from the headers of a folder's safetensors files (no data read)."""
    sizes = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                a, b = v["data_offsets"]
                sizes[k] = b - a
    return sizes


def gguf_sizes(path) -> Dict[str, int]:
    from .loading.gguf import open_gguf

    return {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}


def plan_stages(costs: Sequence[int], n: int, first_extra: int = 0, last_extra: int = 0) -> List[Tuple[int, int]]:
    """Split layers into ``n`` contiguous non-empty stages minimising the
    largest stage's bytes; stage 0 also holds ``first_extra`` (the embedding),
    stage n-1 ``last_extra`` (norm, head, draft). Returns [(start, end)] by stage."""
    L = len(costs)
    if not 1 <= n <= L:
        raise DFlashError(f"cannot split {L} layers into {n} pipeline stages (at most one stage per layer)")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)

    def stage_cost(s, a, b):
        return pre[b] - pre[a] + (first_extra if s == 0 else 0) + (last_extra if s == n - 1 else 0)

    INF = float("inf")
    # best[s][j]: the smallest max cost of stages 0..s covering layers 0..j-1
    best = [[INF] * (L + 1) for _ in range(n)]
    cut = [[0] * (L + 1) for _ in range(n)]
    for j in range(1, L + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, n):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], stage_cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], L
    for s in range(n - 1, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


# --- the link -----------------------------------------------------------------------

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
        if timeout <= 0:
            raise DFlashError(f"pipeline timeout must be positive, got {timeout}")
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


def _dtype_code(dt) -> int:
    return _DTYPES.index(dt) if dt in _DTYPES else 0


# --- stages ------------------------------------------------------------------------


class StageTarget(Target):
    """The layers [start, end) of a target (global layer ids), plus the
    embedding and/or final norm + head where this stage needs them."""

    def __init__(self, model, config, start: int, end: int, *, embed: bool, head: bool):
        super().__init__(model, config)
        self.total_layers = len(self.layers)
        self.start, self.end = start, end
        self.has_embed, self.has_head = embed, head
        kept = list(self.layers[start:end])
        self.lm.model.layers = kept  # drop the other layers' (lazy, never read) weights
        self.layers = kept
        self.is_linear = [layer.is_linear for layer in kept]

    @property
    def num_layers(self) -> int:
        return self.total_layers

    def owned_modules(self):
        """The modules whose weights this rank reads (the rest stay unread on disk)."""
        out = list(self.layers)
        tied = self.args.tie_word_embeddings
        if self.has_embed or (self.has_head and tied):
            out.append(self.embed_tokens)
        if self.has_head:
            out.append(self.norm)
            if not tied:
                out.append(self.lm.lm_head)
        return out

    def drop_unowned(self) -> None:
        """Forget the lazily mapped weights this rank never reads."""
        tied = self.args.tie_word_embeddings
        if not (self.has_embed or (self.has_head and tied)):
            self.lm.model.pop("embed_tokens", None)
            self.embed_tokens = None
        if not self.has_head:
            self.lm.model.pop("norm", None)
            self.norm = None
            if not tied:
                self.lm.pop("lm_head", None)

    def make_cache(self) -> TargetCache:
        return TargetCache(self.is_linear)

    def run_layers(
        self, h: mx.array, cache: TargetCache, capture: Sequence[int], record: bool, parents
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """This stage's layers over h [1, T, H]; features of the capture layers it holds."""
        local = [i - self.start for i in capture if self.start <= i < self.end]
        tree = tree_inputs(parents) if parents is not None else None
        h, feats = self.layers_forward(h, cache.layers, capture=local, record=record, parents=parents, tree=tree)
        T = h.shape[1]
        cache.offset += T
        cache.block = T if record else 0
        return h, feats


def _apply_pre(cache: TargetCache, ops: List[int], snaps: dict, is_linear: List[bool]) -> TargetCache:
    """Apply the cache operations rank 0 queued (a fresh cache for a reset)."""
    i = 0
    while i < len(ops):
        code = ops[i]
        if code == PRE_RESET:
            cache = TargetCache(is_linear)
            snaps.clear()
            i += 1
        elif code == PRE_ROLLBACK:
            n_keep, plen = ops[i + 1], ops[i + 2]
            path = ops[i + 3 : i + 3 + plen] or None
            cache.rollback(n_keep, path)
            i += 3 + plen
        elif code == PRE_RESTORE:
            off = ops[i + 1]
            if off != cache.offset:
                if off not in snaps:
                    raise DFlashError(f"pipeline: cannot restore the cache to offset {off}")
                cache.restore(snaps[off])
            i += 2
        else:
            raise DFlashError(f"pipeline: unknown cache operation {code}")
    return cache


class StageWorker:
    """A rank other than 0: applies cache operations, runs its layers, passes
    the hidden states on; returns from :meth:`serve` when rank 0 stops."""

    def __init__(self, target: StageTarget, link: Link):
        self.target, self.link = target, link
        self.cache = target.make_cache()
        self._snaps: dict = {}  # offset -> snapshot before the last plain forward (undo)
        self.in_generation = False
        self.busy: Dict[int, List[float]] = {}  # T -> [forwards, seconds from message in to hidden out]

    def serve(self) -> None:
        t = self.target
        while True:
            header, meta, payload = self.link.recv(bounded=self.in_generation)
            op, T, n_meta, width, dt, n_pre, n_cap, flags = header
            pre, rest = meta[:n_pre], meta[n_pre:]
            if pre:
                self.cache = _apply_pre(self.cache, pre, self._snaps, t.is_linear)
                if PRE_RESET in pre[:1]:
                    self.in_generation = True
            if op == OP_FORWARD:
                tic = time.perf_counter()
                capture = rest[:n_cap]
                tree = bool(flags & FLAG_TREE)
                parents = rest[n_cap : n_cap + T] if tree else None
                record = bool(flags & FLAG_RECORD)
                if t.has_embed and payload is None:
                    tokens = mx.array(rest[len(rest) - T :], dtype=mx.int32)
                    h, upstream = t.embed(tokens[None]), None
                else:
                    H = t.hidden_size
                    h, upstream = payload[None, :, :H], (payload[:, H:] if width > H else None)
                if not record:
                    self._snaps = {self.cache.offset: self.cache.snapshot()}
                h, feats = t.run_layers(h, self.cache, capture, record, parents)
                parts = [h[0]] + [x for x in (upstream, feats[0] if feats is not None else None) if x is not None]
                out = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
                # The meta goes on unchanged (the later stages apply the same
                # operations), except back to rank 0, which sent it.
                last = self.link.next == 0
                self.link.send(
                    [
                        op,
                        T,
                        0 if last else n_meta,
                        out.shape[-1],
                        _dtype_code(out.dtype),
                        0 if last else n_pre,
                        n_cap,
                        flags,
                    ],
                    None if last else meta,
                    out,
                )
                b = self.busy.setdefault(T, [0, 0.0])
                b[0] += 1
                b[1] += time.perf_counter() - tic
            else:
                if op == OP_SYNC:
                    self.in_generation = False
                last = self.link.next == 0
                self.link.send(
                    [op, 0, 0 if last else n_meta, 0, 0, 0 if last else n_pre, 0, 0], None if last else meta, None
                )
                if op == OP_STOP:
                    return


class PipelineCache:
    """Rank 0's cache: its own layers; every operation is also queued for the
    other stages (sent with the next message)."""

    def __init__(self, pipe: "PipelineTarget"):
        self.pipe = pipe
        self.local = TargetCache(pipe.is_linear)
        pipe.pending = [PRE_RESET]  # whatever was queued for an earlier cache is moot

    @property
    def offset(self) -> int:
        return self.local.offset

    @property
    def block(self) -> int:
        return self.local.block

    @property
    def layers(self):
        return self.local.layers

    def rollback(self, n_keep: int, path=None) -> None:
        self.local.rollback(n_keep, path)
        p = list(path) if path is not None else []
        self.pipe.pending += [PRE_ROLLBACK, n_keep, len(p)] + p

    def snapshot(self):
        return self.local.snapshot()

    def restore(self, snap) -> None:
        self.local.restore(snap)
        self.pipe.pending += [PRE_RESTORE, self.local.offset]

    def state(self) -> List[mx.array]:
        return self.local.state()


class PipelineTarget(StageTarget):
    """Rank 0: the last stage, and the whole target as the decode loop sees it."""

    independent_caches = False  # the other stages hold one cache: a new one resets theirs

    def __init__(self, model, config, start: int, end: int, link: Link, *, embed: bool):
        super().__init__(model, config, start, end, embed=embed, head=True)
        self.link = link
        self.pending: List[int] = []
        self.in_generation = False
        self.wait: Dict[int, List[float]] = {}  # T -> [forwards, seconds from send to hidden back]

    def make_cache(self) -> PipelineCache:
        self.in_generation = True
        return PipelineCache(self)

    def embed(self, tokens: mx.array) -> mx.array:
        if not self.has_embed:
            raise DFlashError("rank 0 holds no embedding (it loads one only with a draft)")
        return self.embed_tokens(tokens)

    def forward(
        self,
        tokens,
        cache: PipelineCache,
        *,
        capture: Sequence[int] = (),
        record: bool = False,
        logits: str = "all",
        parents: Optional[Sequence[int]] = None,
    ):
        """As :meth:`Target.forward`, the earlier layers run by the other ranks."""
        if not isinstance(cache, PipelineCache):
            raise DFlashError("a pipeline target needs its own cache (make_cache)")
        tokens = tokens.astype(mx.int32) if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.int32)
        T = tokens.shape[0]
        if parents is not None:
            if not record:
                raise ValueError("a tree forward must be recorded (it is always rolled back)")
            parents = [int(p) for p in parents]
        capture = [int(i) for i in capture]
        flags = (FLAG_RECORD if record else 0) | (FLAG_TREE if parents is not None else 0)
        pre, self.pending = self.pending, []
        head_ints = pre + capture + (parents or [])
        meta = mx.concatenate([mx.array(head_ints, dtype=mx.int32), tokens]) if head_ints else tokens
        mx.eval(meta)  # this rank's own work (the previous pick, the draft) stays out of ``wait``
        tic = time.perf_counter()
        self.link.send([OP_FORWARD, T, len(head_ints) + T, 0, 0, len(pre), len(capture), flags], meta, None)
        header, _, payload = self.link.recv()
        w = self.wait.setdefault(T, [0, 0.0])
        w[0] += 1
        w[1] += time.perf_counter() - tic
        if header[0] != OP_FORWARD or header[1] != T or payload is None:
            raise DFlashError(f"pipeline out of step: sent a forward of {T} tokens, got back {header}")
        H = self.hidden_size
        h = payload[None, :, :H]
        h, own = self.run_layers(h, cache.local, capture, record, parents)
        features = None
        if capture:
            parts = ([payload[:, H:]] if payload.shape[-1] > H else []) + ([own[0]] if own is not None else [])
            feats = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
            order = sorted(capture)  # stages append their captures in layer order
            if order != capture:
                cols = [order.index(i) for i in capture]
                feats = mx.concatenate([feats[:, c * H : (c + 1) * H] for c in cols], axis=-1)
            features = feats
        if logits == "none":
            return None, features
        if logits == "last":
            h = h[:, -1:]
        return self.lm_head(self.norm(h))[0], features

    def sync(self) -> None:
        """Send queued cache operations and wait until every stage applied them
        (the end of a generation: the other ranks then wait without a time bound)."""
        pre, self.pending = self.pending, []
        self.link.send([OP_SYNC, 0, len(pre), 0, 0, len(pre), 0, 0], pre)
        header, _, _ = self.link.recv()
        if header[0] != OP_SYNC:
            raise DFlashError(f"pipeline out of step: expected a sync back, got {header}")
        self.in_generation = False

    def stop(self) -> None:
        """End the other ranks' loops (they return from :meth:`StageWorker.serve`)."""
        self.link.send([OP_STOP, 0, 0, 0, 0, 0, 0, 0])
        header, _, _ = self.link.recv()
        if header[0] != OP_STOP:
            raise DFlashError(f"pipeline out of step: expected a stop back, got {header}")


# --- loading ---------------------------------------------------------------------


@dataclass
class Stage:
    """What one rank holds after :func:`load`."""

    rank: int
    size: int
    bounds: List[Tuple[int, int]]  # (start, end) layers per stage, first stage first
    costs: Costs
    target: StageTarget
    link: Link
    engine: Optional[object] = None  # rank 0: an api.Engine over the PipelineTarget
    worker: Optional[StageWorker] = None  # ranks > 0
    load_peak_memory: float = 0.0  # GB, MLX allocations while loading this rank's share
    closed: bool = False
    share_bytes: int = 0  # bytes on disk of what this rank loads (its layers, embedding, head, draft)

    @property
    def layers(self) -> Tuple[int, int]:
        """This rank's (start, end) layers."""
        return self.bounds[self.size - 1 - self.rank]

    def serve(self) -> None:
        """Ranks > 0: run this stage until rank 0 calls :meth:`close`."""
        if self.worker is None:
            raise DFlashError("rank 0 drives the pipeline; serve() is for the other ranks")
        self.worker.serve()

    def close(self) -> None:
        """Rank 0: stop the other ranks (they return from serve). Idempotent; a
        no-op on a broken ring; registered to run at exit, so an error on
        rank 0 still releases the others."""
        if self.rank == 0 and not self.link.broken and not self.closed:
            self.closed = True
            self.target.stop()


def stream_generate(engine, prompt, **kwargs):
    """:func:`api.stream_generate` through the pipeline (rank 0, ``Stage.engine``);
    afterwards every stage has applied the last rollback and waits without a time bound."""
    from .api import stream_generate as _stream

    target = engine.target
    try:
        yield from _stream(engine, prompt, **kwargs)
    finally:
        if not target.link.broken:
            target.sync()


def generate(engine, prompt, **kwargs):
    """:func:`api.generate` through the pipeline (rank 0, ``Stage.engine``)."""
    from .api import collect

    return collect(stream_generate(engine, prompt, **kwargs))


@dataclass
class StagePlan:
    """How a target splits over ``n`` ranks (stage order: the first stage first)."""

    costs: Costs
    bounds: List[Tuple[int, int]]
    shares: List[int]  # bytes each stage's rank loads
    draft_bytes: int
    tied: bool
    gguf: bool

    def describe(self) -> str:
        def size(b):
            return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"

        n = len(self.bounds)
        lines = [
            f"pipeline over {n} ranks: {len(self.costs.layers)} layers, "
            f"{size(self.costs.total + self.draft_bytes)} on disk"
        ]
        for s, ((a, b), share) in enumerate(zip(self.bounds, self.shares)):
            extra = (["embedding"] if s == 0 else []) + (
                ["norm", "head"] + (["draft", "embedding copy"] if self.draft_bytes else []) if s == n - 1 else []
            )
            lines.append(
                f"  rank {n - 1 - s}: layers {a}-{b - 1}"
                + (f" + {', '.join(extra)}" if extra else "")
                + f": {size(share)}"
            )
        return "\n".join(lines)


def plan(model, n: int, draft=None) -> StagePlan:
    """The stage split of ``model`` (folder or GGUF) over ``n`` ranks, from
    tensor sizes alone (nothing is loaded)."""
    from .loading.gguf import gguf_config, is_gguf, open_gguf
    from .loading.hf import read_config

    gguf = is_gguf(model)
    if gguf:
        cfg = gguf_config(open_gguf(model))["text_config"]
        sizes = gguf_sizes(model)
    else:
        raw = read_config(model, "model")
        cfg = raw.get("text_config", raw)
        sizes = safetensors_sizes(Path(model).expanduser())
    if "num_hidden_layers" not in cfg:
        raise DFlashError(f"{model}: no num_hidden_layers in its config (not a Qwen3.5 target?)")
    tied = bool(cfg.get("tie_word_embeddings", False))
    costs = costs_from_sizes(sizes, int(cfg["num_hidden_layers"]))
    draft_bytes = 0
    if draft is not None:
        p = Path(draft).expanduser()
        draft_bytes = (
            sum(gguf_sizes(p).values()) if is_gguf(p) else sum(safetensors_sizes(p).values()) if p.is_dir() else 0
        )
    head = costs.norm + (costs.embed if tied else costs.head)
    last_extra = head + draft_bytes + (costs.embed if draft is not None and not tied else 0)
    bounds = plan_stages(costs.layers, n, first_extra=costs.embed, last_extra=last_extra)
    shares = [sum(costs.layers[a:b]) for a, b in bounds]
    shares[0] += costs.embed
    shares[-1] += last_extra
    return StagePlan(costs, bounds, shares, draft_bytes, tied, gguf)


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


def load(
    model=None,
    draft=None,
    *,
    dtype=None,
    draft_quantize: Optional[int] = None,
    group=None,
    timeout: float = 60.0,
    compile: bool = True,
) -> Stage:
    """Load this rank's stage of a pipeline-parallel target (call on every rank).

    The layers are split by :func:`plan_stages` on parameter bytes; each
    rank reads only its own tensors. Rank 0 (the last stage) also loads the
    tokenizer and, when given, the draft (plus an embedding copy for it) and
    gets ``Stage.engine``; the other ranks call ``Stage.serve()``.
    """
    from .api import DEFAULT_DRAFT, DEFAULT_MODEL, Engine
    from .loading import load_tokenizer
    from .loading.gguf import is_gguf, load_gguf_target, tokenizer_dir_for
    from .loading.hf import _cast, load_target

    if model is None:
        model = DEFAULT_MODEL
        if draft is None:
            draft = DEFAULT_DRAFT
        dtype = dtype or mx.float32
    group = group if group is not None else init_group()
    link = Link(group, timeout)
    rank, n = link.rank, link.size
    mx.reset_peak_memory()
    if not is_gguf(model):
        base = load_target(model, lazy=True)  # checks the folder; nothing read yet (mx.load maps lazily)
    pl = plan(model, n, draft)
    gguf, tied, costs, bounds = pl.gguf, pl.tied, pl.costs, pl.bounds
    stage = n - 1 - rank
    start, end = bounds[stage]
    share = pl.shares[stage]
    embed = stage == 0 or (rank == 0 and (draft is not None or tied))
    if gguf:

        def owned(name: str) -> bool:
            m = _LAYER.search(name)
            if m is not None:
                return start <= int(m.group(1)) < end
            return embed if "embed_tokens" in name else rank == 0

        base, _ = load_gguf_target(model, dtype=dtype, only=owned)  # decodes only this rank's tensors
    if rank == 0:
        t = PipelineTarget(base.model, base.config, start, end, link, embed=draft is not None or stage == 0)
    else:
        t = StageTarget(base.model, base.config, start, end, embed=stage == 0, head=False)
    del base
    t.drop_unowned()
    mods = t.owned_modules()
    for m in mods:
        _cast(m, dtype)
    mx.eval([m.parameters() for m in mods])
    peak = mx.get_peak_memory() / 1e9
    link.barrier()
    t.compiled = compile
    st = Stage(rank, n, bounds, costs, t, link, load_peak_memory=peak, share_bytes=share)
    if rank != 0:
        st.worker = StageWorker(t, link)
        return st
    # From here on an error on rank 0 still releases the others (they are serving by then).
    atexit.register(st.close)
    from .loading import load_draft

    eos = t.config.get("eos_token_id", t.config.get("text_config", {}).get("eos_token_id"))
    tok = load_tokenizer(tokenizer_dir_for(model) if gguf else model, eos_token_ids=eos)
    d = load_draft(draft, t, quantize_bits=draft_quantize, dtype=dtype) if draft is not None else None
    if d is not None:
        d.compiled = compile
    st.engine = Engine(t, tok, d, Path(model), Path(draft) if draft else None)
    st.load_peak_memory = mx.get_peak_memory() / 1e9
    return st
