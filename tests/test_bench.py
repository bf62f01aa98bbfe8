"""mlx-dflash bench: side-by-side modes, identical-token check, result files."""

import json

import pytest

import mlx_dflash
from mlx_dflash import tiny
from mlx_dflash.bench import read_prompts, run_bench, write_results
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target


def test_bench_writes_json_markdown_plot(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")
    eng = mlx_dflash.load()
    res = run_bench(eng, read_prompts(tmp_path / "p"), max_tokens=[6, 12], repeats=1, tree_budget=6,
                    log=lambda _: None)
    assert res["identical_tokens"] and len(res["results"]) == 2
    for r in res["results"]:
        assert set(r["modes"]) == {"mlx-lm", "baseline", "dflash", "dflash-tree"}
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


def test_bench_fails_loudly_on_token_mismatch(dense, moe, tok_dir, tmp_path):
    # A target whose mlx-lm model differs from the one the engine decodes.
    cfg, model = dense
    target = Target(model)
    target.model = tiny.build_target(cfg, seed=99)
    dcfg = tiny.draft_config(cfg, block_size=4)
    from mlx_dflash.loading import load_tokenizer

    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    eng = mlx_dflash.Engine(target, load_tokenizer(path), tiny.build_draft(dcfg).bind(target))
    with pytest.raises(DFlashError, match="LOSSLESSNESS FAILURE"):
        run_bench(eng, {"p": "def f(x):"}, max_tokens=[16], repeats=1, log=lambda _: None)


def test_bench_cli_bad_prompts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompts", str(tmp_path / "none"), "--blas", "bundled"])
    assert e.value.code == 2
    assert "prompt folder does not exist" in capsys.readouterr().err


def test_bench_context_length_axis(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")
    eng = mlx_dflash.load()
    res = run_bench(eng, read_prompts(tmp_path / "p"), max_tokens=[8], repeats=1, contexts=[40, 120],
                    log=lambda _: None)
    ctx = [r for r in res["results"] if r["prompt"].startswith("context_")]
    assert [r["prompt_tokens"] for r in ctx] == [40, 120]
    assert all(r["modes"]["dflash"]["peak_memory"] > 0 for r in ctx)
    md = write_results(res, tmp_path / "out", "t")[1].read_text()
    assert "| 120 | 8 |" in md and "Speedup at the longest context" in md
