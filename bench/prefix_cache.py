"""Prefix cache on the embedded pair: time to first token cold vs restored.

    python bench/prefix_cache.py [--turns 6] [--reply 48] [--blas auto|openblas|bundled]

1. chat: a ChatSession whose history grows to ~3k tokens over --turns turns
   (long user messages of Python source); each turn's prompt is also run cold
   (no cache) with the same ids and must give the same reply.
2. agent: one long system prompt, then requests with varied short user
   turns (fresh conversations): the shared system prompt comes from a rung.
3. rungs: the agent replay for several rung intervals: reuse, snapshot
   memory, and the cost rungs add to a cold prefill.

TTFT = restore + prefill of the rest + the first token (stats.prefill_time).
Writes bench/results/prefix-cache.md and .json.
"""

import argparse
import inspect
import json
import platform
import statistics
import sys
from pathlib import Path

from mlx_dflash import blas

RESULTS = Path(__file__).resolve().parent / "results"


def sources(n_chars, skip=0):
    """Deterministic Python text: stdlib sources, in a fixed order."""
    import calendar
    import difflib
    import fractions
    import json as js
    import pprint
    import shlex
    import string
    import textwrap

    text = "".join(
        inspect.getsource(m) for m in (textwrap, difflib, shlex, fractions, string, calendar, pprint, js.decoder)
    )
    return text[skip : skip + n_chars]


def fork(pc):
    """A cache holding the same snapshots (arrays are shared, never written):
    repeated warm runs all start from the same state."""
    import copy

    c = copy.copy(pc)
    c._snaps = list(pc._snaps)
    return c


def med_ttft(runs):
    return statistics.median(r.stats.prefill_time for r in runs) * 1e3


def cold_runs(engine, ids, max_tokens, reps):
    """One full cold run (the reference output) and reps-1 TTFT-only ones."""
    import mlx_dflash

    full = mlx_dflash.generate(engine, ids, max_tokens=max_tokens)
    return full, [full] + [mlx_dflash.generate(engine, ids, max_tokens=1) for _ in range(reps - 1)]


def chat_bench(engine, turns, reply, reps, log):
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    pc = PrefixCache()
    chat = mlx_dflash.ChatSession(engine, system="Python standard library study notes.", prefix_cache=pc)
    asks = [
        "\n\ndef test_parse():",
        "\n\nclass Reader:",
        "\n\ndef main(argv=None):",
        "\n\nif __name__ == '__main__':",
        "\n\ndef _check(value, kind):",
    ]
    rows = []
    for t in range(turns):
        user = sources(4800, skip=20000) if t == 0 else asks[(t - 1) % len(asks)]
        pre = fork(pc)
        warm = chat.send(user, max_tokens=reply)
        ids = chat._ids[: warm.stats.prompt_tokens]
        warms = [warm] + [
            mlx_dflash.generate(engine, ids, max_tokens=1, prefix_cache=fork(pre)) for _ in range(reps - 1)
        ]
        cold, colds = cold_runs(engine, ids, reply, reps)
        if cold.tokens != warm.tokens:
            raise SystemExit(f"turn {t + 1}: restored output differs from cold")
        s, c = warm.stats, cold.stats
        rows.append(
            dict(
                turn=t + 1,
                prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens,
                prefilled_warm=s.prompt_tokens - s.cached_tokens,
                prefilled_cold=c.prompt_tokens,
                ttft_cold_ms=med_ttft(colds),
                ttft_warm_ms=med_ttft(warms),
                snapshots=len(pc),
                snapshot_mb=pc.nbytes / 1e6,
                tau_cold=c.tau,
                tau_warm=s.tau,
            )
        )
        rows[-1]["ratio"] = rows[-1]["ttft_warm_ms"] / rows[-1]["ttft_cold_ms"]
        log(f"chat turn {t + 1}: {rows[-1]}")
    return rows


TASKS = [
    "def parse_config(path):",
    "class LRUCache:",
    "def merge_sorted(a, b):",
    "import argparse\n\ndef main():",
    "def tokenize(text):",
    "class Matrix:",
]


def agent_prompts(engine):
    system = sources(6000, skip=0)
    return [engine.encode(t, chat_template=True, system=system) for t in TASKS]


def agent_cold(engine, prompts, reps, log):
    out = []
    for i, ids in enumerate(prompts):
        full, colds = cold_runs(engine, ids, 16, reps)
        out.append((full.tokens, med_ttft(colds)))
        log(f"agent cold {i + 1}: {out[-1][1]:.0f} ms")
    return out


def agent_bench(engine, prompts, cold, rung_interval, reps, log):
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    pc = PrefixCache(rung_interval=rung_interval)
    rows = []
    for i, ids in enumerate(prompts):
        pre = fork(pc)
        warm = mlx_dflash.generate(engine, ids, max_tokens=16, prefix_cache=pc)
        warms = [warm] + [
            mlx_dflash.generate(engine, ids, max_tokens=1, prefix_cache=fork(pre)) for _ in range(reps - 1)
        ]
        if warm.tokens != cold[i][0]:
            raise SystemExit(f"agent request {i + 1}: restored output differs from cold")
        s = warm.stats
        rows.append(
            dict(
                request=i + 1,
                prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens,
                ttft_cold_ms=cold[i][1],
                ttft_warm_ms=med_ttft(warms),
                ratio=med_ttft(warms) / cold[i][1],
                snapshots=len(pc),
                snapshot_mb=pc.nbytes / 1e6,
            )
        )
        log(f"agent R={rung_interval} request {i + 1}: {rows[-1]}")
    return rows


def rung_cost(engine, rung_interval, n_tokens=3000, reps=2):
    """Median cold TTFT of an n-token prompt with an empty cache taking rungs
    at this interval, and without any cache, measured alternately."""
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    ids = engine.encode(sources(12000, skip=40000), chat_template=False)[:n_tokens]
    with_pc, without = [], []
    for _ in range(reps):
        with_pc.append(
            mlx_dflash.generate(engine, ids, max_tokens=1, prefix_cache=PrefixCache(rung_interval=rung_interval))
        )
        without.append(mlx_dflash.generate(engine, ids, max_tokens=1))
    return med_ttft(with_pc), med_ttft(without)


def table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--turns",
        type=int,
        default=6,
        help="chat turns (a pasted file, then short follow-ups); the history grows each turn",
    )
    ap.add_argument("--reply", type=int, default=200, help="max tokens per chat reply")
    ap.add_argument("--reps", type=int, default=3, help="TTFT samples per case (median)")
    ap.add_argument("--rungs", default="256,512,1024,2048", help="rung intervals to sweep")
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    engine = mlx_dflash.load()
    mlx_dflash.generate(engine, "def warm_up():", max_tokens=8)
    probe = PrefixCache()
    mlx_dflash.generate(engine, "def warm_up():", max_tokens=2, prefix_cache=probe)
    default_rung = probe.rung_interval
    chat = chat_bench(engine, args.turns, args.reply, args.reps, log)
    prompts = agent_prompts(engine)
    cold = agent_cold(engine, prompts, args.reps, log)
    sweep, agent = [], None
    for R in [int(x) for x in args.rungs.split(",")]:
        rows = agent_bench(engine, prompts, cold, R, args.reps, log)
        with_pc, without = rung_cost(engine, R)
        later = rows[1:]
        sweep.append(
            dict(
                rung_interval=R,
                mean_cached=statistics.mean(r["cached_tokens"] for r in later),
                mean_ratio=statistics.mean(r["ratio"] for r in later),
                snapshot_mb=rows[-1]["snapshot_mb"],
                snapshots=rows[-1]["snapshots"],
                cold_ttft_3k_with_rungs_ms=with_pc,
                cold_ttft_3k_no_cache_ms=without,
                rung_overhead=with_pc / without - 1,
            )
        )
        if R == default_rung:
            agent = rows
        log(f"rungs {sweep[-1]}")
    agent = agent or rows
    res = dict(
        machine=f"{platform.system()} {platform.machine()}",
        blas=blas.describe(),
        chat=chat,
        agent=agent,
        rung_sweep=sweep,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix-cache.json").write_text(json.dumps(res, indent=1))
    last = chat[-1]
    md = [
        "# Prefix cache on the embedded pair",
        "",
        f"`python bench/prefix_cache.py` on {res['machine']}, CPU, BLAS: {res['blas']}. "
        "TTFT = restore + prefill of the uncached tokens + first token, median of "
        f"{args.reps} runs (warm runs all start from the same cache state). Every warm reply "
        "equals the cold reply over the same prompt ids (checked).",
        "",
        f"## Chat: {args.turns} turns (a pasted file, then short follow-ups), replies of up to "
        f"{args.reply} tokens, history to {last['prompt_tokens']} tokens",
        "",
        table(
            chat,
            [
                "turn",
                "prompt_tokens",
                "cached_tokens",
                "prefilled_warm",
                "ttft_cold_ms",
                "ttft_warm_ms",
                "ratio",
                "snapshots",
                "snapshot_mb",
                "tau_cold",
                "tau_warm",
            ],
        ),
        "",
        f"Warm TTFT at {last['prompt_tokens']} tokens: {last['ratio'] * 100:.1f}% of cold (goal <= 15%).",
        "",
        f"## Agent replay: one long system prompt, varied user turns (rung interval {default_rung}, the default for this model)",
        "",
        table(
            agent,
            [
                "request",
                "prompt_tokens",
                "cached_tokens",
                "ttft_cold_ms",
                "ttft_warm_ms",
                "ratio",
                "snapshots",
                "snapshot_mb",
            ],
        ),
        "",
        "## Rung interval",
        "",
        "Agent replay per interval (requests 2-6), and the cold TTFT of a 3000-token prompt with "
        "a prefix cache taking rungs at that interval vs no cache (median of 2, alternating).",
        "",
        table(
            sweep,
            [
                "rung_interval",
                "mean_cached",
                "mean_ratio",
                "snapshots",
                "snapshot_mb",
                "cold_ttft_3k_with_rungs_ms",
                "cold_ttft_3k_no_cache_ms",
                "rung_overhead",
            ],
        ),
        "",
    ]
    (RESULTS / "prefix-cache.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
