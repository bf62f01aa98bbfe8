"""Concurrent requests three ways, in ONE process, runs alternating.

    python bench/batch.py [-c 1 2 4 8] [--max-tokens 128] [--rounds 3]

On the embedded pair (``mlx_dflash.load()``), C requests arrive at t = 0,
each with its own prompt (the 6 shipped bench prompts, then 2 more below),
all with the same ``max_tokens``, greedy:

- ``mlx-lm``: mlx-lm's own continuous batching (``BatchGenerator``, batch of
  C) of plain decoding, on the same target folder loaded by ``mlx_lm.load``
  and cast to float32 as ``mlx_dflash.load()`` casts it;
- ``one-at-a-time``: today's server, requests one after another through
  ``mlx_dflash.stream_generate`` (request i's wait for the ones before it is
  part of its time to first token);
- ``batched``: ``mlx_dflash.BatchDecoder`` with ``max_batch`` = C.

Each round runs the three (alternating their order round by round, so drift
on a shared machine hits all alike); reported are medians over rounds of the
aggregate tok/s (tokens generated / wall time to the last finish), each
request's time to first token and latency (median and max over requests),
and the within-round ratios. Batched and one-at-a-time must give each
request the same tokens (checked every round; the script exits 1 after
writing the results if not); agreement with mlx-lm is counted. Memory per
slot is measured after the rounds. Writes bench/results/batch.{md,json}.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "batch"
SYSTEMS = ("mlx-lm", "one-at-a-time", "batched")

# Two more prompts in the style of the shipped ones, so 8 requests differ.
EXTRA_PROMPTS = {
    "code_stack": 'class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):\n',
    "doc_merge": (
        "def merge_sorted(a, b):\n"
        '    """Merge two sorted lists into one sorted list.\n\n'
        "    Both inputs are left unchanged.\n"
        '    """\n'
    ),
}


def bench_prompts(engine, n: int):
    """``n`` distinct prompts: (name, token ids)."""
    from mlx_dflash.benchmark import read_prompts

    texts = list(read_prompts().items()) + list(EXTRA_PROMPTS.items())
    if n > len(texts):
        raise SystemExit(f"at most {len(texts)} distinct prompts; asked for {n}")
    return [(name, engine.encode(text)) for name, text in texts[:n]]


class Clock:
    """Per-request first-token and finish times, from a common t = 0."""

    def __init__(self, n: int):
        self.t0 = time.perf_counter()
        self.first = [None] * n
        self.done = [None] * n
        self.tokens = [[] for _ in range(n)]

    def add(self, i: int, tokens, finished: bool) -> None:
        now = time.perf_counter() - self.t0
        if tokens:
            self.tokens[i].extend(tokens)
            if self.first[i] is None:
                self.first[i] = now
        if finished:
            self.done[i] = now

    def result(self, **extra) -> dict:
        wall = max(self.done)
        n = sum(len(t) for t in self.tokens)
        return dict(tokens=self.tokens, ttft=self.first, latency=self.done, wall=wall, tok_s=n / wall, **extra)


def run_mlx_lm(model, eos, prompts, max_tokens: int, c: int) -> dict:
    """mlx-lm's BatchGenerator, C requests inserted at t = 0."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    mx.reset_peak_memory()
    clock = Clock(len(prompts))
    gen = BatchGenerator(
        model, stop_tokens=[[t] for t in eos], max_tokens=max_tokens, completion_batch_size=c, prefill_batch_size=c
    )
    uids = gen.insert([ids for _, ids in prompts], [max_tokens] * len(prompts))
    where = {u: i for i, u in enumerate(uids)}
    left = len(prompts)
    while left:
        for r in gen.next_generated():
            clock.add(where[r.uid], [r.token], r.finish_reason is not None)
            left -= r.finish_reason is not None
    gen.close()
    return clock.result(peak_gb=mx.get_peak_memory() / 1e9)


def run_one_at_a_time(engine, prompts, max_tokens: int, **options) -> dict:
    """Requests one after another through stream_generate (today's server;
    ``options`` for it, e.g. adaptive=False)."""
    import mlx.core as mx

    import mlx_dflash

    mx.reset_peak_memory()
    clock = Clock(len(prompts))
    taus = []
    for i, (_, ids) in enumerate(prompts):
        for r in mlx_dflash.stream_generate(engine, ids, max_tokens=max_tokens, **options):
            clock.add(i, r.tokens, r.finish_reason is not None)
        taus.append(r.stats.tau)
    return clock.result(peak_gb=mx.get_peak_memory() / 1e9, tau=statistics.mean(taus))


def run_batched(engine, prompts, max_tokens: int, c: int, keep=None, block_size=None) -> dict:
    """BatchDecoder with max_batch = C, every request added at t = 0, its
    width ``block_size`` (None: the draft's). ``keep``: a dict that receives
    each request's Decoder (for its caches)."""
    import mlx.core as mx

    from mlx_dflash import BatchDecoder

    clock = Clock(len(prompts))
    batch = BatchDecoder(engine.target, engine.draft, max_batch=c, eos_token_ids=engine.tokenizer.eos_token_ids)
    for _, ids in prompts:
        batch.add(ids, max_tokens=max_tokens, block_size=block_size)
    stats = {}
    while not batch.done:
        for ev in batch.step():
            clock.add(ev.index, ev.tokens, ev.finish_reason is not None)
            stats[ev.index] = ev.stats
        if keep is not None:
            keep.update({i: d for i, d in batch.active})
    st = list(stats.values())
    return clock.result(
        peak_gb=mx.get_peak_memory() / 1e9,  # BatchDecoder resets the peak when made
        tau=statistics.mean(s.tau for s in st),
        cycles=max(s.cycles for s in st),
        # every request's split is the batch's, for the cycles it took part in
        draft_s=max(s.draft_time for s in st),
        verify_s=max(s.verify_time for s in st),
        rollback_s=max(s.rollback_time for s in st),
    )


def summary(run: dict) -> dict:
    med = statistics.median
    return {
        "tok_s": run["tok_s"],
        "wall_s": run["wall"],
        "ttft_median_s": med(run["ttft"]),
        "ttft_max_s": max(run["ttft"]),
        "latency_median_s": med(run["latency"]),
        "latency_max_s": max(run["latency"]),
        "peak_gb": run["peak_gb"],
        "ttft_s": run["ttft"],
        "latency_s": run["latency"],
        **{k: run[k] for k in ("tau", "cycles", "draft_s", "verify_s", "rollback_s") if k in run},
    }


def slot_memory(engine, prompts, max_tokens: int) -> dict:
    """Bytes one slot holds at its last cycle (target cache, draft context),
    and the batch's peak memory per added slot (one slot first, then all).
    ``max_tokens`` > the draft's block + 1, so each slot is seen between cycles."""
    c = len(prompts)
    one = run_batched(engine, prompts[:1], max_tokens, 1)
    keep = {}
    run = run_batched(engine, prompts, max_tokens, c, keep)
    per = []
    for i, d in sorted(keep.items()):
        target = sum(layer.nbytes() for layer in d.cache.layers)
        per.append(
            {
                "prompt": prompts[i][0],
                "context": d.pos,
                "target_bytes": target,
                "attention_kv_bytes": d.cache.kv_nbytes(),
                "recurrent_bytes": target - d.cache.kv_nbytes(),
                "draft_bytes": d.dcache.nbytes() if d.dcache is not None else 0,
            }
        )
    return {
        "slots": c,
        "max_tokens": max_tokens,
        "per_slot": per,
        "peak_gb": run["peak_gb"],
        "peak_gb_one_slot": one["peak_gb"],
        "peak_per_added_slot_mb": (run["peak_gb"] - one["peak_gb"]) * 1e3 / (c - 1) if c > 1 else None,
    }


def profile(engine, prompts, max_tokens: int, rounds: int, log=print) -> dict:
    """Where a batched cycle's time goes, against the same work done one
    slot at a time: synchronised, isolated forwards (the draft's block for
    every slot, the target's verify of every slot's block, the rollback) for
    S slots at once and for each slot alone, alternating; the batch's real
    ms per cycle beside them (its excess over the forwards is host work);
    and at concurrency 1 the batch beside ``stream_generate`` adaptive and
    pinned to the batch's width (adaptive=False), for the width policy's share."""
    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash import BatchDecoder
    from mlx_dflash.cache import SlotBatch
    from mlx_dflash.models.draft import propose, propose_slots

    target, draft = engine.target, engine.draft
    eos = engine.tokenizer.eos_token_ids
    S = len(prompts)
    batch = BatchDecoder(target, draft, max_batch=S, eos_token_ids=eos)
    for _, ids in prompts:
        batch.add(ids, max_tokens=max_tokens + 4 * rounds * 16)
    while len(batch.active) < S:
        batch.step()
    ds = [d for _, d in batch.active]
    W = ds[0].stats.block_size

    def timed(fn):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def draft_batched():
        items = [(d.draft_context(), d.anchor, d.pos, d.dcache, d.sampler, d.spec) for d in ds]
        mx.eval([t for t, _ in propose_slots(draft, items, W)])

    def draft_solo():
        for d in ds:
            mx.eval(propose(draft, d.draft_context(), d.anchor, d.pos, W, d.dcache, d.sampler, d.spec)[0])

    def block(group):
        return mx.array([[d.anchor] * W for d in group], dtype=mx.int32)

    def verify_batched():
        slots = SlotBatch([d.cache for d in ds])
        vf = timed(lambda: mx.eval(*target.forward_slots(block(ds), slots, capture=ds[0].capture, record=True)))
        return vf, timed(lambda: (slots.rollback([keep] * S), mx.eval(slots.state())))

    def verify_solo():
        vf = rb = 0.0
        for d in ds:
            vf += timed(lambda: mx.eval(*target.forward(block([d])[0], d.cache, capture=d.capture, record=True)))
            rb += timed(lambda: (d.cache.rollback(keep), mx.eval(d.cache.state())))
        return vf, rb

    name, ids = prompts[0]
    one = {}
    runs = {
        "adaptive": lambda: run_one_at_a_time(engine, prompts[:1], max_tokens),
        "pinned": lambda: _pinned(mlx_dflash, engine, ids, max_tokens),
        "batched pinned": lambda: run_batched(engine, prompts[:1], max_tokens, 1, block_size=W),
        "batched": lambda: run_batched(engine, prompts[:1], max_tokens, 1),
    }
    acc = {k: [] for k in ("draft_b", "draft_s", "verify_b", "verify_s", "rollback_b", "rollback_s", "cycle_ms")}
    for k in runs:  # warm-up
        runs[k]()
    # each rollback keeps what a cycle of the batch keeps on average (its tau)
    keep = min(W, max(1, round(run_batched(engine, prompts, max_tokens, S, block_size=W)["tau"])))
    draft_batched(), draft_solo(), verify_batched(), verify_solo()
    for r in range(rounds):
        acc["draft_b"].append(timed(draft_batched))
        acc["draft_s"].append(timed(draft_solo))
        (vb, rb), (vs, rs) = verify_batched(), verify_solo()
        acc["verify_b"].append(vb), acc["rollback_b"].append(rb)
        acc["verify_s"].append(vs), acc["rollback_s"].append(rs)
        run = run_batched(engine, prompts, max_tokens, S, block_size=W)  # pinned: the width timed above
        # the first step (every prefill and the first cycle) ends at the last first token
        acc["cycle_ms"].append((run["wall"] - max(run["ttft"])) / max(run["cycles"] - 1, 1) * 1e3)
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for k in order:
            one.setdefault(k, []).append(runs[k]()["tok_s"])
    med = statistics.median
    out = {k: med(v) for k, v in acc.items()}
    out.update(slots=S, width=W, kept=keep, prompt=name, tok_s_c1={k: med(v) for k, v in one.items()})
    out["c1_batched_over_pinned"] = med(b / p for b, p in zip(one["batched pinned"], one["pinned"]))
    out["c1_batched_over_adaptive"] = med(b / a for b, a in zip(one["batched"], one["adaptive"]))
    out["c1_pinned_over_adaptive"] = med(p / a for p, a in zip(one["pinned"], one["adaptive"]))
    log(f"profile: {out}")
    return out


def _pinned(mlx_dflash, engine, ids, max_tokens: int) -> dict:
    """One request through stream_generate at the draft's full width (no adaptive policy)."""
    clock = Clock(1)
    for r in mlx_dflash.stream_generate(engine, ids, max_tokens=max_tokens, adaptive=False):
        clock.add(0, r.tokens, r.finish_reason is not None)
    return clock.result(peak_gb=0.0)


def measure(
    engine,
    model,
    concurrencies,
    max_tokens: int,
    rounds: int,
    profile_slots: int = 0,
    warmup: bool = True,
    memory_tokens: int = 128,
    solo_options: Optional[dict] = None,
    block_size: Optional[int] = None,
    log=print,
) -> dict:
    """Every concurrency, ``rounds`` alternating rounds of the three systems,
    then memory per slot (``memory_tokens`` per request) and the profile.
    ``solo_options``: extra stream_generate options of one-at-a-time;
    ``block_size``: the batch's verify width (None: the draft's block)."""
    eos = engine.tokenizer.eos_token_ids
    runners = {
        "mlx-lm": lambda p, c: run_mlx_lm(model, eos, p, max_tokens, c),
        "one-at-a-time": lambda p, c: run_one_at_a_time(engine, p, max_tokens, **(solo_options or {})),
        "batched": lambda p, c: run_batched(engine, p, max_tokens, c, block_size=block_size),
    }
    med = statistics.median
    rows = []
    for c in concurrencies:
        prompts = bench_prompts(engine, c)
        for s in SYSTEMS if warmup else ():  # this batch size's shapes compiled
            runners[s](prompts, c)
        per_round, same, mlx_same = [], True, []
        for r in range(rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            runs = {s: runners[s](prompts, c) for s in order}
            same &= runs["batched"]["tokens"] == runs["one-at-a-time"]["tokens"]
            mlx_same.append(sum(a == b for a, b in zip(runs["mlx-lm"]["tokens"], runs["one-at-a-time"]["tokens"])))
            per_round.append({s: summary(runs[s]) for s in SYSTEMS})
            log(f"c={c} round {r}: " + "  ".join(f"{s} {per_round[-1][s]['tok_s']:.1f} tok/s" for s in SYSTEMS))
        row = {
            "concurrency": c,
            "prompts": [name for name, _ in prompts],
            "generated_tokens": [len(t) for t in runs["batched"]["tokens"]],
            "identical_batched_one_at_a_time": same,
            "mlx_lm_requests_equal": min(mlx_same),
            "rounds": per_round,
            "median": {
                s: {k: med(x[s][k] for x in per_round) for k, v in per_round[0][s].items() if not isinstance(v, list)}
                for s in SYSTEMS
            },
            # the batch's slowest request against the queue's slowest, same round
            "worst_latency_batched_over_one_at_a_time": med(
                x["batched"]["latency_max_s"] / x["one-at-a-time"]["latency_max_s"] for x in per_round
            ),
            "batched_over_mlx_lm": med(x["batched"]["tok_s"] / x["mlx-lm"]["tok_s"] for x in per_round),
            "batched_over_one_at_a_time": med(x["batched"]["tok_s"] / x["one-at-a-time"]["tok_s"] for x in per_round),
            "one_at_a_time_over_mlx_lm": med(x["one-at-a-time"]["tok_s"] / x["mlx-lm"]["tok_s"] for x in per_round),
        }
        rows.append(row)
        log(
            f"c={c}: batched/mlx-lm {row['batched_over_mlx_lm']:.2f}x, "
            f"batched/one-at-a-time {row['batched_over_one_at_a_time']:.2f}x, identical {same}"
        )
    memory = slot_memory(engine, bench_prompts(engine, max(concurrencies)), memory_tokens)
    res = {"max_tokens": max_tokens, "rounds": rounds, "block_size": block_size, "rows": rows, "memory": memory}
    if profile_slots:
        res["profile"] = profile(engine, bench_prompts(engine, profile_slots), max_tokens, rounds, log)
    return res


def goals(res: dict) -> list:
    """The issue's goals, each (text, met or None when not measured)."""
    by_c = {r["concurrency"]: r for r in res["rows"]}
    out = []
    if 1 in by_c:
        r = by_c[1]
        # "within noise": the median batched/one-at-a-time ratio is >= 0.95
        ratios = [x["batched"]["tok_s"] / x["one-at-a-time"]["tok_s"] for x in r["rounds"]]
        out.append(
            (
                f"concurrency 1: batched within noise of one-at-a-time (median ratio "
                f"{r['batched_over_one_at_a_time']:.2f}, rounds {min(ratios):.2f}..{max(ratios):.2f})",
                r["batched_over_one_at_a_time"] >= 0.95,
            )
        )
    if 4 in by_c:
        r = by_c[4]
        out.append(
            (
                f"concurrency 4: batched >= 1.5x mlx-lm batched ({r['batched_over_mlx_lm']:.2f}x)",
                r["batched_over_mlx_lm"] >= 1.5,
            )
        )
        out.append(
            (
                f"concurrency 4: batched >= 2x one-at-a-time ({r['batched_over_one_at_a_time']:.2f}x)",
                r["batched_over_one_at_a_time"] >= 2.0,
            )
        )
    out.append(
        (
            "identical tokens, batched and one-at-a-time, every request",
            all(r["identical_batched_one_at_a_time"] for r in res["rows"]),
        )
    )
    return out


def recommend(res: dict) -> dict:
    """A ``serve --max-batch`` default: the smallest C whose throughput is
    within 10% of the best measured, throughput taken as batched /
    one-at-a-time in the same round (what batching gains over today's
    server at that load; drift on a shared machine cancels), and whose
    slowest request finishes no later than the queue's slowest (median over
    rounds). 1 if none."""
    rows = sorted(res["rows"], key=lambda r: r["concurrency"])
    best = max(r["batched_over_one_at_a_time"] for r in rows)
    ok = [
        r
        for r in rows
        if r["batched_over_one_at_a_time"] >= 0.9 * best and r["worst_latency_batched_over_one_at_a_time"] <= 1.0
    ]
    pick = ok[0] if ok else None
    if pick is None:
        reason = "no concurrency measured gained over one at a time without a later slowest request"
        return {"max_batch": 1, "reason": reason}
    reason = (
        f"{pick['batched_over_one_at_a_time']:.2f}x the one-at-a-time throughput (best measured {best:.2f}x), "
        f"its slowest request at {pick['worst_latency_batched_over_one_at_a_time']:.2f}x the queue's slowest; "
        "the smallest concurrency within 10% of the best throughput whose slowest request is not later"
    )
    return {"max_batch": pick["concurrency"], "reason": reason}


def to_markdown(res: dict, command: str) -> str:
    mem = res["memory"]
    lines = [
        "# Concurrent requests: mlx-lm batched, one at a time, batched DFlash",
        "",
        f"`{command}`: embedded pair (float32), {res['machine']}; {res['blas']}. "
        f"C requests at t = 0, each its own prompt, `max_tokens` {res['max_tokens']}, greedy; the three systems "
        f"in one process, taking turns (order alternating by round), {res['rounds']} rounds, medians. "
        "The machine is shared with other engineers' tests: absolute numbers drift, the within-round ratios "
        "are what to compare. one-at-a-time is `stream_generate` per request (today's server, without its "
        "prefix cache: the prompts share nothing); batched is `BatchDecoder(max_batch=C)` verifying "
        + (f"{res['block_size']} tokens per slot" if res.get("block_size") else "the draft's block per slot")
        + "; mlx-lm is "
        "its `BatchGenerator` with a batch of C on `mlx_lm.load` of the same target folder.",
        "",
        "| C | system | tok/s | TTFT median s | TTFT max s | latency median s | latency max s | peak GB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        for s in SYSTEMS:
            m = r["median"][s]
            lines.append(
                f"| {r['concurrency']} | {s} | {m['tok_s']:.1f} | {m['ttft_median_s']:.3f} | {m['ttft_max_s']:.3f} | "
                f"{m['latency_median_s']:.3f} | {m['latency_max_s']:.3f} | {m['peak_gb']:.3f} |"
            )
    lines += [
        "",
        "Ratios are medians of within-round ratios (aggregate tok/s; slowest request's latency).",
        "",
        "| C | batched / mlx-lm | batched / one-at-a-time | one-at-a-time / mlx-lm | slowest request, batched /"
        " one-at-a-time | batched tau | batched ms per cycle | identical (batched = one-at-a-time) |"
        " requests equal to mlx-lm |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in res["rows"]:
        b = r["median"]["batched"]
        lines.append(
            f"| {r['concurrency']} | {r['batched_over_mlx_lm']:.2f} | {r['batched_over_one_at_a_time']:.2f} | "
            f"{r['one_at_a_time_over_mlx_lm']:.2f} | {r['worst_latency_batched_over_one_at_a_time']:.2f} | "
            f"{b['tau']:.2f} | {b['wall_s'] / b['cycles'] * 1e3:.1f} | "
            f"{r['identical_batched_one_at_a_time']} | {r['mlx_lm_requests_equal']}/{r['concurrency']} |"
        )
    lines += ["", "Goals:", ""]
    lines += [f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in goals(res)]
    per = mem["per_slot"]
    kv_tok = statistics.median(p["attention_kv_bytes"] / p["context"] for p in per)
    lines += [
        "",
        f"Memory per slot ({mem['slots']} slots, at their last cycle of {mem['max_tokens']} tokens, contexts "
        f"{min(p['context'] for p in per)}..{max(p['context'] for p in per)}): the target's cache "
        f"{statistics.median(p['target_bytes'] for p in per) / 2**20:.2f} MiB median "
        f"(recurrent state {statistics.median(p['recurrent_bytes'] for p in per) / 2**20:.2f} MiB, fixed; "
        f"attention K/V {kv_tok:.0f} bytes per token), the draft's context "
        f"{statistics.median(p['draft_bytes'] for p in per) / 2**20:.2f} MiB. Peak memory "
        f"{mem['peak_gb']:.3f} GB with {mem['slots']} slots, {mem['peak_gb_one_slot']:.3f} GB with one: "
        + (
            f"{mem['peak_per_added_slot_mb']:.1f} MB per added slot (held caches and the cycle's activations)."
            if mem["peak_per_added_slot_mb"] is not None
            else "one slot only."
        ),
        "",
        f"Recommended `serve --max-batch` default: {res['recommendation']['max_batch']} "
        f"({res['recommendation']['reason']}).",
        "",
    ]
    if "profile" in res:
        lines += profile_markdown(res["profile"], res["max_tokens"])
    return "\n".join(lines)


def profile_markdown(p: dict, max_tokens: int) -> list:
    S, W = p["slots"], p["width"]
    forwards = p["draft_b"] + p["verify_b"] + p["rollback_b"]
    one = p["tok_s_c1"]
    return [
        "## Where a batched cycle's time goes",
        "",
        f"{S} slots (the first {S} prompts, after prefill), width {W}; synchronised, isolated forwards, medians "
        f"(ms) of the batch's call for all {S} slots and of {S} solo calls one after another, alternating; "
        f"each rollback keeps {p['kept']} of the {W} rows (the batch's mean tokens per cycle):",
        "",
        f"| phase | batched ({S} slots) | {S} x solo | batched / solo |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {p[k + '_b']:.2f} | {p[k + '_s']:.2f} | {p[k + '_b'] / p[k + '_s']:.2f} |"
            for name, k in (("draft block", "draft"), ("verify forward", "verify"), ("rollback", "rollback"))
        ),
        "",
        f"The batch's real cycle ({S} slots pinned to width {W}, `max_tokens` {max_tokens}) took {p['cycle_ms']:.2f} ms; its isolated "
        f"forwards {forwards:.2f} ms, so {p['cycle_ms'] - forwards:.2f} ms "
        f"({(p['cycle_ms'] - forwards) / p['cycle_ms']:.0%}) is host work beyond them (graph building, "
        f"per-slot judge/accept/commit, the stack and slicing of the DeltaNet states, the host sync).",
        "",
        f"Concurrency 1 (`{p['prompt']}`), tok/s: stream_generate adaptive {one['adaptive']:.1f}, pinned to width "
        f"{W} (adaptive=False) {one['pinned']:.1f}; a batch of one pinned to width {W} "
        f"{one['batched pinned']:.1f}, adaptive {one['batched']:.1f}. Batch / solo: pinned "
        f"{p['c1_batched_over_pinned']:.2f}, adaptive {p['c1_batched_over_adaptive']:.2f} "
        f"(solo pinned / adaptive {p['c1_pinned_over_adaptive']:.2f}).",
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrencies")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency (default 3)")
    ap.add_argument(
        "--block-size", type=int, default=None, help="the batch's verify width (default: the draft's block)"
    )
    ap.add_argument(
        "--profile-slots",
        type=int,
        default=4,
        help="slots of the profile of a batched cycle's time (default 4; 0: no profile)",
    )
    ap.add_argument("--out", type=Path, default=OUT, help="output path without extension (.md and .json)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlx_dflash import blas

    blas.ensure_openblas("auto")  # as the CLI runs (see mlx_dflash/blas.py)
    import mlx.core as mx
    import mlx_lm

    import mlx_dflash
    from mlx_dflash.api import DEFAULT_MODEL

    engine = mlx_dflash.load()
    model, _ = mlx_lm.load(str(DEFAULT_MODEL))
    model.set_dtype(mx.float32)  # as mlx_dflash.load() casts the embedded pair
    res = measure(
        engine,
        model,
        args.concurrency,
        args.max_tokens,
        args.rounds,
        args.profile_slots,
        memory_tokens=max(args.max_tokens, 20),
        block_size=args.block_size,
        log=lambda s: print(s, flush=True),
    )
    res["blas"] = blas.describe()
    res["machine"] = f"{platform.machine()} {platform.system()}, {blas.cores()} cores, MLX {mx.__version__} CPU"
    res["recommendation"] = recommend(res)
    command = "python bench/batch.py -c " + " ".join(map(str, args.concurrency))
    command += f" --max-tokens {args.max_tokens} --rounds {args.rounds} --profile-slots {args.profile_slots}"
    command += f" --block-size {args.block_size}" if args.block_size else ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res, command)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    if not all(r["identical_batched_one_at_a_time"] for r in res["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
