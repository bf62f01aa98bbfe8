"""Single process vs a 2-stage pipeline vs a 2-stage pipeline with DFlash, over loopback.

    python bench/pipeline.py [--prompts bench/prompts] [--names a,b] [--max-tokens 128] [--repeats 3]

Runs the embedded pair four ways: one process (plain, DFlash chain) and two
ring-backend processes on 127.0.0.1 started with ``mlx.launch`` (plain,
DFlash chain), every mode producing identical tokens or the run fails. Each
repeat starts the single process and the pipeline once each, in alternating
order, so drift of this shared machine hits both alike; medians are over
repeats. The pipeline run also records the cost terms of docs/distributed.md:
each stage's compute per forward (T = 1 and the verify block), rank 0's wait
for a forward sent round the ring, and the round trip of an empty message.
Writes bench/results/pipeline-embedded.{json,md}.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _median_time(fn, reps=7):
    import mlx.core as mx

    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _run(target, draft, ids, n, eos, block_size=None):
    from mlx_dflash.decode import GenerationStats, generate_tokens

    st = GenerationStats()
    toks = []
    for t in generate_tokens(
        target, ids, draft=draft, max_tokens=n, eos_token_ids=eos, stats=st, block_size=block_size
    ):
        toks.extend(t)
    return toks, {
        "decode_tps": st.decode_tps,
        "tau": st.tau,
        "cycles": st.cycles,
        "ms_per_cycle": st.decode_time / max(st.cycles, 1) * 1e3,
    }


def child(args):
    """One repeat of every prompt in this process (mode single) or as one rank (mode pipeline)."""
    import mlx.core as mx

    from mlx_dflash.api import load
    from mlx_dflash.cache import TargetCache

    prompts = json.loads(Path(args.prompts_json).read_text())

    def stage_ms(t):
        """This rank's stage alone (fresh cache, synchronised) while the other waits in a barrier."""
        out = {}
        for T in (1, args.block):
            h = mx.random.normal((1, T, t.hidden_size))

            def own(T=T, h=h):
                x, _ = t.run_layers(h, TargetCache(t.is_linear), (), T > 1, None)
                return t.lm_head(t.norm(x)) if t.has_head else x

            out[T] = _median_time(own) * 1e3
        return out

    if args.child == "single":
        engine, stage = load(), None
    else:
        engine = load(pipeline=True)
        stage = engine.stage
        if stage.rank != 0:
            stage.serve()
            w = stage.worker
            alone = stage_ms(stage.target)  # rank 0 waits in the barrier meanwhile
            stage.link.barrier()
            stage.link.barrier()  # rank 0 times its stage
            Path(args.json + f".rank{stage.rank}").write_text(
                json.dumps(
                    {
                        "rank": stage.rank,
                        "layers": stage.layers,
                        "alone_ms": alone,
                        "busy_ms": {T: b[1] / b[0] * 1e3 for T, b in w.busy.items()},
                        "forwards": {T: b[0] for T, b in w.busy.items()},
                    }
                )
            )
            return
    eos = engine.tokenizer.eos_token_ids
    out = {"rows": {}}
    for name, text in prompts.items():
        ids = engine.encode(text)
        modes = {"plain": None, "dflash": engine.draft}
        for d in modes.values():  # warm-up
            _run(engine.target, d, ids, 16, eos)
        out["rows"][name] = {m: _run(engine.target, d, ids, args.max_tokens, eos) for m, d in modes.items()}
    if stage is not None:
        t = engine.target
        B = engine.draft.block_size
        if B != args.block:
            raise SystemExit(f"--block {args.block} but the draft's block is {B}")
        out["wait_ms"] = {T: w[1] / w[0] * 1e3 for T, w in t.wait.items()}
        out["forwards"] = {T: w[0] for T, w in t.wait.items()}
        ts = []
        for _ in range(50):  # an empty message round the ring: the per-cycle link cost on its own
            tic = time.perf_counter()
            t.sync()
            ts.append(time.perf_counter() - tic)
        out["round_trip_ms"] = statistics.median(ts) * 1e3
        out["layers"] = {"rank0": list(stage.layers), "bounds": stage.bounds}
        out["block_size"] = B
        stage.close()
        stage.link.barrier()  # rank 1 has timed its stage
        out["rank0_stage_ms"] = stage_ms(t)
        stage.link.barrier()
    Path(args.json).write_text(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=ROOT / "bench" / "prompts", help="Folder of prompt .txt files.")
    ap.add_argument(
        "--names", default="code_class,doc_read_file,prose_comment", help="Comma list of prompt names (file stems)."
    )
    ap.add_argument("--max-tokens", type=int, default=128, help="Tokens generated per prompt and mode.")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Runs of the single process and of the pipeline each, alternating; results are medians over them.",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="Folder for pipeline-embedded.json and .md.")
    ap.add_argument("--block", type=int, default=16, help="The draft's block size (the verify block timed).")
    ap.add_argument("--child", choices=["single", "pipeline"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, str(ROOT))
    from mlx_dflash import blas

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    lib = blas.openblas_path()
    if lib and platform.system() == "Linux":
        env["LD_PRELOAD"] = lib
    names = [n for n in args.names.split(",") if n]
    prompts = {n: (args.prompts / f"{n}.txt").read_text() for n in names}
    tmp = Path(tempfile.mkdtemp(prefix="pipebench"))
    pj = tmp / "prompts.json"
    pj.write_text(json.dumps(prompts))
    common = ["--max-tokens", str(args.max_tokens), "--prompts-json", str(pj), "--block", str(args.block)]
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    runs = {"single": [], "pipeline": [], "stage1": []}
    loads = []
    for rep in range(args.repeats):
        order = ("single", "pipeline") if rep % 2 == 0 else ("pipeline", "single")
        for kind in order:
            j = tmp / f"{kind}{rep}.json"
            cmd = [sys.executable, __file__, "--child", kind, "--json", str(j), *common]
            if kind == "pipeline":
                # One BLAS thread per rank: two ranks share the two cores, and
                # OpenBLAS threads that spin while idle starve the other rank.
                cmd = [launcher, "--backend", "ring", "-n", "2", "--env", "OPENBLAS_NUM_THREADS=1", "--", *cmd]
            loads.append(os.getloadavg()[0])
            print(f"repeat {rep + 1}/{args.repeats}: {kind}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            if not j.exists():
                raise SystemExit(f"{kind} run wrote no result (see its errors above)")
            runs[kind].append(json.loads(j.read_text()))
            if kind == "pipeline":
                runs["stage1"].append(json.loads(Path(str(j) + ".rank1").read_text()))

    modes = [("single", "plain"), ("single", "dflash"), ("pipeline", "plain"), ("pipeline", "dflash")]
    rows = []
    for name in names:
        ref = runs["single"][0]["rows"][name]["plain"][0]
        row = {"prompt": name}
        for kind, m in modes:
            rs = [r["rows"][name][m] for r in runs[kind]]
            for toks, _ in rs:
                if toks != ref:
                    raise SystemExit(f"LOSSLESSNESS FAILURE: {kind} {m} differs from single plain on {name}")
            row[f"{kind}-{m}"] = {
                k: statistics.median(s[k] for _, s in rs) for k in ("decode_tps", "tau", "ms_per_cycle")
            }
        rows.append(row)
    B = runs["pipeline"][0]["block_size"]

    def med(key, T=None, src="pipeline"):
        vals = [r[key][str(T)] if T is not None else r[key] for r in runs[src]]
        return statistics.median(vals)

    terms = {
        "stage1_ms": {T: med("busy_ms", T, "stage1") for T in (1, B)},
        "stage1_alone_ms": {T: med("alone_ms", T, "stage1") for T in (1, B)},
        "rank0_stage_ms": {T: med("rank0_stage_ms", T) for T in (1, B)},
        "wait_ms": {T: med("wait_ms", T) for T in (1, B)},
        "round_trip_ms": med("round_trip_ms"),
        "bounds": runs["pipeline"][0]["layers"]["bounds"],
    }
    res = {
        "machine": f"{platform.platform()} ({platform.machine()})",
        "blas": env.get("LD_PRELOAD", "bundled"),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "load_avg_at_starts": loads,
        "rows": rows,
        "terms": terms,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline-embedded.json").write_text(json.dumps(res, indent=1))
    md = [
        f"# Pipeline over loopback: embedded pair, {args.max_tokens} tokens",
        "",
        f"`python bench/pipeline.py` on {res['machine']}, BLAS {res['blas']}; "
        f"median of {args.repeats} repeats, single process and pipeline runs alternating; "
        f"load average at the starts {min(loads):.1f}-{max(loads):.1f}. Every mode produced identical tokens.",
        "",
        "| prompt | single plain tok/s | single dflash tok/s (tau) | 2-stage plain tok/s | "
        "2-stage dflash tok/s (tau) | 2-stage dflash vs 2-stage plain | 2-stage dflash vs single plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sp, sd = r["single-plain"], r["single-dflash"]
        pp, pd = r["pipeline-plain"], r["pipeline-dflash"]
        md.append(
            f"| {r['prompt']} | {sp['decode_tps']:.1f} | {sd['decode_tps']:.1f} ({sd['tau']:.2f}) | "
            f"{pp['decode_tps']:.1f} | {pd['decode_tps']:.1f} ({pd['tau']:.2f}) | "
            f"{pd['decode_tps'] / pp['decode_tps']:.2f}x | {pd['decode_tps'] / sp['decode_tps']:.2f}x |"
        )
    t = terms
    md += [
        "",
        f"Stages (layers, first stage first): {t['bounds']} (rank 1 runs the first, rank 0 the last "
        "with norm, head and draft).",
        "",
        f"| per forward | T = 1 (plain token) | T = {B} (verify block) |",
        "|---|---:|---:|",
        f"| rank 1 stage alone: its layers, fresh cache (ms) | {t['stage1_alone_ms'][1]:.2f} | "
        f"{t['stage1_alone_ms'][B]:.2f} |",
        f"| rank 0 stage alone: its layers + norm + head, fresh cache (ms) | {t['rank0_stage_ms'][1]:.2f} | "
        f"{t['rank0_stage_ms'][B]:.2f} |",
        f"| rank 1 stage in generation: embed + its layers, message in to hidden out (ms) | "
        f"{t['stage1_ms'][1]:.2f} | {t['stage1_ms'][B]:.2f} |",
        f"| rank 0 wait: send the ids, receive rank 1's hidden states (ms) | {t['wait_ms'][1]:.2f} | "
        f"{t['wait_ms'][B]:.2f} |",
        f"| of which link + messaging (wait - rank 1 stage) (ms) | {t['wait_ms'][1] - t['stage1_ms'][1]:.2f} | "
        f"{t['wait_ms'][B] - t['stage1_ms'][B]:.2f} |",
        "",
        f"An empty message round the ring (2 hops): {t['round_trip_ms']:.2f} ms.",
    ]
    (args.out / "pipeline-embedded.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
