"""Pipeline stages: a rank's share of the target's layers and how it runs.

Ranks > 0 run a :class:`StageWorker` (apply the queued cache operations, run
their layers, pass the hidden states on); rank 0 holds a
:class:`PipelineTarget`, the whole target as the decode loop sees it, with a
:class:`PipelineCache` that queues every cache operation for the others.
:func:`load_stage` builds a rank's share; ``api.load(..., pipeline=...)`` (the
engine factory) calls it and adds the tokenizer and draft on rank 0.
"""

import atexit
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..cache import TargetCache
from ..errors import DFlashError
from ..loading import load_target
from ..models.qwen35 import Target, tree_inputs
from .link import (
    FLAG_RECORD,
    FLAG_TREE,
    OP_FORWARD,
    OP_STOP,
    OP_SYNC,
    PRE_RESET,
    PRE_RESTORE,
    PRE_ROLLBACK,
    Link,
    dtype_code,
    init_group,
)
from .plan import LAYER_NAME, Costs, stage_plan


def check_pipeline_kv(pipeline, kv_bits: Optional[int]) -> None:
    """A quantized KV cache on a pipeline-split target is refused: the other
    ranks make their caches unquantized, and a cache split across ranks in
    two forms would not be the one decoding checks exact."""
    if pipeline and kv_bits is not None:
        raise DFlashError("--kv-bits (kv_bits) does not work with --pipeline yet: run on one machine, or drop it")


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

    def make_cache(self, kv_bits: Optional[int] = None) -> TargetCache:
        check_pipeline_kv(True, kv_bits)
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
                        dtype_code(out.dtype),
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

    def make_cache(self, kv_bits: Optional[int] = None) -> PipelineCache:
        check_pipeline_kv(True, kv_bits)
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


@dataclass
class Pipeline:
    """How ``load(..., pipeline=Pipeline(...))`` joins a pipeline: ``group``, the
    ``mx.distributed`` group (default: the ``mlx.launch`` run's, ring backend);
    ``timeout``, seconds a rank waits for the previous one during a generation
    before every rank ends with an error."""

    group: Optional[object] = None
    timeout: float = 60.0


@dataclass
class Stage:
    """What one rank holds of a pipeline (``Engine.stage``)."""

    rank: int
    size: int
    bounds: List[Tuple[int, int]]  # (start, end) layers per stage, first stage first
    costs: Costs
    target: StageTarget
    link: Link
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

    def sync(self) -> None:
        """Rank 0, after a generation: every stage applies the last rollback and
        then waits without a time bound (a no-op on a broken ring)."""
        if not self.link.broken:
            self.target.sync()

    def close(self) -> None:
        """Rank 0: stop the other ranks (they return from serve). Idempotent; a
        no-op on a broken ring; registered to run at exit, so an error on
        rank 0 still releases the others."""
        if self.rank == 0 and not self.link.broken and not self.closed:
            self.closed = True
            self.target.stop()


def load_stage(model, draft=None, *, dtype=None, pipeline: Optional[Pipeline] = None, adapter_path=None) -> Stage:
    """This rank's share of a pipeline-parallel target (``model``: a local
    folder or GGUF file; ``draft`` only sizes rank 0's share here).

    The layers are split by :func:`~.plan.plan_stages` on parameter bytes;
    each rank reads only its own tensors. Rank 0 (the last stage) gets a
    :class:`PipelineTarget` (plus an embedding copy when it will hold a
    draft); the other ranks a :class:`StageWorker` to ``serve()``.
    """
    pipeline = pipeline or Pipeline()
    group = pipeline.group if pipeline.group is not None else init_group()
    link = Link(group, pipeline.timeout)
    rank, n = link.rank, link.size
    mx.reset_peak_memory()
    pl = stage_plan(model, n, draft)
    stage = n - 1 - rank
    start, end = pl.bounds[stage]
    embed = stage == 0 or (rank == 0 and (draft is not None or pl.tied))

    def owned(name: str) -> bool:
        m = LAYER_NAME.search(name)
        if m is not None:
            return start <= int(m.group(1)) < end
        return embed if "embed_tokens" in name else rank == 0

    # A folder maps lazily (nothing read until evaluated); a GGUF decodes only this rank's tensors.
    # Adapters wrap every adapted layer; a rank evaluates only its own layers' weights.
    base = load_target(model, dtype=dtype, lazy=True, only=owned, adapter_path=adapter_path)
    if rank == 0:
        t = PipelineTarget(base.model, base.config, start, end, link, embed=draft is not None or stage == 0)
    else:
        t = StageTarget(base.model, base.config, start, end, embed=stage == 0, head=False)
    del base
    t.drop_unowned()
    mx.eval([m.parameters() for m in t.owned_modules()])
    peak = mx.get_peak_memory() / 1e9
    link.barrier()
    st = Stage(rank, n, pl.bounds, pl.costs, t, link, load_peak_memory=peak, share_bytes=pl.shares[stage])
    if rank != 0:
        st.worker = StageWorker(t, link)
    else:
        # From here on an error on rank 0 still releases the others (they are serving by then).
        atexit.register(st.close)
    return st
