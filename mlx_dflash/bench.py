"""``mlx-dflash bench``: mlx-lm vs this engine's plain decoding vs DFlash, side by side.

Every mode decodes the same prompt token ids from the same weights; at
temperature 0 all must produce identical tokens, or the run fails. Reports the
median of ``repeats`` runs after one warm-up per (prompt, length, mode).
"""

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from . import blas
from .decode import GenerationStats, generate_tokens
from .errors import DFlashError

MODES = ("mlx-lm", "baseline", "dflash")


def read_prompts(folder: Path) -> Dict[str, str]:
    """``*.txt`` files in ``folder``: name -> prompt text (file stem = name)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DFlashError(f"prompt folder does not exist: {folder} (pass --prompts DIR)")
    prompts = {f.stem: f.read_text() for f in sorted(folder.glob("*.txt"))}
    prompts = {k: v for k, v in prompts.items() if v.strip()}
    if not prompts:
        raise DFlashError(f"no non-empty *.txt prompts in {folder}")
    return prompts


def _run_mlx_lm(engine, ids: List[int], max_tokens: int):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    toks, last = [], None
    mx.reset_peak_memory()
    for r in stream_generate(engine.target.model, engine.tokenizer, mx.array(ids),
                             max_tokens=max_tokens, sampler=make_sampler(0.0)):
        toks.append(int(r.token))
        last = r
    return toks, {
        "decode_tps": last.generation_tps, "prefill_tps": last.prompt_tps,
        "peak_memory": last.peak_memory,
    }


def _run_engine(engine, ids: List[int], max_tokens: int, draft, block_size):
    st = GenerationStats()
    toks: List[int] = []
    for t in generate_tokens(engine.target, ids, draft=draft, max_tokens=max_tokens,
                             block_size=block_size, eos_token_ids=engine.tokenizer.eos_token_ids, stats=st):
        toks.extend(t)
    c = max(st.cycles, 1)
    return toks, {
        "decode_tps": st.decode_tps, "prefill_tps": st.prefill_tps, "peak_memory": st.peak_memory,
        "tau": st.tau, "accept_hist": st.accept_hist, "cycles": st.cycles,
        "cycle_commits": st.cycle_commits,
        "ms_per_cycle": {
            "draft": st.draft_time / c * 1e3, "verify": st.verify_time / c * 1e3,
            "rollback": st.rollback_time / c * 1e3, "other": st.other_time / c * 1e3,
        },
    }


def _median_run(fn, repeats: int):
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    toks = runs[0][0]
    for t, _ in runs[1:]:
        if t != toks:
            raise DFlashError("a mode produced different tokens across repeats at temperature 0")
    order = sorted(range(repeats), key=lambda i: runs[i][1]["decode_tps"])
    return toks, runs[order[repeats // 2]][1]


def run_bench(engine, prompts: Dict[str, str], *, max_tokens: Sequence[int] = (128, 512),
              repeats: int = 3, block_size: Optional[int] = None, chat_template: bool = True,
              log=print) -> dict:
    if engine.draft is None:
        raise DFlashError("bench needs a draft (the DFlash mode)")
    if repeats < 1:
        raise DFlashError(f"repeats must be positive, got {repeats}")
    results = []
    for name, text in prompts.items():
        ids = engine.encode(text, chat_template=chat_template and engine.tokenizer.chat_template is not None)
        for n in max_tokens:
            row = {"prompt": name, "prompt_tokens": len(ids), "max_tokens": n, "modes": {}}
            tokens = {}
            for mode in MODES:
                if mode == "mlx-lm":
                    fn = lambda: _run_mlx_lm(engine, ids, n)
                elif mode == "baseline":
                    fn = lambda: _run_engine(engine, ids, n, None, None)
                else:
                    fn = lambda: _run_engine(engine, ids, n, engine.draft, block_size)
                tokens[mode], row["modes"][mode] = _median_run(fn, repeats)
                row["modes"][mode]["generated"] = len(tokens[mode])
            ref = tokens["mlx-lm"]
            for mode in MODES[1:]:
                if tokens[mode] != ref:
                    i = next((j for j, (a, b) in enumerate(zip(tokens[mode], ref)) if a != b),
                             min(len(ref), len(tokens[mode])))
                    raise DFlashError(
                        f"LOSSLESSNESS FAILURE: {mode} differs from mlx-lm on prompt {name!r} "
                        f"(max {n}) at token {i}")
            base = row["modes"]["mlx-lm"]["decode_tps"]
            for m in MODES:
                row["modes"][m]["speedup"] = row["modes"][m]["decode_tps"] / base if base else 0.0
            d = row["modes"]["dflash"]
            log(f"{name:<18} n={n:<4} mlx-lm {base:7.1f} tok/s | baseline "
                f"{row['modes']['baseline']['decode_tps']:7.1f} | dflash {d['decode_tps']:7.1f} "
                f"({d['speedup']:.2f}x, tau {d['tau']:.2f})")
            results.append(row)
    return {
        "machine": f"{platform.platform()} ({platform.machine()})",
        "blas": blas.describe(),
        "model": str(engine.model_path), "draft": str(engine.draft_path),
        "block_size": block_size or engine.draft.block_size,
        "repeats": repeats, "identical_tokens": True, "results": results,
    }


def to_markdown(res: dict) -> str:
    lines = [
        f"# mlx-dflash bench",
        "",
        f"- machine: {res['machine']}",
        f"- BLAS: {res['blas']}",
        f"- target: `{res['model']}`; draft: `{res['draft']}`; block size {res['block_size']}",
        f"- median of {res['repeats']} runs after a warm-up; all modes produced identical tokens "
        f"(temperature 0): {res['identical_tokens']}",
        "",
        "| prompt | max | mlx-lm tok/s | baseline tok/s | dflash tok/s | speedup vs mlx-lm | tau | "
        "draft/verify/rollback/other ms per cycle | peak GB |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in res["results"]:
        m = r["modes"]
        d = m["dflash"]
        t = d["ms_per_cycle"]
        lines.append(
            f"| {r['prompt']} | {r['max_tokens']} | {m['mlx-lm']['decode_tps']:.1f} | "
            f"{m['baseline']['decode_tps']:.1f} | {d['decode_tps']:.1f} | {d['speedup']:.2f}x | "
            f"{d['tau']:.2f} | {t['draft']:.1f} / {t['verify']:.1f} / {t['rollback']:.1f} / {t['other']:.1f} | "
            f"{d['peak_memory']:.3f} |")
    lines += ["", "Acceptance histograms (committed tokens per cycle: count):", ""]
    for r in res["results"]:
        h = r["modes"]["dflash"]["accept_hist"]
        lines.append(f"- {r['prompt']} / {r['max_tokens']}: " + " ".join(f"{i}:{c}" for i, c in enumerate(h) if c))
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
    w = 0.27
    for i, mode in enumerate(MODES):
        a1.bar([j + (i - 1) * w for j in x], [r["modes"][mode]["decode_tps"] for r in rows], w, label=mode)
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


def write_results(res: dict, folder: Path, name: str) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    js, md, png = folder / f"{name}.json", folder / f"{name}.md", folder / f"{name}.png"
    js.write_text(json.dumps(res, indent=1))
    md.write_text(to_markdown(res))
    plot(res, png)
    return [js, md, png]
