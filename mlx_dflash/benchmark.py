"""``mlx-dflash bench``: mlx-lm vs this engine's plain decoding vs DFlash, side by side.

Every mode decodes the same prompt token ids from the same weights at
temperature 0. The lossless claim is checked against this engine's own plain
decoding: a speculative mode (chain or tree) that gives other tokens fails the
run. Agreement with mlx-lm's output is reported per row but never fails it
(float rounding outside this engine, e.g. a closed-form prefill in bf16, may
flip a near-tie). Reports the median of ``repeats`` runs after one warm-up per
(prompt, length, mode); the modes take turns within each repeat, and a
speedup is the median of per-repeat ratios (see :func:`paired_speedup`).
"""

import json
import platform
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from . import blas
from .decode import GenerationStats, generate_tokens
from .errors import DFlashError
from .files import write_text, written_whole

BASE_MODES = ("mlx-lm", "baseline", "dflash")
PROMPTS_DIR = Path(__file__).parent / "bench_prompts"  # the prompt set shipped with the package


def context_prompt(engine, n_tokens: int, end: Optional[int] = None) -> List[int]:
    """``n_tokens`` prompt ids for the context-length axis: the ones before
    token ``end`` (default ``n_tokens``) of a Python standard-library source
    (argparse.py). The bench ends every context row at the longest row's
    length, so all continue the same text and differ only in how much of the
    file precedes it: what is measured is the context's cost, not how
    predictable three different continuations happen to be."""
    import argparse

    end = n_tokens if end is None else end
    if not 0 < n_tokens <= end:
        raise DFlashError(f"context of {n_tokens} tokens must be positive and end by token {end}")
    text = Path(argparse.__file__).read_text()
    ids = engine.encode(text)
    if len(ids) < end:
        raise DFlashError(f"context prompt source has only {len(ids)} tokens, {end} asked")
    return ids[end - n_tokens : end]


def read_prompts(folder: Optional[Path] = None) -> Dict[str, str]:
    """``*.txt`` files in ``folder`` (default: the shipped set): name -> prompt text (file stem = name)."""
    folder = Path(folder).expanduser() if folder is not None else PROMPTS_DIR
    if folder.exists() and not folder.is_dir():
        raise DFlashError(f"--prompts {folder} is a file; give a folder of *.txt prompts")
    if not folder.is_dir():
        raise DFlashError(f"prompt folder does not exist: {folder} (pass --prompts DIR)")
    prompts = {}
    for f in sorted(folder.glob("*.txt")):
        try:
            prompts[f.stem] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DFlashError(f"prompt {f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts = {k: v for k, v in prompts.items() if v.strip()}
    if not prompts:
        raise DFlashError(f"no non-empty *.txt prompts in {folder}")
    return prompts


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first token where ``a`` and ``b`` part (None: identical)."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _run_mlx_lm(engine, ids: List[int], max_tokens: int):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    toks, last = [], None
    mx.reset_peak_memory()
    for r in stream_generate(
        engine.target.model, engine.tokenizer, mx.array(ids), max_tokens=max_tokens, sampler=make_sampler(0.0)
    ):
        toks.append(int(r.token))
        last = r
    # mlx-lm's generation_tps counts all N tokens over the time since the
    # first (which the prefill made): N / (N - 1) steps. Ours is the N - 1
    # decoded tokens over that time; compared alike, mlx-lm's is scaled.
    return toks, {
        "decode_tps": last.generation_tps * (len(toks) - 1) / len(toks) if len(toks) > 1 else last.generation_tps,
        "prefill_tps": last.prompt_tps,
        "peak_memory": last.peak_memory,
    }


def _run_engine(
    engine, ids: List[int], max_tokens: int, draft, block_size, tree_budget=0, tree_topk=4, profile=False, adaptive=True
):
    st = GenerationStats()
    toks: List[int] = []
    for t in generate_tokens(
        engine.target,
        ids,
        draft=draft,
        max_tokens=max_tokens,
        block_size=block_size,
        eos_token_ids=engine.tokenizer.eos_token_ids,
        stats=st,
        tree_budget=tree_budget,
        tree_topk=tree_topk,
        profile=profile,
        adaptive=adaptive,
    ):
        toks.extend(t)
    c = max(st.cycles, 1)
    return toks, {
        "decode_tps": st.decode_tps,
        "prefill_tps": st.prefill_tps,
        "peak_memory": st.peak_memory,
        "tau": st.tau,
        "accept_hist": st.accept_hist,
        "cycles": st.cycles,
        "cycle_commits": st.cycle_commits,
        "depth_acceptance": st.depth_acceptance,
        "mean_tree_size": st.mean_tree_size,
        "widths": st.widths,
        "policy": st.policy,
        "ms_per_cycle_timed": st.decode_time / c * 1e3,
        "ms_per_cycle": {
            "draft": st.draft_time / c * 1e3,
            "verify": st.verify_time / c * 1e3,
            "rollback": st.rollback_time / c * 1e3,
            "other": st.other_time / c * 1e3,
        },
    }


def _interleaved_runs(fns: Dict[tuple, object], repeats: int):
    """Per key (row, mode): the tokens, the median run by decode tok/s, and
    every timed run's tok/s in repeat order. The keys take turns within each
    repeat (after one warm-up each), so a machine that speeds up or slows
    down over the minutes of a run shifts every mode alike and the ratios
    stay side by side. Engine modes then get one more run, synchronised per
    phase (``fn(True)``), whose draft/verify/rollback split replaces the
    unsplit timings of the timed runs."""
    for fn in fns.values():
        fn(False)
    runs = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            runs[k].append(fn(False))
    out = {}
    for k, rs in runs.items():
        mode = k[1]
        toks = rs[0][0]
        if any(t != toks for t, _ in rs[1:]):
            raise DFlashError(f"{mode} produced different tokens across repeats at temperature 0")
        best = sorted((r[1] for r in rs), key=lambda s: s["decode_tps"])[repeats // 2]
        if mode != "mlx-lm":
            t, prof = fns[k](True)
            if t != toks:
                raise DFlashError(f"a profiled {mode} run produced different tokens at temperature 0")
            best["ms_per_cycle"] = prof["ms_per_cycle"]
        out[k] = (toks, best, [r[1]["decode_tps"] for r in rs])
    return out


def paired_speedup(tps: Sequence[float], base: Sequence[float]) -> float:
    """The median over repeats of one mode's tok/s over the reference's in the
    same repeat. The two ran seconds apart, so the machine's drift over a run
    (up to 30% within minutes on a shared VM) mostly cancels in each ratio,
    where a ratio of two medians would mix different minutes."""
    return statistics.median(a / b if b else 0.0 for a, b in zip(tps, base))


def run_bench(
    engine,
    prompts: Dict[str, str],
    *,
    max_tokens: Sequence[int] = (128, 512),
    repeats: int = 3,
    block_size: Optional[int] = None,
    chat_template: bool = True,
    tree_budget: int = 0,
    tree_topk: int = 4,
    log=print,
    pipeline: bool = False,
    draft2=None,
    draft2_path=None,
    contexts: Sequence[int] = (),
    adaptive: bool = True,
) -> dict:
    """Run every (prompt, length, mode); modes: mlx-lm, baseline, dflash (chain)
    and, with ``tree_budget`` > 0, dflash-tree; with ``draft2`` (a second
    loaded draft, e.g. a DFlash 2 head) also dflash2: a chain on that draft.
    ``pipeline``: the engine is a pipeline's rank 0 (no whole model for
    mlx-lm): baseline is the reference. ``contexts``: also one row per context
    length (prompts of that many tokens ending at the same token, see :func:`context_prompt`),
    generating ``max_tokens[0]`` tokens. ``adaptive``: the dflash modes' width policy."""
    modes = BASE_MODES[1:] if pipeline else BASE_MODES
    # With the width policy on, the pinned full-width chain runs beside it, so the
    # policy's gain or loss is a ratio measured in the same run.
    pinned = ("dflash-pinned",) if adaptive and not block_size else ()
    modes = (
        modes + pinned + (("dflash-tree",) if tree_budget > 0 else ()) + (("dflash2",) if draft2 is not None else ())
    )
    if engine.draft is None:
        raise DFlashError("bench needs a draft (the DFlash mode)")
    if repeats < 1:
        raise DFlashError(f"repeats must be positive, got {repeats}")

    def encode(text):
        return engine.encode(text, chat_template=chat_template and engine.tokenizer.chat_template is not None)

    # Rows measured together take turns within each repeat. Each prompt row is
    # its own group; the context rows form one group, so the speedup at the
    # longest context over the shortest is a ratio of rows measured side by side.
    groups = [[(name, ids, n)] for name, ids in ((k, encode(v)) for k, v in prompts.items()) for n in max_tokens]
    if contexts:
        limit = engine.target.max_context
        if max(contexts) >= limit:  # now, not after the prompt rows have run
            raise DFlashError(f"--context {max(contexts)}: the context limit is {limit} tokens")
        groups.append([(f"context_{L}", context_prompt(engine, L, max(contexts)), max_tokens[0]) for L in contexts])

    def mode_fns(ids, n):
        """Each mode's run on one row (``p``: synchronised per phase, for the time split)."""
        return {
            "mlx-lm": lambda p: _run_mlx_lm(engine, ids, n),
            "baseline": lambda p: _run_engine(engine, ids, n, None, None, profile=p),
            "dflash": lambda p: _run_engine(engine, ids, n, engine.draft, block_size, profile=p, adaptive=adaptive),
            "dflash-pinned": lambda p: _run_engine(engine, ids, n, engine.draft, block_size, profile=p, adaptive=False),
            "dflash-tree": lambda p: _run_engine(
                engine, ids, n, engine.draft, block_size, tree_budget, tree_topk, profile=p
            ),
            "dflash2": lambda p: _run_engine(engine, ids, n, draft2, block_size, profile=p, adaptive=adaptive),
        }

    results = []
    for group in groups:
        fns = {}
        for i, (_name, ids, n) in enumerate(group):
            row_fns = mode_fns(ids, n)
            fns.update({(i, m): row_fns[m] for m in modes})
        runs = _interleaved_runs(fns, repeats)
        for i, (name, ids, n) in enumerate(group):
            row = {"prompt": name, "prompt_tokens": len(ids), "max_tokens": n, "modes": {}}
            tokens = {}
            for m in modes:
                tokens[m], row["modes"][m], _ = runs[(i, m)]
                row["modes"][m]["generated"] = len(tokens[m])
            plain = tokens["baseline"]
            for mode in modes[modes.index("baseline") + 1 :]:
                j = first_difference(tokens[mode], plain)
                if j is not None:
                    raise DFlashError(
                        f"LOSSLESSNESS FAILURE: {mode} differs from this engine's plain decoding on "
                        f"prompt {name!r} (max {n}) at token {j}"
                    )
            if "mlx-lm" in modes:
                row["mlx_lm_first_difference"] = first_difference(plain, tokens["mlx-lm"])
                if row["mlx_lm_first_difference"] is not None:
                    log(
                        f"note: plain decoding parts from mlx-lm on {name!r} (max {n}) at token "
                        f"{row['mlx_lm_first_difference']} (not a losslessness failure: see README, Numerics)"
                    )
            base = row["modes"][modes[0]]["decode_tps"]
            for m in modes:
                row["modes"][m]["speedup"] = paired_speedup(runs[(i, m)][2], runs[(i, modes[0])][2])
            d = row["modes"]["dflash"]
            tr = row["modes"].get("dflash-tree")
            d2 = row["modes"].get("dflash2")
            pn = row["modes"].get("dflash-pinned")
            log(
                f"{name:<18} n={n:<4} {modes[0]} {base:7.1f} tok/s | baseline "
                f"{row['modes']['baseline']['decode_tps']:7.1f} | dflash {d['decode_tps']:7.1f} "
                f"({d['speedup']:.2f}x, tau {d['tau']:.2f})"
                + (f" | pinned {pn['decode_tps']:7.1f} ({pn['speedup']:.2f}x)" if pn else "")
                + (f" | tree {tr['decode_tps']:7.1f} ({tr['speedup']:.2f}x, tau {tr['tau']:.2f})" if tr else "")
                + (f" | dflash2 {d2['decode_tps']:7.1f} ({d2['speedup']:.2f}x, tau {d2['tau']:.2f})" if d2 else "")
            )
            results.append(row)
    return {
        "machine": f"{platform.platform()} ({platform.machine()})",
        "blas": blas.describe(),
        "model": str(engine.model_path),
        "draft": str(engine.draft_path),
        **(
            {"draft2": str(draft2_path), "draft2_kind": draft2.config.kind if hasattr(draft2, "config") else None}
            if draft2 is not None
            else {}
        ),
        "draft_kind": engine.draft.config.kind if hasattr(engine.draft, "config") else None,
        "block_size": block_size or engine.draft.block_size,
        "policy": "pinned" if block_size or not adaptive else "adaptive",
        "tree_budget": tree_budget,
        "tree_topk": tree_topk,
        "modes": list(modes),
        "repeats": repeats,
        "identical_tokens": True,
        "agrees_with_mlx_lm": (
            all(r["mlx_lm_first_difference"] is None for r in results) if "mlx-lm" in modes else None
        ),  # None: not run (--pipeline)
        "results": results,
    }


def to_markdown(res: dict) -> str:
    modes = res["modes"]
    tree = "dflash-tree" in modes
    two = "dflash2" in modes
    lines = [
        "# mlx-dflash bench",
        "",
        f"- machine: {res['machine']}",
        f"- BLAS: {res['blas']}",
        f"- target: `{res['model']}`; draft: `{res['draft']}`; block size {res['block_size']}"
        + (f"; tree budget {res['tree_budget']}, top-k {res['tree_topk']}" if tree else "")
        + (
            f"; dflash2 = a chain on the second draft `{res['draft2']}` ({res.get('draft2_kind')}), "
            f"dflash on the first ({res.get('draft_kind')})"
            if two
            else ""
        ),
        f"- dflash width policy: {res.get('policy', 'pinned')}",
        f"- tok/s: the median of {res['repeats']} runs after a warm-up, the modes taking turns within each "
        "repeat (the context rows also take turns with each other); speedup: the median over repeats of the "
        f"mode's tok/s over {res['modes'][0]}'s in the same repeat; "
        "the time split per cycle is from one more run synchronised after each phase; "
        "speculative modes produced the tokens of plain decoding "
        f"(temperature 0): {res['identical_tokens']}; plain decoding equals mlx-lm's on every row: "
        f"{res.get('agrees_with_mlx_lm', True)}",
        "",
        "| prompt | max | "
        + " | ".join(f"{m} tok/s" for m in modes)
        + " | dflash speedup | dflash tau | "
        + ("tree speedup | tree tau | tree tokens/cycle | " if tree else "")
        + ("dflash2 speedup | dflash2 tau | " if two else "")
        + "dflash ms per cycle | dflash draft/verify/rollback/other ms (profiled) | peak GB |",
        "|---|---:|"
        + "---:|" * len(modes)
        + "---:|---:|"
        + ("---:|---:|---:|" if tree else "")
        + ("---:|---:|" if two else "")
        + "---:|---|---:|",
    ]
    for r in res["results"]:
        m = r["modes"]
        d = m["dflash"]
        t = d["ms_per_cycle"]
        cells = [r["prompt"], str(r["max_tokens"])] + [f"{m[x]['decode_tps']:.1f}" for x in modes]
        cells += [f"{d['speedup']:.2f}x", f"{d['tau']:.2f}"]
        if tree:
            tr = m["dflash-tree"]
            cells += [f"{tr['speedup']:.2f}x", f"{tr['tau']:.2f}", f"{tr['mean_tree_size']:.1f}"]
        if two:
            cells += [f"{m['dflash2']['speedup']:.2f}x", f"{m['dflash2']['tau']:.2f}"]
        cells += [
            f"{d['ms_per_cycle_timed']:.1f}",
            f"{t['draft']:.1f} / {t['verify']:.1f} / {t['rollback']:.1f} / {t['other']:.1f}",
            f"{d['peak_memory']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    med = lambda mode, key: statistics.median(r["modes"][mode][key] for r in res["results"])
    lines += [
        "",
        "Medians over all rows: "
        + ", ".join(f"{x} {med(x, 'decode_tps'):.1f} tok/s ({med(x, 'speedup'):.2f}x)" for x in modes)
        + ".",
    ]
    for mode in ("dflash", "dflash2") if two else ("dflash",):
        lines += ["", f"Acceptance histograms, {mode} chain (committed tokens per cycle: count):", ""]
        for r in res["results"]:
            h = r["modes"][mode]["accept_hist"]
            lines.append(f"- {r['prompt']} / {r['max_tokens']}: " + " ".join(f"{i}:{c}" for i, c in enumerate(h) if c))
    if two:
        lines += [
            "",
            "Medians of tau: "
            + ", ".join(
                f"{x} {statistics.median(r['modes'][x]['tau'] for r in res['results']):.2f}"
                for x in ("dflash", "dflash2")
            )
            + ".",
        ]
    lines += ["", "Verify widths chosen, dflash (width: cycles; 1 = a plain step):", ""]
    for r in res["results"]:
        w = r["modes"]["dflash"].get("widths", {})
        lines.append(f"- {r['prompt']} / {r['max_tokens']}: " + " ".join(f"{k}:{c}" for k, c in w.items()))
    # shortest first, whatever order --context gave them in (the summary is longest over shortest)
    ctx = sorted((r for r in res["results"] if r["prompt"].startswith("context_")), key=lambda r: r["prompt_tokens"])
    if ctx:
        lines += [
            "",
            "Context length (prompt tokens; peak memory of the whole process's MLX allocations):",
            "",
            "| prompt tokens | generated | mlx-lm tok/s | dflash tok/s | dflash speedup | dflash tau "
            "| mlx-lm peak GB | dflash peak GB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in ctx:
            m, d = r["modes"].get("mlx-lm") or r["modes"]["baseline"], r["modes"]["dflash"]
            lines.append(
                f"| {r['prompt_tokens']} | {d['generated']} | {m['decode_tps']:.1f} | {d['decode_tps']:.1f} "
                f"| {d['speedup']:.2f}x | {d['tau']:.2f} | {m['peak_memory']:.3f} | {d['peak_memory']:.3f} |"
            )
        lines += [
            "",
            f"Speedup at the longest context / at the shortest: "
            f"{ctx[-1]['modes']['dflash']['speedup'] / ctx[0]['modes']['dflash']['speedup']:.2f}.",
        ]
    pre = [r["modes"]["dflash"]["prefill_tps"] for r in res["results"]]
    lines += ["", f"Prefill (dflash, with feature capture): median {statistics.median(pre):.0f} tok/s."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("the plot needs matplotlib: pip install 'mlx-dflash[bench]'") from None
    rows = res["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['prompt']}\n{r['max_tokens']}" for r in rows]
    x = range(len(rows))
    modes = res["modes"]
    w = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        a1.bar(
            [j + (i - (len(modes) - 1) / 2) * w for j in x],
            [r["modes"][mode]["decode_tps"] for r in rows],
            w,
            label=mode,
        )
    a1.set_xticks(list(x))
    a1.set_xticklabels(labels, fontsize=7)
    a1.set_ylabel("decode tok/s")
    a1.set_title("Decode speed per mode")
    a1.legend()
    for r in rows:
        c = r["modes"]["dflash"]["cycle_commits"]
        a2.plot(range(1, len(c) + 1), c, marker=".", lw=0.8, label=f"{r['prompt']}/{r['max_tokens']}")
    a2.set_xlabel("cycle")
    a2.set_ylabel("tokens committed (tau per cycle)")
    a2.set_title("DFlash acceptance over the generation")
    a2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def can_plot() -> bool:
    """Whether matplotlib (the ``bench`` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_results(res: dict, folder: Path, name: str, *, with_plot: bool = True) -> List[Path]:
    """NAME.json, NAME.md (and NAME.png) in ``folder``, each written whole
    or not at all: a run killed while writing keeps the previous results."""
    folder.mkdir(parents=True, exist_ok=True)
    js, md, png = folder / f"{name}.json", folder / f"{name}.md", folder / f"{name}.png"
    for path, text in ((js, json.dumps(res, indent=1)), (md, to_markdown(res))):
        write_text(path, text)
    if not with_plot:
        return [js, md]
    with written_whole(png) as tmp:
        plot(res, tmp)
    return [js, md, png]
