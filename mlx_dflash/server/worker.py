"""One engine, many clients: a generation thread fed by a bounded arrival-order queue.

MLX work stays on one thread and the event loop stays free for other
clients. With ``max_batch`` 1 the thread runs one request at a time
(``stream_generate``); after every committed block it checks whether the
request was cancelled (the client went away) or ran past its deadline, and
if so closes the generator, so the engine is free within one cycle.

With ``max_batch`` > 1 it runs a :class:`~mlx_dflash.BatchDecoder`: between
steps it admits queued requests to free slots (arrival order), drops the
slots whose client went away or whose deadline passed, runs one step, and
sends each request its text as its tokens arrive. A request the batch does
not take (another verify shape, e.g. --auto-tree) waits, holding the queue,
until the batch drains, and then runs alone.
"""

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..batch import DEFAULT_MAX_BATCH
from ..detokenize import Detokenizer
from ..errors import DFlashError
from .metrics import Metrics

log = logging.getLogger("mlx_dflash.server")


class QueueFull(Exception):
    pass


SHUTDOWN = "the server is shutting down"


class _Stopped(Exception):
    """A request cancelled or out of time while its prompt prefills."""


class StopMatcher:
    """Cut streamed text at the first stop string; hold back text that may start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit = False
        self.matched: Optional[str] = None

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.buf += text
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda x: x[0])
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold :]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def feed_tokens(detok, stops: StopMatcher, tokens: Sequence[int], eos: Sequence[int], last: bool):
    """Detokenize ``tokens`` one at a time through the stop strings (EOS
    adds no text; ``last``: the generation ended with them). Returns the
    text to send and how many tokens it used: up to the one that completed
    a stop string, as a cycle may commit tokens past it."""
    out = []
    for k, t in enumerate(tokens):
        if t not in eos:
            detok.add_token(t)
        if last and k == len(tokens) - 1:
            detok.finalize()
        out.append(stops.feed(detok.last_segment))
        if stops.hit:
            return "".join(out), k + 1
    if last and not tokens:
        detok.finalize()
        out.append(stops.feed(detok.last_segment))
    return "".join(out), len(tokens)


@dataclass
class Job:
    """One generation request. Events reach ``out`` (an asyncio queue) as tuples:
    ("text", str, n_tokens), then ("done", finish_reason, stats dict) or ("error", status, message).
    A finish of "timeout" or "shutdown" is a reply cut short (the routes answer it as an error)."""

    ids: List[int]
    gen: Dict[str, Any]
    stops: Sequence[str]
    timeout: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    started: Optional[float] = None
    cached_tokens: Optional[int] = None  # prompt tokens restored from the prefix cache, once prefilled
    delivered: bool = False  # its last event reached the route

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


def _stats_dict(stats, prompt_tokens: int = 0) -> Dict[str, Any]:
    """A job's counts for its "done" event; a job that never ran has only its prompt."""
    if stats is None:
        return {
            "prompt_tokens": prompt_tokens,
            "generated_tokens": 0,
            "cached_tokens": 0,
            "cycles": 0,
            "tau": 0.0,
            "decode_tps": 0.0,
        }
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "cached_tokens": int(getattr(stats, "cached_tokens", 0) or 0),
        "cycles": stats.cycles,
        "tau": stats.tau,
        "decode_tps": stats.decode_tps,
    }


@dataclass
class _Slot:
    """A job in the batch: its own detokenizer, stop strings and latest stats."""

    job: Job
    detok: Any
    stops: StopMatcher
    stats: Any = None
    tokens: List[int] = field(default_factory=list)  # what it committed so far
    seed: Optional[int] = None  # its sampler's seed, kept when it resumes
    resumed: Optional[int] = None  # once resumed alone after a failed step: the tokens it had then
    cached: int = 0  # then: the prompt tokens its first run restored (the resumed run's count its own output)


class Worker:
    """Owns the engine; runs queued jobs in arrival order on one thread,
    one at a time or (``max_batch`` > 1, None: up to ``DEFAULT_MAX_BATCH``
    as memory allows) together in a batch."""

    def __init__(
        self,
        load_engine: Callable[[], Any],
        *,
        max_queue: int,
        metrics: Metrics,
        generate_fn: Optional[Callable] = None,
        prompt_cache_bytes: Optional[int] = None,
        prompt_cache: bool = True,
        max_batch: Optional[int] = 1,
        generation=None,
    ):
        if max_batch is not None and max_batch < 1:
            raise DFlashError(f"--max-batch must be at least 1, got {max_batch}")
        self._load = load_engine
        self._q: queue.Queue[Optional[Job]] = queue.Queue(maxsize=max_queue)
        self.metrics = metrics
        self.engine = None
        self.prefix_cache = None
        self.running: Optional[Job] = None  # the job running alone
        self.slots: Dict[int, _Slot] = {}  # the batch's jobs by request index
        self.resuming: List[_Slot] = []  # the jobs of a failed batched step, to run again one at a time
        self._asked = max_batch
        self.max_batch = max_batch or DEFAULT_MAX_BATCH
        self._generation = generation  # the server's defaults: KV format and context of a slot
        self._stopping = False
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name="mlx-dflash-engine", daemon=True)
        self._generate = generate_fn
        self._cache_bytes, self._use_cache = prompt_cache_bytes, prompt_cache

    # --- lifecycle ---------------------------------------------------------------
    def start(self):
        """Load the engine on the generation thread; raise its load error here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.engine

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stopping = True
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass
            if self.running is not None:
                self.running.cancel()
            self._thread.join(timeout=10)

    def cancel_all(self) -> None:
        """The server is shutting down: no new job starts, running ones end at
        their next cycle boundary (finish "shutdown", after their text so
        far), queued ones now (a 503), each with a last event: a stream ends
        with an error its client reads, not a cut connection nor a reply
        that looks finished."""
        self._stopping = True
        with self._q.mutex:
            queued = [j for j in self._q.queue if j is not None]
            self._q.queue.clear()
        for job in queued:
            job.cancel()
            job.send("error", 503, SHUTDOWN)
        job = self.running  # a batch's slots are ended by its loop once it sees _stopping
        if job is not None:
            job.cancel()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_length(self) -> int:
        self._drop_cancelled()
        return self._q.qsize()

    @property
    def running_count(self) -> int:
        return len(self.slots) + (self.running is not None)

    def submit(self, job: Job) -> None:
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self._drop_cancelled()
            try:
                self._q.put_nowait(job)
            except queue.Full:
                raise QueueFull() from None

    def _drop_cancelled(self) -> None:
        """Queued jobs whose client went away leave the queue now: their
        places would turn live clients away (429) until the engine reached them."""
        with self._q.mutex:
            live = [j for j in self._q.queue if j is None or not j.cancelled.is_set()]
            if len(live) < len(self._q.queue):
                self._q.queue.clear()
                self._q.queue.extend(live)
                self._q.not_full.notify_all()

    # --- the generation thread ---------------------------------------------------
    def _main(self) -> None:
        try:
            self._serve()
        finally:
            import mlx.core as mx

            # MLX's streams of a thread are destroyed when it ends, not at
            # process exit, when that aborts ("terminate called ...", exit 134).
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            from ..api import stream_generate

            self.engine = self._load()
            self._generate = self._generate or stream_generate
            self.prefix_cache = self._make_prefix_cache()
            if self.prefix_cache is not None:  # a budget under one snapshot would fail every request
                self.prefix_cache.check_budget(self.engine.target, getattr(self._generation, "kv_bits", None))
            if self.max_batch > 1:
                self._check_batch()
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self.metrics.max_slots = self.max_batch
        self._ready.set()
        if self.max_batch > 1:
            self._batch_main()
            return
        while True:
            job = self._q.get()
            if job is None:
                return
            self._run_alone(job)

    def _run_alone(self, job: Job) -> None:
        self.running = job
        try:
            self._run(job)
        except Exception as e:  # never let one request kill the engine thread
            log.exception("generation failed")
            job.send("error", 500, f"generation failed: {type(e).__name__}: {e}")
        finally:
            self.running = None

    def _make_prefix_cache(self):
        """One prefix cache for every request: a client resending its history prefills only the new part."""
        from ..prefix import PrefixCache

        return PrefixCache(max_bytes=self._cache_bytes) if self._use_cache else None

    def _check_batch(self) -> None:
        """Refuse (or, for the default, lower) a max_batch the batch cannot
        run: a verify shape it does not take, or more slots than memory holds."""
        import mlx.core as mx

        from ..batch import BatchDecoder, slot_bytes
        from ..config import GenerationConfig
        from ..prefix import device_memory

        eng = self.engine
        gen = self._generation or GenerationConfig()
        if eng.stage is not None:
            raise DFlashError("--max-batch > 1 does not run on a pipeline-split target (--pipeline); use --max-batch 1")
        try:
            BatchDecoder(eng.target, eng.draft, max_batch=2).add([0], gen)
        except DFlashError as e:
            if self._asked is not None:
                raise DFlashError(f"--max-batch {self._asked}: {e}; use --max-batch 1") from None
            log.warning("serving one request at a time (--max-batch 1): %s", e)
            self.max_batch = 1
            return
        context = gen.max_context or eng.target.max_context
        per = slot_bytes(eng.target, eng.draft, context=context, kv_bits=gen.kv_bits, draft_window=gen.draft_window)
        total = device_memory()
        held = mx.get_active_memory()  # the weights, loaded
        budget = self.prefix_cache.max_bytes if self.prefix_cache is not None else 0
        room = total - held - budget
        fits = max(0, room // max(per, 1))
        if self.max_batch <= fits:
            return
        if self._asked is None:
            self.max_batch = max(1, int(min(DEFAULT_MAX_BATCH, fits)))
            log.warning("--max-batch %d (the default, %d, does not fit in memory)", self.max_batch, DEFAULT_MAX_BATCH)
            return
        raise DFlashError(
            f"--max-batch {self.max_batch} does not fit in memory: a slot may hold {per / 1e6:.1f} MB "
            f"(attention KV for {context} tokens, the DeltaNet state and the draft's context), "
            f"{self.max_batch * per / 1e9:.2f} GB for {self.max_batch} slots, and "
            f"{max(room, 0) / 1e9:.2f} GB is left of {total / 1e9:.2f} GB after the weights "
            f"({held / 1e9:.2f} GB) and the prefix cache budget ({budget / 1e9:.2f} GB): "
            f"at most {fits} slots fit (lower --max-batch or --prompt-cache-bytes"
            + (")" if gen.kv_bits == 4 else ", or use --kv-bits 4)" if gen.kv_bits else ", or use --kv-bits)")
        )

    def _stop_reason(self, job: Job) -> Optional[str]:
        """Why ``job`` must stop now, if it must: "shutdown" (the server is
        stopping), "cancelled" (its client went away) or "timeout"."""
        if job.cancelled.is_set():
            return "shutdown" if self._stopping else "cancelled"
        if time.monotonic() - job.arrived > job.timeout:
            return "timeout"
        return None

    def _answered_in_queue(self, job: Job) -> bool:
        """Answer a job that must stop before it starts; True if it was."""
        reason = self._stop_reason(job)
        if reason == "cancelled":
            job.send("done", "cancelled", _stats_dict(None, len(job.ids)))
        elif reason == "shutdown":
            job.send("error", 503, SHUTDOWN)
        elif reason == "timeout":
            job.send("error", 504, f"request timed out after {job.timeout:g} s in the queue")
        return reason is not None

    def _run(self, job: Job) -> None:
        if self._answered_in_queue(job):
            return
        now = time.monotonic()
        job.started = now
        self.metrics.record_queue_wait(now - job.arrived)
        kwargs = dict(job.gen)
        if self.prefix_cache is not None:
            kwargs["prefix_cache"] = self.prefix_cache

        def between_chunks(done: int, total: int) -> None:  # a long prefill stops when its client does
            reason = self._stop_reason(job)
            if reason is not None:
                raise _Stopped(reason)

        kwargs["prompt_progress_callback"] = between_chunks
        stops = StopMatcher(job.stops)
        # Its own detokenizer over the tokens (the text stream_generate gives),
        # token by token, so a stop string ends the count where it ends the text.
        detok, eos = Detokenizer(self.engine.tokenizer), self.engine.tokenizer.eos_token_ids
        gen = self._generate(self.engine, job.ids, **kwargs)
        stats, finish, generated = None, None, 0
        try:
            for r in gen:
                stats = r.stats
                if job.cached_tokens is None:  # set before the first event is sent
                    job.cached_tokens = int(getattr(stats, "cached_tokens", 0) or 0)
                text, used = feed_tokens(detok, stops, r.tokens, eos, r.finish_reason is not None)
                generated += used
                if text or used:
                    job.send("text", text, used)
                if stops.hit:
                    finish = "stop"
                    break
                if r.finish_reason is not None:
                    finish = r.finish_reason
                    break
                finish = self._stop_reason(job)
                if finish is not None:
                    break
        except _Stopped as e:
            finish = e.args[0]
        except DFlashError as e:
            job.send("error", 400, str(e))
            return
        finally:
            gen.close()  # stops the decode loop now; the engine is free for the next job
        self._done(job, stops, stats, finish, generated=generated if stops.hit else None)

    def _done(
        self,
        job: Job,
        stops: StopMatcher,
        stats,
        finish: Optional[str],
        resumed: int = 0,
        generated: Optional[int] = None,
        cached: Optional[int] = None,
    ) -> None:
        """The rest of the text (held for a stop string that did not come) and
        the "done" event. ``resumed``: tokens committed before the run that
        ``stats`` describe (a resumed request's prompt held them);
        ``generated``: the tokens it handed out, where ``stats`` do not count
        them (a stop string's cut: the cycle may have committed more; a resume)."""
        if finish in (None, "stop", "length") and not stops.hit:
            rest = stops.flush()
            if rest:
                job.send("text", rest, 0)
        d = _stats_dict(stats, len(job.ids))
        if stats is not None:
            d["prompt_tokens"] -= resumed
        if cached is not None:
            d["cached_tokens"] = cached
        if generated is not None:
            d["generated_tokens"] = generated
        d["stop_sequence"] = stops.matched
        self.metrics.record_generation(d, self.prefix_cache)
        job.send("done", finish or "stop", d)

    # --- the batch -------------------------------------------------------------------
    def _new_batch(self):
        from ..batch import BatchDecoder

        eng = self.engine
        if self.prefix_cache is not None:
            self.prefix_cache.bind(eng)  # as stream_generate does
        return BatchDecoder(
            eng.target,
            eng.draft,
            max_batch=self.max_batch,
            eos_token_ids=eng.tokenizer.eos_token_ids,
            prefix_cache=self.prefix_cache,
        )

    def _batch_main(self) -> None:
        batch = self._new_batch()
        held: Optional[Job] = None  # a job the batch does not take: it runs once the batch drains
        while True:
            while len(self.slots) < self.max_batch and not self._stopping:
                # A failed step's requests run again one at a time, alone, before any other.
                if self.resuming or any(s.resumed is not None for s in self.slots.values()):
                    if self.resuming and not self.slots:
                        self._resume(batch, self.resuming.pop(0))
                    break
                if held is not None:
                    job, held = held, None
                elif self.slots:
                    try:
                        job = self._q.get_nowait()
                    except queue.Empty:
                        break
                else:
                    job = self._q.get()
                if job is None:
                    break
                try:
                    taken = self._admit(batch, job)
                except Exception as e:  # never let one request kill the engine thread
                    log.exception("admission failed")
                    job.send("error", 500, f"generation failed: {type(e).__name__}: {e}")
                    taken = True
                if not taken:
                    if self.slots:
                        held = job
                        break
                    self._run_alone(job)
            if self._stopping:
                for index in list(self.slots):
                    batch.cancel(index)
                    self._leave(index, "shutdown")
                for slot in self.resuming:
                    self._done(slot.job, slot.stops, slot.stats, "shutdown")
                return
            if not self.slots:
                continue
            for index, slot in list(self.slots.items()):
                reason = self._stop_reason(slot.job)
                if reason is None:
                    continue
                ev = batch.cancel(index)  # frees the slot for the next step
                if ev is not None:
                    slot.stats = ev.stats
                self._leave(index, reason)
            if not self.slots:
                continue
            self.metrics.record_batch_step(len(self.slots))
            try:
                for ev in batch.step():
                    self._deliver(batch, ev)
            except Exception as e:  # a failed step leaves the batch's state unknown
                batch = self._failed_step(batch, e)

    def _failed_step(self, batch, error: Exception):
        """After a batched step raised, its requests resume from what they
        had committed, one at a time: their tokens are a function of their
        history and of (seed, position), so a fault of the batch (memory,
        say) costs them nothing; a request that fails again alone gets the
        500. Returns a fresh batch."""
        log.exception("batched generation failed")
        seeds = {index: d.sampler.seed for index, d, *_ in (*batch.active, *batch.prefilling)}
        for index, slot in self.slots.items():
            if slot.resumed is not None:  # it failed running alone: the fault is its own
                slot.job.send("error", 500, f"generation failed: {type(error).__name__}: {error}")
            else:
                # a request not yet prefilling has no sampler: its own seed (None: it drew nothing yet)
                slot.seed = seeds.get(index, slot.job.gen["config"].seed)
                self.resuming.append(slot)
        self.slots.clear()
        return self._new_batch()

    def _resume(self, batch, slot: _Slot) -> None:
        """Run a failed step's request again from its prompt and the tokens
        it committed, its stream and stop strings carrying on."""
        job, n = slot.job, len(slot.tokens)
        config = job.gen["config"]
        config = dataclasses.replace(config, max_tokens=config.max_tokens - n, seed=slot.seed)
        try:
            index = batch.add(job.ids + slot.tokens, config, prefix_boundary=self._boundary(job))
        except Exception as e:
            log.exception("resuming a request failed")
            job.send("error", 500, f"generation failed: {type(e).__name__}: {e}")
            return
        slot.cached = int(getattr(slot.stats, "cached_tokens", 0) or 0) if slot.stats is not None else 0
        slot.resumed, slot.stats = n, None  # its stats now count from the resumed run
        self.slots[index] = slot

    def _admit(self, batch, job: Job) -> bool:
        """Add ``job`` to the batch (or answer it now); False if the batch
        does not take its options while others run."""
        from ..decode import check_prompt

        if self._answered_in_queue(job):
            return True
        now = time.monotonic()
        eng = self.engine
        config = job.gen["config"]
        try:
            config.validate(None if config.baseline else eng.draft)
            check_prompt(eng.target, job.ids, config)
        except DFlashError as e:
            job.send("error", 400, str(e))
            return True
        try:
            index = batch.add(job.ids, config, prefix_boundary=self._boundary(job))
        except DFlashError:
            return False
        job.started = now
        self.metrics.record_queue_wait(now - job.arrived)
        detok = Detokenizer(eng.tokenizer)
        self.slots[index] = _Slot(job, detok, StopMatcher(job.stops))
        return True

    def _boundary(self, job: Job) -> Optional[int]:
        """The job's stable prompt boundary for the prefix cache (None without one)."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.stable_boundary(self.engine.tokenizer, job.ids, job.gen.get("chat_template_config"))

    def _deliver(self, batch, ev) -> None:
        """A request's tokens from one step: its text (through its stop
        strings) to its client, and its end when it finished."""
        slot = self.slots.get(ev.index)
        if slot is None:
            return
        if ev.error is not None:  # its own prefill failed; the batch goes on without it
            self.slots.pop(ev.index)
            e = ev.error
            log.error("a request's prefill failed: %s: %s", type(e).__name__, e)
            if isinstance(e, DFlashError):
                slot.job.send("error", 400, str(e))
            else:
                slot.job.send("error", 500, f"generation failed: {type(e).__name__}: {e}")
            return
        job, slot.stats = slot.job, ev.stats
        if job.cached_tokens is None:  # set before the first event is sent
            job.cached_tokens = int(ev.stats.cached_tokens or 0)
        eos = self.engine.tokenizer.eos_token_ids
        text, used = feed_tokens(slot.detok, slot.stops, ev.tokens, eos, ev.finish_reason is not None)
        slot.tokens += ev.tokens[:used]
        if text or used:
            job.send("text", text, used)
        if slot.stops.hit:
            if ev.finish_reason is None:
                batch.cancel(ev.index)  # the slot is free for the next step
            self._leave(ev.index, "stop")
        elif ev.finish_reason is not None:
            self._leave(ev.index, ev.finish_reason)

    def _leave(self, index: int, finish: str) -> None:
        slot = self.slots.pop(index)
        # What it handed out: a stop string's cut, or its tokens across a resume.
        generated = len(slot.tokens) if slot.stops.hit or slot.resumed is not None else None
        cached = slot.cached if slot.resumed is not None else None
        self._done(slot.job, slot.stops, slot.stats, finish, slot.resumed or 0, generated, cached)
