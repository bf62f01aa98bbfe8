"""Server counters, rendered in the Prometheus text exposition format."""

import threading
from collections import Counter
from typing import Any, Callable, Dict


def _prefix_cache_bytes(pc) -> int:
    if pc is None:
        return 0
    return int(getattr(pc, "nbytes", 0))


# Upper bounds (seconds) of the queue-wait histogram's buckets.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms are exposed."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def samples(self):
        out = [(f'_bucket{{le="{b:g}"}}', n) for b, n in zip(self.bounds, self.counts)]
        out.append(('_bucket{le="+Inf"}', self.count))
        return out + [("_sum", f"{self.sum:.6f}"), ("_count", self.count)]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.cache_lookups = 0
        self.cache_hits = 0
        self.cycles = 0
        self.cycle_tokens = 0.0  # tokens committed by verify cycles (tau numerator)
        self.last_decode_tps = 0.0
        self.cancelled = 0
        self.queue_length: Callable[[], int] = lambda: 0
        self.running: Callable[[], int] = lambda: 0
        self.cache_bytes = 0
        self.max_slots = 1  # --max-batch
        self.queue_wait = Histogram(WAIT_BUCKETS)  # seconds from arrival to admission
        self.slots_per_step: Histogram = Histogram(range(1, 2))  # set by max_slots at the first step

    def record_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def record_generation(self, d: Dict[str, Any], prefix_cache=None) -> None:
        with self._lock:
            self.prompt_tokens += d["prompt_tokens"]
            self.generated_tokens += d["generated_tokens"]
            self.cached_tokens += d["cached_tokens"]
            if prefix_cache is not None and d["generated_tokens"]:  # prefilled, so looked up
                self.cache_lookups += 1
                self.cache_hits += d["cached_tokens"] > 0
            self.cycles += d["cycles"]
            self.cycle_tokens += d["tau"] * d["cycles"]
            if d["decode_tps"]:
                self.last_decode_tps = d["decode_tps"]
            # read here, on the engine thread that changes the cache
            self.cache_bytes = _prefix_cache_bytes(prefix_cache)

    def record_queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait.observe(seconds)

    def record_batch_step(self, slots: int) -> None:
        """Requests in the batch (decoding or prefilling) at one step."""
        with self._lock:
            if self.slots_per_step.bounds[-1] != self.max_slots:
                self.slots_per_step = Histogram(range(1, self.max_slots + 1))
            self.slots_per_step.observe(slots)

    def record_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self) -> str:
        with self._lock:
            out = []

            def metric(name, kind, help_, samples):
                out.append(f"# HELP mlx_dflash_{name} {help_}")
                out.append(f"# TYPE mlx_dflash_{name} {kind}")
                for labels, v in samples:
                    out.append(f"mlx_dflash_{name}{labels} {v}")

            metric(
                "requests_total",
                "counter",
                "HTTP requests by endpoint and status.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
            )
            metric(
                "prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [("", self.prompt_tokens)]
            )
            metric("generation_tokens_total", "counter", "Generated tokens.", [("", self.generated_tokens)])
            metric(
                "cancelled_total",
                "counter",
                "Generations stopped because the client went away.",
                [("", self.cancelled)],
            )
            metric("decode_cycles_total", "counter", "Draft/verify cycles.", [("", self.cycles)])
            tau = self.cycle_tokens / self.cycles if self.cycles else 0.0
            metric("tau", "gauge", "Mean tokens committed per cycle since start.", [("", f"{tau:.4f}")])
            metric(
                "decode_tokens_per_second",
                "gauge",
                "Decode speed of the last finished generation.",
                [("", f"{self.last_decode_tps:.2f}")],
            )
            metric(
                "prefix_cache_lookups_total",
                "counter",
                "Generations that looked up the prefix cache.",
                [("", self.cache_lookups)],
            )
            metric(
                "prefix_cache_hits_total",
                "counter",
                "Generations that reused a cached prefix.",
                [("", self.cache_hits)],
            )
            metric(
                "prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                [("", self.cached_tokens)],
            )
            metric("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", [("", self.cache_bytes)])
            metric("queue_length", "gauge", "Requests waiting for the engine.", [("", self.queue_length())])
            metric("running_requests", "gauge", "Requests being generated (up to --max-batch).", [("", self.running())])
            metric("batch_slots_max", "gauge", "Slots of the batch (--max-batch).", [("", self.max_slots)])
            metric(
                "batch_slots_active",
                "gauge",
                "Slots taken now (requests decoding or prefilling).",
                [("", self.running())],
            )
            metric(
                "batch_slots_per_step",
                "histogram",
                "Slots taken at each batch step (--max-batch > 1).",
                self.slots_per_step.samples(),
            )
            metric(
                "queue_wait_seconds",
                "histogram",
                "Seconds from a request's arrival to its admission to the engine.",
                self.queue_wait.samples(),
            )
            return "\n".join(out) + "\n"
