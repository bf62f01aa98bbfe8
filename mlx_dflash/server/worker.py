"""One engine, many clients: a generation thread fed by a bounded arrival-order queue.

The engine runs one request at a time on its own thread (MLX work stays on
one thread and the event loop stays free for other clients). After every
committed block the thread checks whether the request was cancelled (the
client went away) or ran past its deadline, and if so closes the
``stream_generate`` generator, so the engine is free within one cycle.
"""

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import DFlashError
from .metrics import Metrics

log = logging.getLogger("mlx_dflash.server")


class QueueFull(Exception):
    pass


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


@dataclass
class Job:
    """One generation request. Events reach ``out`` (an asyncio queue) as tuples:
    ("text", str, n_tokens), then ("done", finish_reason, stats dict) or ("error", status, message)."""

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

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


def _stats_dict(stats) -> Dict[str, Any]:
    if stats is None:
        return {
            "prompt_tokens": 0,
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


class Worker:
    """Owns the engine; runs queued jobs in arrival order on one thread."""

    def __init__(
        self,
        load_engine: Callable[[], Any],
        *,
        max_queue: int,
        metrics: Metrics,
        generate_fn: Optional[Callable] = None,
        prompt_cache_bytes: Optional[int] = None,
        prompt_cache: bool = True,
    ):
        self._load = load_engine
        self._q: queue.Queue[Optional[Job]] = queue.Queue(maxsize=max_queue)
        self.metrics = metrics
        self.engine = None
        self.prefix_cache = None
        self.running: Optional[Job] = None
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
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass
            if self.running is not None:
                self.running.cancel()
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_length(self) -> int:
        return self._q.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    # --- the generation thread ---------------------------------------------------
    def _main(self) -> None:
        try:
            from ..api import stream_generate

            self.engine = self._load()
            self._generate = self._generate or stream_generate
            self.prefix_cache = self._make_prefix_cache()
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._q.get()
            if job is None:
                return
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

    def _run(self, job: Job) -> None:
        now = time.monotonic()
        if job.cancelled.is_set():
            job.send("done", "cancelled", _stats_dict(None))
            return
        if now - job.arrived > job.timeout:
            job.send("error", 504, f"request timed out after {job.timeout:g} s in the queue")
            return
        job.started = now
        kwargs = dict(job.gen)
        if self.prefix_cache is not None:
            kwargs["prefix_cache"] = self.prefix_cache
        stops = StopMatcher(job.stops)
        gen = self._generate(self.engine, job.ids, **kwargs)
        stats, finish = None, None
        try:
            for r in gen:
                stats = r.stats
                if job.cached_tokens is None:  # set before the first event is sent
                    job.cached_tokens = int(getattr(stats, "cached_tokens", 0) or 0)
                text = stops.feed(r.text)
                if text or r.tokens:
                    job.send("text", text, len(r.tokens))
                if stops.hit:
                    finish = "stop"
                    break
                if r.finish_reason is not None:
                    finish = r.finish_reason
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if time.monotonic() - job.arrived > job.timeout:
                    finish = "timeout"
                    break
        except DFlashError as e:
            job.send("error", 400, str(e))
            return
        finally:
            gen.close()  # stops the decode loop now; the engine is free for the next job
        if finish in (None, "stop", "length") and not stops.hit:
            rest = stops.flush()
            if rest:
                job.send("text", rest, 0)
        d = _stats_dict(stats)
        d["stop_sequence"] = stops.matched
        self.metrics.record_generation(d, self.prefix_cache)
        job.send("done", finish or "stop", d)
