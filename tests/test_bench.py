"""mlx-dflash bench: side-by-side modes, identical-token check, result files."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dflash
from mlx_dflash import benchmark
from mlx_dflash.benchmark import read_prompts, run_bench, write_results
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from tools import tiny


def test_bench_writes_json_markdown_plot(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")
    eng = mlx_dflash.load()
    res = run_bench(eng, read_prompts(tmp_path / "p"), max_tokens=[6, 12], repeats=1, tree_budget=6, log=lambda _: None)
    assert res["identical_tokens"] and res["agrees_with_mlx_lm"] and len(res["results"]) == 2
    for r in res["results"]:
        # the width policy is on by default, so the pinned full-width chain runs beside it
        assert set(r["modes"]) == {"mlx-lm", "baseline", "dflash", "dflash-pinned", "dflash-tree"}
        assert r["modes"]["dflash"]["generated"] == r["modes"]["mlx-lm"]["generated"]
        assert r["modes"]["mlx-lm"]["speedup"] == pytest.approx(1.0)
        # The split comes from a profiled run (the timed runs are not synchronised per phase).
        split = r["modes"]["dflash"]["ms_per_cycle"]
        assert split["draft"] > 0 and split["verify"] > 0
    files = write_results(res, tmp_path / "out", "t")
    assert [f.name for f in files] == ["t.json", "t.md", "t.png"]
    assert json.loads(files[0].read_text())["results"][0]["prompt"] == "code"
    assert "| code | 6 |" in files[1].read_text()
    assert files[2].read_bytes()[:4] == b"\x89PNG"


class BrokenVerify(Target):
    """Test-local mistake: multi-token (verify) forwards see slightly wrong
    logits, so speculative decoding stops being plain decoding."""

    def forward(self, tokens, cache, **kw):
        logits, feats = super().forward(tokens, cache, **kw)
        if logits is not None and logits.shape[0] > 1:
            logits = logits + mx.random.normal(logits.shape, key=mx.random.key(cache.offset)) * 2.0
        return logits, feats


def test_bench_fails_loudly_when_speculative_differs_from_plain(dense, tok_dir, tmp_path):
    cfg, model = dense
    target = BrokenVerify(model)
    from mlx_dflash.loading import load_tokenizer

    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    draft = tiny.build_draft(tiny.draft_config(cfg, block_size=4)).bind(target)
    eng = mlx_dflash.Engine(target, load_tokenizer(path), draft)
    with pytest.raises(DFlashError, match="LOSSLESSNESS FAILURE: dflash differs from this engine's plain"):
        run_bench(eng, {"p": "def f(x):"}, max_tokens=[16], repeats=1, log=lambda _: None)


def test_bench_reports_mlx_lm_disagreement_without_failing(dense, tok_dir, tmp_path):
    """Numerics outside the engine (here: mlx-lm running other weights) are
    reported, not taken for a losslessness failure."""
    cfg, model = dense
    target = Target(model)
    target.model = tiny.build_target(cfg, seed=99)
    from mlx_dflash.loading import load_tokenizer

    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    eng = mlx_dflash.Engine(
        target, load_tokenizer(path), tiny.build_draft(tiny.draft_config(cfg, block_size=4)).bind(target)
    )
    notes = []
    res = run_bench(eng, {"p": "def f(x):"}, max_tokens=[16], repeats=1, log=notes.append)
    assert res["identical_tokens"] and not res["agrees_with_mlx_lm"]
    assert res["results"][0]["mlx_lm_first_difference"] is not None
    assert any("not a losslessness failure" in n for n in notes)


def test_bench_on_bf16_checks_plain_not_mlx_lm(tmp_path):
    """The embedded pair in bf16: speculative output must equal plain
    decoding; agreement with mlx-lm is a separate, reported fact."""
    eng = mlx_dflash.load(dtype=mx.bfloat16)
    res = run_bench(eng, {"p": "def add(a, b):\n"}, max_tokens=[12], repeats=1, tree_budget=4, log=lambda _: None)
    assert res["identical_tokens"] and isinstance(res["agrees_with_mlx_lm"], bool)
    md = write_results(res, tmp_path, "bf")[1].read_text()
    assert "plain decoding equals mlx-lm's on every row" in md


def test_shipped_prompt_set_is_package_data(tmp_path, monkeypatch):
    from pathlib import Path

    from mlx_dflash.benchmark import PROMPTS_DIR

    monkeypatch.chdir(tmp_path)  # not a checkout
    assert PROMPTS_DIR.parent == Path(mlx_dflash.__file__).parent
    assert set(read_prompts()) == {f.stem for f in PROMPTS_DIR.glob("*.txt")} and len(read_prompts()) >= 6
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"bench_prompts/*.txt"' in pyproject  # shipped in the wheel


@pytest.mark.slow
def test_bench_runs_outside_a_checkout_with_the_shipped_prompts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no bench/prompts here
    with pytest.raises(SystemExit) as e:
        main(["bench", "-n", "2", "--repeats", "1", "--blas", "bundled", "--out", str(tmp_path / "o")])
    assert e.value.code in (0, None), capsys.readouterr().err
    res = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert {r["prompt"] for r in res["results"]} == set(read_prompts())


def test_bench_with_the_bundled_blas_runs_from_the_command_line(tmp_path):
    # The entry point preloaded OpenBLAS and bench re-executed without it,
    # round and round: the command never ran on a machine with OpenBLAS.
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "one.txt").write_text("def add(a, b):\n")
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", "bench", "--blas", "bundled", "--prompts", str(tmp_path / "p")]
        + ["-n", "2", "--repeats", "1", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "BLAS: mlx-cpu bundled reference BLAS" in r.stderr
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["results"]


def test_bench_without_matplotlib_says_so_first_and_writes_the_tables(tmp_path, monkeypatch, capsys):
    import mlx_dflash.benchmark

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "one.txt").write_text("def add(a, b):\n")
    monkeypatch.setattr(mlx_dflash.benchmark, "can_plot", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompts", str(tmp_path / "p"), "-n", "2", "--repeats", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr()
    assert e.value.code in (0, None), out.err
    assert out.err.startswith("mlx-dflash: no matplotlib: bench.png is not drawn")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["bench.json", "bench.md"]


def test_bench_cli_bad_prompts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompts", str(tmp_path / "none"), "--blas", "bundled"])
    assert e.value.code == 2
    assert "prompt folder does not exist" in capsys.readouterr().err


@pytest.mark.slow  # 45-65 s: a cost curve, two contexts x three repeats of three systems
def test_bench_context_length_axis(tmp_path, monkeypatch):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")
    eng = mlx_dflash.load()
    seen = []  # prompt lengths of mlx-lm's runs, in the order they ran
    run_mlx_lm = benchmark._run_mlx_lm
    monkeypatch.setattr(benchmark, "_run_mlx_lm", lambda e, ids, n: seen.append(len(ids)) or run_mlx_lm(e, ids, n))
    res = run_bench(
        eng, read_prompts(tmp_path / "p"), max_tokens=[8], repeats=2, contexts=[40, 120], log=lambda _: None
    )
    ctx = [r for r in res["results"] if r["prompt"].startswith("context_")]
    assert [r["prompt_tokens"] for r in ctx] == [40, 120]
    # The context rows take turns within each repeat (warm-up, then two repeats),
    # so their speedups are measured side by side.
    assert seen[-6:] == [40, 120] * 3
    assert all(r["modes"]["dflash"]["peak_memory"] > 0 for r in ctx)
    md = write_results(res, tmp_path / "out", "t")[1].read_text()
    assert "| 120 | 8 |" in md and "Speedup at the longest context" in md
    # contexts given longest first (--context 120 --context 40): the summary was the inverse ratio
    want = ctx[1]["modes"]["dflash"]["speedup"] / ctx[0]["modes"]["dflash"]["speedup"]
    for rows in (res["results"], list(reversed(res["results"]))):
        md = benchmark.to_markdown({**res, "results": rows})
        assert f"Speedup at the longest context / at the shortest: {want:.2f}." in md


def test_a_context_past_the_limit_is_refused_before_any_row_runs(tmp_path, monkeypatch):
    """It was refused when its row came, after every prompt row had run (their
    results thrown away)."""
    from mlx_dflash.errors import DFlashError

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")
    eng = mlx_dflash.load()
    ran = []
    monkeypatch.setattr(benchmark, "_run_mlx_lm", lambda *a: ran.append(a))
    with pytest.raises(DFlashError, match=f"--context 5000: the context limit is {eng.target.max_context} tokens"):
        run_bench(eng, read_prompts(tmp_path / "p"), max_tokens=[4], repeats=1, contexts=[64, 5000], log=lambda _: None)
    assert ran == []


def test_context_rows_end_at_the_same_token():
    """Each context row continues the same text; only what precedes it grows."""
    from mlx_dflash.benchmark import context_prompt

    eng = mlx_dflash.load()
    short, long = context_prompt(eng, 40, end=120), context_prompt(eng, 120, end=120)
    assert len(short) == 40 and len(long) == 120 and long[-40:] == short
    assert context_prompt(eng, 40) == long[:40]
    with pytest.raises(DFlashError, match="must be positive and end by token 100"):
        context_prompt(eng, 120, end=100)


def test_speedup_is_the_median_of_paired_ratios():
    """Each repeat's ratio is taken before the median: a machine that slowed
    down in one repeat slows both modes of that repeat alike."""
    from mlx_dflash.benchmark import paired_speedup

    tps, base = [10.0, 30.0, 20.0], [5.0, 20.0, 40.0]
    assert paired_speedup(tps, base) == pytest.approx(1.5)  # ratios 2, 1.5, 0.5
    assert paired_speedup([3.0], [0.0]) == 0.0


def _compare_revisions():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "compare_revisions.py"
    spec = importlib.util.spec_from_file_location("compare_revisions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker_result(tps, non_forward, tokens=(1, 2, 3)):
    """A worker's result: rows ``a``/128 and ``b``/512; ``tps[row][mode]``, ``non_forward[row]`` (ms)."""
    rows = []
    for name, n, row_tps, nf in zip("ab", (128, 512), tps, non_forward):
        modes = {}
        for mode, t in row_tps.items():
            prof = {"non_forward_ms": nf} if mode != "baseline" else None  # as the worker: no split for plain
            modes[mode] = {"tokens": list(tokens), "profiled_tokens_equal": True, "tps": t, "profiled": prof}
        rows.append({"prompt": name, "max_tokens": n, "prompt_ids": [7, 8], "modes": modes})
    return {"blas": "test", "rows": rows}


def test_compare_revisions_table_and_medians():
    """The before/after script's arithmetic on made-up rounds: a row's ratio is
    the median of within-round ratios (not a ratio of medians), rows below
    0.97 are named, the non-forward time is the median over rounds and rows,
    and a token that differs anywhere is reported."""
    cr = _compare_revisions()
    modes = ("dflash", "baseline")
    # Row a: rounds at 100, 200, 300 tok/s before; after 110, 180, 330: ratios 1.1, 0.9, 1.1 -> 1.1.
    # Row b: after 0.95x in every round -> below tolerance.
    before = [
        _worker_result([{"dflash": t, "baseline": 50.0}, {"dflash": 40.0, "baseline": 50.0}], [1.0, 2.0])
        for t in (100.0, 200.0, 300.0)
    ]
    after = [
        _worker_result([{"dflash": t, "baseline": 50.0}, {"dflash": 38.0, "baseline": 50.0}], [nf, 1.0])
        for t, nf in ((110.0, 0.5), (180.0, 0.5), (330.0, 3.0))
    ]
    s = cr.summarize(before, after, modes)
    a, b = s["rows"][0]["modes"]["dflash"], s["rows"][1]["modes"]["dflash"]
    assert a["ratio"] == pytest.approx(1.1) and a["before_tps"] == 200.0 and a["after_tps"] == 180.0
    assert b["ratio"] == pytest.approx(0.95)
    assert s["median_ratio"]["dflash"] == pytest.approx((1.1 + 0.95) / 2)
    assert s["median_ratio"]["baseline"] == pytest.approx(1.0)
    assert s["rows_below_tolerance"] == {"dflash": ["b/512"], "baseline": []}
    assert a["before_non_forward_ms"] == 1.0 and a["after_non_forward_ms"] == 0.5
    assert s["non_forward_ms"]["dflash"] == (pytest.approx(1.5), pytest.approx(0.75))
    assert s["identical_tokens"]
    md = cr.to_markdown(s, ["before: x; after: y"])
    assert "| a | 128 | 200.0 | 180.0 | 1.100 | 50.0 | 50.0 | 1.000 |" in md
    assert "- dflash: median after/before 1.025; rows below 0.97: b/512" in md
    assert "| b | 512 | 2.00 | 1.00 |" in md
    assert "- dflash: median over rows 1.50 ms before, 0.75 ms after" in md
    # One round of the after side decoding one other token is caught.
    after[2]["rows"][1]["modes"]["dflash"]["tokens"] = [1, 2, 4]
    s = cr.summarize(before, after, modes)
    assert not s["identical_tokens"] and not s["rows"][1]["modes"]["dflash"]["identical_tokens"]
    assert "equal the base's plain decoding: False" in cr.to_markdown(s, [])


def _bench_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 30-40 s: three systems, a profile and a memory pass
def test_batch_bench_smoke(tmp_path):
    """bench/batch.py end to end at concurrency 2, 4 tokens, one round: the
    three systems run, batched gives each request the one-at-a-time tokens,
    the times are ordered (one at a time: the second request's first token
    after the first request's end), and the result states goals and memory."""
    import mlx_lm

    from mlx_dflash.api import DEFAULT_MODEL

    bb = _bench_script("batch")
    eng = mlx_dflash.load()
    model, _ = mlx_lm.load(str(DEFAULT_MODEL))
    model.set_dtype(mx.float32)
    # pinned width: the adaptive policy's one-time cost measurement is not this test's
    res = bb.measure(
        eng, model, [2], 4, 1, warmup=False, memory_tokens=20, solo_options={"adaptive": False}, log=lambda _: None
    )
    (row,) = res["rows"]
    assert row["identical_batched_one_at_a_time"] and row["generated_tokens"] == [4, 4]
    assert len(set(row["prompts"])) == 2 and 0 <= row["mlx_lm_requests_equal"] <= 2
    for s in bb.SYSTEMS:
        m = row["rounds"][0][s]
        assert all(0 < t <= lat for t, lat in zip(m["ttft_s"], m["latency_s"]))
        assert max(m["latency_s"]) == m["wall_s"] and m["tok_s"] == pytest.approx(8 / m["wall_s"])
    one = row["rounds"][0]["one-at-a-time"]
    assert one["ttft_s"][1] > one["latency_s"][0]
    assert row["batched_over_mlx_lm"] == pytest.approx(
        row["median"]["batched"]["tok_s"] / row["median"]["mlx-lm"]["tok_s"]
    )
    per = res["memory"]["per_slot"]
    assert len(per) == 2 and all(p["attention_kv_bytes"] > 0 and p["recurrent_bytes"] > 0 for p in per)
    res.update(blas="test", machine="test", recommendation=bb.recommend(res))
    md = bb.to_markdown(res, "cmd")
    assert "| 2 | batched |" in md and "- met: identical tokens, batched and one-at-a-time" in md


def test_batch_bench_recommendation():
    """The --max-batch recommendation: the smallest concurrency within 10% of
    the best throughput (batched / one at a time) whose slowest request is
    not later than the queue's; 1 when none is."""
    bb = _bench_script("batch")

    def row(c, ratio, worst):
        return {
            "concurrency": c,
            "batched_over_one_at_a_time": ratio,
            "worst_latency_batched_over_one_at_a_time": worst,
        }

    res = {"rows": [row(8, 2.1, 0.8), row(1, 0.9, 1.1), row(2, 1.5, 0.9), row(4, 2.0, 0.9)]}
    assert bb.recommend(res)["max_batch"] == 4  # within 10% of 8's, and smaller
    res["rows"][3] = row(4, 2.0, 1.2)
    assert bb.recommend(res)["max_batch"] == 8  # 4's slowest request finishes after the queue's
    res["rows"] = [row(1, 0.9, 1.1), row(2, 0.8, 1.3)]
    assert bb.recommend(res)["max_batch"] == 1


def test_a_bench_that_fails_leaves_no_results_folder_it_made(tmp_path, capsys):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.txt").write_bytes("caf\xe9".encode("latin-1"))  # refused once the run started
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompts", str(tmp_path / "p"), "-n", "2", "--out", str(tmp_path / "new" / "o")])
    assert e.value.code == 2 and "is not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_policy_replay_prices_by_a_real_shapes_curve(tmp_path):
    """bench/policy_replay.py --curve: the '/ T_plain' column of a
    real_shapes result replaces the pair's ratios; the draft and rollback are
    taken at the pair's block (the nearest measured width below it), and a
    file without the terms is one error."""
    from mlx_dflash.policy import CostModel

    pr = _bench_script("policy_replay")
    md = tmp_path / "real.md"
    md.write_text(
        "| term | fp32 ms | / T_plain |\n|---|---:|---:|\n| T_plain | 700.0 | 1.00 |\n"
        "| T_verify(2) | 742.0 | 1.06 |\n| T_rollback(2) | 14.0 | 0.02 |\n| T_verify(8) | 910.0 | 1.30 |\n"
        "| T_rollback(8) | 28.0 | 0.04 |\n| T_verify(16) | 1050.0 | 1.50 |\n| T_draft(4) | 350.0 | 0.50 |\n"
        "| T_draft(8) | 399.0 | 0.57 |\n| T_draft(16) | 420.0 | 0.60 |\n"
    )
    ratios = pr.read_curve(md)
    assert ratios["T_verify(8)"] == 1.30 and ratios["T_draft(16)"] == 0.60 and "T_plain" not in ratios
    own = CostModel(plain=0.004, verify={2: 0.01, 8: 0.02}, draft={2: 0.003, 8: 0.003}, rollback=0.001, draft_row=1e-5)
    c = pr.priced(own, 12, ratios)
    assert c.verify == pytest.approx({2: 0.00424, 8: 0.0052})  # 16 is past the block
    assert c.full_draft() == pytest.approx(0.57 * 0.004) and c.rollback == pytest.approx(0.04 * 0.004)
    assert c.cycle(8) / c.plain == pytest.approx(0.57 + 1.30 + 0.04)
    assert c.plain == own.plain and c.draft_row == own.draft_row and own.verify[8] == 0.02
    bad = tmp_path / "bad.md"
    bad.write_text("| T_plain | 700.0 | 1.00 |\n")
    with pytest.raises(SystemExit, match="no 'T_verify"):
        pr.read_curve(bad)


def test_policy_replay_prices_by_assumed_ratios():
    """bench/policy_replay.py --assume draft=D,row=R: a verify of B rows at
    1 + R(B - 1) plain steps and a draft forward at D, up to the pair's
    block, rollback 0.02 unless given; the priced curve times its own first
    cycles (a set of its own); a malformed spec is one argparse error."""
    import argparse

    from mlx_dflash.policy import CostModel

    pr = _bench_script("policy_replay")
    ap = argparse.ArgumentParser()
    own = CostModel(plain=0.004, verify={2: 0.01, 8: 0.02}, draft={2: 0.003, 8: 0.003}, rollback=0.001, draft_row=1e-5)
    own.warm.add(8)
    c = pr.priced(own, 8, pr.assumed("draft=0.15,row=0.03", ap))
    assert c.verify == pytest.approx({B: (1 + 0.03 * (B - 1)) * 0.004 for B in range(2, 9)})
    assert c.full_draft() == pytest.approx(0.15 * 0.004) and c.rollback == pytest.approx(0.02 * 0.004)
    assert c.plain == own.plain and c.draft_row == own.draft_row and c.warm == set() and own.warm == {8}
    assert pr.priced(own, 8, pr.assumed("draft=0.2,row=0,rollback=0.1", ap)).rollback == pytest.approx(0.1 * 0.004)
    for bad in ("draft=0.15", "draft=x,row=0.03", "draft=0.1,row=0.03,speed=2", "draft=-1,row=0.03", "0.15"):
        with pytest.raises(SystemExit) as e:
            pr.assumed(bad, ap)
        assert e.value.code == 2, bad


def test_policy_replay_replays_each_prompt_from_several_starts(monkeypatch):
    """bench/policy_replay.py --offsets K: each prompt is replayed from its
    own start and from k = 1..K-1 tokens into its record (those taken as
    prompt); the row gives the own start's ratio, the median over the
    starts and the lowest, and the summary the worst prompt's median."""
    from types import SimpleNamespace

    import mlx_dflash.policy as policy
    from mlx_dflash.policy import CostModel, Policy
    from tools.replay import regret_row

    pr = _bench_script("policy_replay")
    costs = CostModel(plain=0.01, verify={2: 0.012, 4: 0.013, 8: 0.015}, draft={8: 0.004}, rollback=0.001)
    monkeypatch.setattr(policy, "load_costs", lambda target, draft: (costs, None))
    n, K = 60, 3
    # A draft right every other anchor, then for whole blocks: where a start lands decides the first looks.
    right = {
        8: [1 - k % 2 if k < 30 else 7 for k in range(n + K)],
        4: [1 - k % 2 if k < 30 else 3 for k in range(n + K)],
    }
    records = {("pair", "p"): (list(range(n + K)), right)}
    worst = {}
    engine, draft = SimpleNamespace(target=None), SimpleNamespace(block_size=8)
    lines = pr.section(engine, "pair", draft, {"p": "text"}, n, n + K, "4,8", records, worst, None, K)

    def ratio(k):
        row = regret_row(lambda: Policy(8, costs), {B: r[k : k + n] for B, r in right.items()}, n, costs, [4, 8])
        return min(row[m] for m in ("pinned 4", "pinned 8", "plain")) / row["default"]

    each = [ratio(k) for k in range(K)]
    assert len(set(round(x, 6) for x in each)) > 1  # the starts differ
    cells = next(x for x in lines if x.startswith("| p |")).strip("| ").split(" | ")
    assert cells[6] == f"{each[0]:.3f}" and cells[-2:] == [f"{statistics.median(each):.3f}", f"{min(each):.3f}"]
    assert worst["pair", n] == pytest.approx((each[0], statistics.median(each)))
    assert f"Over {K} start offsets, the worst prompt's median ratio {statistics.median(each):.3f}." in lines[-2]


def test_regret_bench_pairs_its_control_as_it_pairs_the_default():
    """bench/regret.py runs plain decoding twice: its table states the
    control's ratio to plain, paired by repeat as the regret ratio is, so a
    reader sees what identical work reads as in the same run; the control
    is never the better mode nor a column of its own."""
    rg = _bench_script("regret")

    def runs(*tps):
        return [([1, 2], {"decode_tps": t, "widths": {1: 2} if t != 120 else {1: 1, 8: 1}, "tau": 1.0}) for t in tps]

    r = {
        "default": runs(90, 120, 100),
        "pinned 4": runs(80, 80, 80),
        "plain": runs(100, 100, 125),
        rg.CONTROL: runs(110, 95, 100),
    }
    row = rg.summarise(r)
    assert row["best"] == "plain" and row["best_pinned"] == "pinned 4"
    assert row["regret"] == pytest.approx(statistics.median([0.9, 1.2, 0.8]))
    assert row["control"] == pytest.approx(statistics.median([1.1, 0.95, 0.8]))
    assert row["regret_best"] == pytest.approx(120 / 125)  # the control's 110 is not another mode
    # The paired ratios' 95% interval: Student's t (2 degrees of freedom) on their logarithms.
    logs = [math.log(x) for x in (0.9, 1.2, 0.8)]
    half = 4.30 * statistics.stdev(logs) / math.sqrt(3)
    lo, hi = row["interval"]
    assert lo == pytest.approx(math.exp(statistics.mean(logs) - half)) and hi == pytest.approx(
        math.exp(statistics.mean(logs) + half)
    )
    assert rg.interval([0.95]) == (0.0, math.inf) and rg.interval([0.96, 0.96])[1] == pytest.approx(0.96)
    lines = rg.table(list(r), {"p": row, "q": dict(row, control=1.04)})
    assert lines[0].count("tok/s") == 3 and lines[0].endswith("control: plain again / plain |")
    assert lines[2].endswith(f"| {row['control']:.3f} |")
    summary = next(x for x in lines if x.startswith("Worst regret ratio"))
    assert f"read {row['control']:.3f}-1.040" in summary
    assert f"| {row['regret']:.3f} | {lo:.2f}-{hi:.2f} |" in lines[2]
    assert (
        "wholly below 0.97 (a miss the noise cannot explain): 0; straddling it (this run cannot tell): 2 of 2"
        in summary
    )
    # The median repeat ran plainly; the one that drafted is listed too.
    assert "- p: 1:2 (tau 1.00); repeats: 1:2 | 1:1 8:1 | 1:2" in lines


def test_policy_noise_clock_times_cycles_as_the_true_costs_say_with_noise():
    """bench/policy_noise.py: without noise the policy reads each cycle's
    true cost (drafted parts ``bias`` times the curve, plain steps and the
    shadows a run carried as they are); with noise a seed gives the same
    times again, and a long plain run spreads less than a drafted cycle."""
    import random

    from mlx_dflash.policy import CostModel, Plan, Policy

    pn = _bench_script("policy_noise")
    c = CostModel(plain=0.01, verify={2: 0.02, 8: 0.03}, draft={2: 0.004, 8: 0.004}, rollback=0.001)
    truth = pn.truth_of(c, 1.3)
    assert truth.cycle(8) == pytest.approx(1.3 * c.cycle(8)) and truth.cycle(1) == c.cycle(1)
    policy = Policy(8, c)
    exact = pn.noisy_clock(policy, truth, random.Random(0), 0.0, False)
    assert exact(Plan(8, block=8), 3) == pytest.approx(1.3 * c.cycle(8))
    policy.run_shadows = 2
    assert exact(Plan(1, steps=16), 16) == pytest.approx(16 * c.plain + 2 * 1.3 * c.full_draft())
    policy.run_shadows = 0

    def times(plan, n, seed):
        clock = pn.noisy_clock(policy, truth, random.Random(seed), 0.15, False)
        return [clock(plan, n) for _ in range(400)]

    drafted = times(Plan(8, block=8), 3, 1)
    assert drafted == times(Plan(8, block=8), 3, 1)
    plain = [t / 64 for t in times(Plan(1, steps=64), 64, 1)]
    assert statistics.pstdev(plain) / c.plain < 0.5 * statistics.pstdev(drafted) / truth.cycle(8)


def test_draft_vocab_projects_tau_from_the_share_outside():
    """bench/draft_vocab.py's projection: with nothing outside the kept ids
    tau is unchanged; a share u outside lowers every depth's acceptance by
    (1 - u), so tau falls, more at a larger u, and never below one token."""
    dv = _bench_script("draft_vocab")
    assert dv.tau_with_outside(5.71, 16, 0.0) == pytest.approx(5.71, abs=1e-6)
    drops = [dv.tau_with_outside(5.71, 16, u) for u in (0.01, 0.02, 0.05, 1.0)]
    assert 5.71 > drops[0] > drops[1] > drops[2] > drops[3] == pytest.approx(1.0)
    # alpha = 0.5 at B = 2 gives tau 1.5; u = 0.5 leaves alpha 0.25
    assert dv.tau_with_outside(1.5, 2, 0.5) == pytest.approx(1.25, abs=1e-6)


def test_switch_cost_bench_fits_plain_drafted_and_change_costs_apart():
    """bench/switch_cost.py: runs whose plain runs and drafted cycles are each
    off the curve by their own factor, and whose changes between the two
    cost extra, give back those factors and that cost (in plain steps) from
    the fit over the modes; changes are counted both ways."""
    from mlx_dflash.policy import CHANGE_STEPS, CostModel, Plan

    sc = _bench_script("switch_cost")
    plans = [Plan(1, steps=4), Plan(16, block=16), Plan(1, steps=4), Plan(16, block=16), Plan(16, block=16)]
    from tools.replay import changes, parts, seconds

    assert changes(plans) == 3 and changes([Plan(1, steps=4)] * 3) == 0
    costs = CostModel(plain=0.004, verify={2: 0.01, 16: 0.014}, draft={2: 0.003, 16: 0.004}, rollback=0.001)
    plain, drafted = parts(plans, [4, 3, 4, 1, 2], costs)
    assert plain == pytest.approx(8 * 0.004) and drafted == pytest.approx(3 * costs.cycle(16))
    # The replay prices each change as CHANGE_STEPS plain steps.
    assert seconds(plans, [4, 3, 4, 1, 2], costs) == pytest.approx(plain + drafted + 3 * CHANGE_STEPS * 0.004)
    a, b, step, per_change = 0.7, 0.8, 0.0028, 0.5  # a change: half a plain step as it ran
    modes = {
        "plain": (0.5, 0.0, 0),
        "block": (0.0, 0.6, 0),
        "k16": (0.4, 0.1, 10),
        "k8": (0.35, 0.2, 20),
        "k4": (0.3, 0.3, 26),
    }
    rows = {
        m: {"plain": p, "drafted": d, "changes": n, "observed": a * p + b * d + per_change * step * n}
        for m, (p, d, n) in modes.items()
    }
    f = sc.fit(rows, step)
    assert f["plain"] == pytest.approx(a) and f["drafted"] == pytest.approx(b)
    assert f["change"] == pytest.approx(per_change) and f["residual"] < 1e-9
    # a script alternates plain runs of k steps with one drafted cycle of the block
    s = sc.Script(16, 8)
    assert [s.plan(100).width for _ in range(4)] == [1, 16, 1, 16] and s.plan(1).width == 1
    assert {sc.Script(16, 0).plan(100).width, sc.Script(16, None).plan(100).width} == {16, 1}


def test_moe_shape_bench_rejects_a_model_without_a_full_attention_layer():
    # Fewer than 4 layers have none, and mlx-lm's Qwen3.5 failed deep inside with an IndexError.
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "moe_shape.py"), "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--layers must be at least 4" in r.stderr and "Traceback" not in r.stderr
