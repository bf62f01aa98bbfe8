"""Pipeline-parallel targets: 2 and 3 local processes over the ring backend on loopback.

Each test starts the ranks itself (the environment ``mlx.launch`` would set:
MLX_RANK and a hostfile of 127.0.0.1 ports), running this file as a script.
Rank 0 generates through the pipeline and, for comparison, with the whole
model in one process; every rank saves its own layers' cache after each case.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 10, 20, 30, 40, 7, 7, 100]


# --- the rank program ---------------------------------------------------------------


class RecordingDraft:
    """Wraps a draft: logs the target features it is given (to compare the
    pipeline's with one process's) and, with ``script``, proposes a known
    continuation right for ``accept`` slots of each block, wrong after."""

    def __init__(self, draft, script=None, accept=None, seed=0):
        self.draft, self.script, self.accept = draft, script, accept
        self.rng = np.random.default_rng(seed)
        self.target_layer_ids = draft.target_layer_ids
        self.block_size = draft.block_size
        self.seen = []

    def make_cache(self, window=None):
        return self.draft.make_cache(window)

    def __call__(self, features, anchor, pos, B, cache):
        import mlx.core as mx

        if features is not None:
            self.seen.append(np.array(features))
        logits = self.draft(features, anchor, pos, B, cache)
        if self.script is None:
            return logits
        out = np.zeros(logits.shape, np.float32)
        right = int(self.rng.integers(0, B)) if self.accept is None else self.accept
        for j in range(1, B):
            p = pos + j
            tok = self.script[p] if p < len(self.script) else 0
            out[j - 1, tok if j <= right else (tok + 1) % out.shape[1]] = 1.0
        return mx.array(out)


CASES = {
    "plain": dict(draft=None),
    "chain": dict(draft="real"),
    "chain-partial": dict(draft="script"),
    "tree": dict(draft="script", tree_budget=6, tree_topk=2),
    "tree-real": dict(draft="real", tree_budget=6),
    "sample-chain": dict(draft="script", temperature=0.9, seed=5),
    "sample-tree": dict(draft="script", temperature=0.9, seed=5, tree_budget=5, tree_topk=2),
    # EOS inside the generation: the plain loop undoes the step it queued past it
    "plain-eos": dict(draft=None, eos_at=9),
    "chain-eos": dict(draft="script", eos_at=9),
    # a 300-token prompt in chunks of 128: token ids longer than the header carries inline
    "chain-long": dict(draft="script", prompt=[(7 * i + 3) % 500 for i in range(300)], prefill_chunk=128),
}


def _rank_main(args):
    import mlx.core as mx

    from mlx_dflash import load
    from mlx_dflash.decode import GenerationStats, generate_tokens
    from mlx_dflash.distributed import Pipeline
    from mlx_dflash.loading import load_draft, load_target, tensor_sizes

    out = Path(args.out)
    engine = load(args.model, args.draft, dtype=mx.float32, pipeline=Pipeline(timeout=args.timeout))
    stage = engine.stage
    r = stage.rank
    info = {
        "rank": r,
        "layers": list(stage.layers),
        "bounds": stage.bounds,
        "share_bytes": stage.share_bytes,
        "load_peak": stage.load_peak_memory,
        "total_bytes": stage.costs.total,
    }
    if r == 0 and engine.draft is not None:
        info["draft_bytes"] = sum(tensor_sizes(args.draft).values())
    (out / f"info{r}.json").write_text(json.dumps(info))
    results = {}
    ref_t = ref_d = None
    if r == 0:
        if args.model.endswith(".gguf"):
            from mlx_dflash.loading.gguf import load_gguf_target

            ref_t, _ = load_gguf_target(args.model, dtype=mx.float32)
        else:
            ref_t = load_target(args.model, dtype=mx.float32)
        ref_d = load_draft(args.draft, ref_t) if args.draft else None
    for name in args.cases:
        case = dict(CASES[name])
        if r != 0:
            stage.serve()
            if args.die_after_s is not None:
                return
        else:
            kind = case.pop("draft")
            temp, seed = case.pop("temperature", 0.0), case.pop("seed", 0)
            prompt = case.pop("prompt", PROMPT)
            eos_at = case.pop("eos_at", None)
            # The draft's full block every cycle: the adaptive width depends on
            # timings, and single and pipeline runs must verify the same blocks.
            case.setdefault("adaptive", False)
            outs, feats, stats = {}, {}, {}
            script = None
            for which, target, d in (("single", ref_t, ref_d), ("pipeline", stage.target, engine.draft)):
                if (kind == "script" or eos_at is not None) and script is None:
                    script = prompt + [t for ts in generate_tokens(ref_t, prompt, max_tokens=args.n) for t in ts]
                draft = None
                if kind is not None:
                    draft = RecordingDraft(d, script if kind == "script" else None)
                cache = target.make_cache()
                toks = []
                stats[which] = GenerationStats()
                for ts in generate_tokens(
                    target,
                    prompt,
                    draft=draft,
                    max_tokens=args.n,
                    cache=cache,
                    temperature=temp,
                    seed=seed,
                    stats=stats[which],
                    eos_token_ids=[script[len(prompt) + eos_at]] if eos_at else (),
                    **case,
                ):
                    toks.extend(ts)
                    if args.die_after_s is not None and which == "pipeline":
                        time.sleep(0.05)
                outs[which] = toks
                feats[which] = draft.seen if draft is not None else []
                if which == "pipeline":
                    target.sync()
                    target.stop()  # the other ranks leave serve() to save their caches
                else:
                    # The committed tokens: the prompt and all emitted but the last; with
                    # EOS inside an accepted block, also the accepted drafts after it.
                    seq = prompt + toks[:-1] if cache.offset < len(prompt) + len(toks) else script
                    assert cache.offset >= len(prompt) + len(toks) - 1
                    ref = ref_t.make_cache()
                    ref_t.prefill(seq[: cache.offset], ref)
                    np.savez(out / f"{name}-ref.npz", *[np.array(x) for x in _layer_state(ref)])
            fs, fp = feats["single"], feats["pipeline"]
            feat_err = max((float(np.abs(np.concatenate(fs) - np.concatenate(fp)).max()) if fs else 0.0), 0.0)
            results[name] = {
                "single": outs["single"],
                "pipeline": outs["pipeline"],
                "feature_rows": [sum(len(x) for x in fs), sum(len(x) for x in fp)],
                "feature_err": feat_err,
                "accept_hist": [stats["single"].accept_hist, stats["pipeline"].accept_hist],
            }
        cache = stage.worker.cache if r != 0 else cache.local
        np.savez(out / f"{name}-rank{r}.npz", *[np.array(x) for x in _layer_state(cache)])
    if r == 0:
        (out / "results.json").write_text(json.dumps(results))
        stage.closed = True  # the others have left serve() for the last time


def _layer_state(cache):
    """Per layer, its state arrays (KV up to offset; DeltaNet conv and ssm), flattened in order."""
    out = []
    for c in cache.layers:
        out.extend(c.state())
    return out


# --- the tests ----------------------------------------------------------------------


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(tmp, n, argv, script=True):
    """Start ``n`` ranks as mlx.launch would (of this file, or ``python ARGV``)."""
    hosts = tmp / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            MLX_RANK=str(r),
            MLX_HOSTFILE=str(hosts),
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        cmd = [sys.executable, __file__, *argv] if script else [sys.executable, *argv]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def wait_all(procs, timeout):
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank did not finish in time")
        outs.append((p.returncode, o, e))
    return outs


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from tools import tiny

    root = tmp_path_factory.mktemp("pipe")
    tok = tiny.build_tokenizer(root / "tok", vocab_size=400)
    out = {}
    for name, moe in (("dense", False), ("moe", True)):
        cfg = tiny.target_config(moe=moe, num_hidden_layers=6)
        m = tiny.build_target(cfg, seed=3 if not moe else 7)
        tiny.save_hf(m, cfg, root / name, tokenizer_dir=tok)
        dcfg = tiny.draft_config(cfg, block_size=6, target_layer_ids=[1, 4])
        tiny.save_draft(tiny.build_draft(dcfg, seed=5), dcfg, root / f"{name}-draft")
        out[name] = (root / name, root / f"{name}-draft")
        if not moe:
            from gguf_writer import convert_hf_to_gguf

            out["dense-gguf"] = (convert_hf_to_gguf(root / name, root / "dense.gguf"), root / f"{name}-draft")
    return out


def run_pipeline(tmp, n, model, draft, cases, tokens=20, timeout=300):
    out = tmp / f"out{n}"
    out.mkdir(exist_ok=True)
    argv = ["--model", str(model), "--out", str(out), "--n", str(tokens), "--cases", *cases]
    if draft:
        argv += ["--draft", str(draft)]
    results = wait_all(launch(tmp, n, argv), timeout)
    errs = "\n".join(f"--- rank {r} (rc {rc}):\n{e[-2000:]}" for r, (rc, o, e) in enumerate(results) if rc)
    assert not errs, errs
    return out


def check(out, n, cases):
    res = json.loads((out / "results.json").read_text())
    infos = [json.loads((out / f"info{r}.json").read_text()) for r in range(n)]
    # contiguous stages covering every layer, rank n-1 first
    bounds = infos[0]["bounds"]
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(e > s for s, e in bounds)
    for r, info in enumerate(infos):
        # each rank read only its share: its layers (+ embedding / norm, head, draft)
        assert tuple(info["layers"]) == tuple(bounds[n - 1 - r])
        assert info["share_bytes"] < 0.8 * (info["total_bytes"] + infos[0].get("draft_bytes", 0))
        assert info["load_peak"] * 1e9 <= info["share_bytes"] * 1.02 + 65536, info
    for name in cases:
        r = res[name]
        assert r["pipeline"] == r["single"], name
        assert len(r["single"]) > 0
        if "eos" in name:
            assert len(r["single"]) < 20  # stopped at the EOS token
        assert r["feature_rows"][0] == r["feature_rows"][1], name
        assert r["feature_err"] < 1e-4, name
        assert r["accept_hist"][0] == r["accept_hist"][1], name  # the same acceptance, cycle by cycle
        ref = np.load(out / f"{name}-ref.npz")
        ref = [ref[f"arr_{i}"] for i in range(len(ref.files))]
        got = []
        for rank in range(n - 1, -1, -1):  # stage order
            z = np.load(out / f"{name}-rank{rank}.npz")
            got += [z[f"arr_{i}"] for i in range(len(z.files))]
        assert len(got) == len(ref), name
        for g, w in zip(got, ref):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)
    return res


def test_plan_stages_minimises_the_largest_stage():
    """The split is contiguous, non-empty and as balanced as any split can be
    (checked against every split), with the embedding on the first stage and
    norm, head and draft on the last."""
    from itertools import combinations

    from mlx_dflash.distributed import plan_stages

    rng = np.random.default_rng(0)
    for _ in range(40):
        L, n = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        n = min(n, L)
        costs = [int(c) for c in rng.integers(1, 100, L)]
        first, last = int(rng.integers(0, 150)), int(rng.integers(0, 150))

        def worst(bounds):
            loads = [sum(costs[a:b]) for a, b in bounds]
            loads[0] += first
            loads[-1] += last
            return max(loads)

        got = plan_stages(costs, n, first, last)
        assert got[0][0] == 0 and got[-1][1] == L and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(b > a for a, b in got)
        best = min(worst(list(zip((0,) + c, c + (L,)))) for c in combinations(range(1, L), n - 1))
        assert worst(got) == best
    # MoE layers weigh more than DeltaNet ones: fewer of them per stage
    assert plan_stages([1, 1, 1, 1, 8, 8], 2) == [(0, 5), (5, 6)]
    with pytest.raises(Exception, match="cannot split 3 layers into 4"):
        plan_stages([1, 1, 1], 4)


def test_costs_group_tensors_by_layer():
    from mlx_dflash.distributed import costs_from_sizes

    hf = {
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": 10,
        "model.language_model.layers.1.self_attn.q_proj.weight": 7,
        "model.language_model.layers.1.mlp.experts.gate_up_proj": 100,
        "model.language_model.embed_tokens.weight": 50,
        "lm_head.weight": 40,
        "model.language_model.norm.weight": 1,
        "mtp.layers.0.fc.weight": 999,
        "model.visual.blocks.0.attn.qkv.weight": 999,
    }
    c = costs_from_sizes(hf, 2)
    assert (c.layers, c.embed, c.head, c.norm) == ([10, 107], 50, 40, 1)
    mlx = {
        "language_model.model.layers.1.mlp.switch_mlp.up_proj.scales": 3,
        "language_model.model.layers.2.input_layernorm.weight": 5,  # an MTP layer past the last
        "language_model.lm_head.weight": 4,
    }
    c = costs_from_sizes(mlx, 2)
    assert (c.layers, c.head) == ([0, 3], 4)
    gg = {"blk.0.attn_qkv.weight": 6, "token_embd.weight": 9, "output.weight": 8, "output_norm.weight": 2}
    c = costs_from_sizes(gg, 1)
    assert (c.layers, c.embed, c.head, c.norm) == ([6], 9, 8, 2)


def test_info_shows_the_stage_plan(capsys, tmp_path):
    from mlx_dflash.cli import main
    from mlx_dflash.distributed import stage_plan
    from tools import tiny

    cfg = tiny.target_config(moe=True, num_hidden_layers=6)
    path = tiny.save_hf(
        tiny.build_target(cfg, seed=1),
        cfg,
        tmp_path / "m",
        tokenizer_dir=tiny.build_tokenizer(tmp_path / "tok", vocab_size=300),
    )
    with pytest.raises(SystemExit) as e:
        main(["info", str(path), "--stages", "3"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    p = stage_plan(path, 3)
    for s, (a, b) in enumerate(p.bounds):
        assert f"rank {2 - s}: layers {a}-{b - 1}" in out
    assert sum(p.shares) == p.costs.total
    with pytest.raises(SystemExit) as e:  # more ranks than layers: the error comes before any report
        main(["info", str(path), "--stages", "100"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == "" and "error:" in captured.err


def test_pipeline_without_a_launch_is_a_clear_error(capsys):
    from mlx_dflash.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--pipeline", "x"])
    assert e.value.code == 2
    assert "error: --pipeline needs 2 or more processes" in capsys.readouterr().err


def test_pipeline_serve_without_a_launch_is_a_clear_error(capsys):
    from mlx_dflash.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--pipeline"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        "error: --pipeline needs 2 or more processes: run under `mlx.launch --backend ring -n N` or with a hostfile"
    ]


def test_two_stage_dense_plain_and_chain(tmp_path, pair_dirs):
    """Plain and DFlash chain decoding over 2 stages equal one process's, token
    for token; the draft sees the same features; each stage's cache equals a
    plain forward over the committed tokens."""
    model, draft = pair_dirs["dense"]
    cases = ["plain", "chain-partial", "chain-long", "plain-eos"]
    out = run_pipeline(tmp_path, 2, model, draft, cases)
    res = check(out, 2, cases)
    assert res["chain-partial"]["feature_rows"][0] > len(PROMPT)
    hist = res["chain-partial"]["accept_hist"][0]
    assert sum(hist[2:]) > 0 and sum(hist) < 19  # some cycles accepted drafts


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "moe"])
@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_all_modes(tmp_path, pair_dirs, which, n):
    model, draft = pair_dirs[which]
    cases = list(CASES)
    out = run_pipeline(tmp_path, n, model, draft, cases, timeout=900)
    check(out, n, cases)


@pytest.mark.slow
def test_two_stage_gguf_target(tmp_path, pair_dirs):
    """A GGUF target: each rank decodes only its own tensors; outputs and caches as one process's."""
    model, draft = pair_dirs["dense-gguf"]
    cases = ["plain", "chain-partial", "tree"]
    check(run_pipeline(tmp_path, 2, model, draft, cases), 2, cases)


def _cli(model, draft, extra):
    return [
        "-m",
        "mlx_dflash",
        "generate",
        "--pipeline",
        "-m",
        str(model),
        "-d",
        str(draft),
        "--no-chat-template",
        *extra,
        "def fibonacci(n):",
    ]


def test_two_stage_generate_with_adapters_equals_one_process(tmp_path, pair_dirs):
    """--adapter-path under --pipeline: each rank adapts its own layers; the
    text is one process's with the same adapters (and not the base model's)."""
    from test_adapters import write_adapters

    import mlx_dflash

    model, draft = pair_dirs["dense"]
    adapters = write_adapters(model, tmp_path / "lora", "lora", num_layers=4)
    outs = wait_all(launch(tmp_path, 2, _cli(model, draft, ["--adapter-path", str(adapters), "-n", "16"]), False), 300)
    for rc, _, err in outs:
        assert rc == 0, err[-2000:]
    engine = mlx_dflash.load(str(model), str(draft), adapter_path=adapters)
    want = mlx_dflash.generate(engine, "def fibonacci(n):", max_tokens=16).text
    base = mlx_dflash.generate(mlx_dflash.load(str(model), str(draft)), "def fibonacci(n):", max_tokens=16).text
    assert want != base and outs[0][1].rstrip("\n") == want


def _wait_for_output(proc, timeout):
    """Block until rank 0 has printed generated text (the generation is under way)."""
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r and os.read(proc.stdout.fileno(), 1024):
            return
        assert proc.poll() is None, proc.stderr.read()
    raise AssertionError("rank 0 printed nothing")


def test_two_stage_serve_equals_generate(tmp_path, pair_dirs):
    """`serve --pipeline` on 2 ranks: rank 0 answers an OpenAI chat completion
    with what one process's generate() gives; on SIGTERM every rank exits 0."""
    import httpx

    import mlx_dflash

    model, draft = pair_dirs["dense"]
    port = _free_ports(1)[0]
    procs = launch(
        tmp_path,
        2,
        [
            "-m",
            "mlx_dflash",
            "serve",
            "--pipeline",
            "-m",
            str(model),
            "-d",
            str(draft),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        script=False,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": str(model),
                "messages": [{"role": "user", "content": "def fibonacci(n):"}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
    finally:
        procs[0].send_signal(signal.SIGTERM)
        outs = wait_all(procs, 60)
    for rc, _, err in outs:
        assert rc == 0, err[-2000:]
    assert "prefix cache off" in outs[0][2]
    engine = mlx_dflash.load(str(model), str(draft))
    want = mlx_dflash.generate(engine, engine.encode("def fibonacci(n):", chat_template=True), max_tokens=24)
    assert len(want.tokens) > 0 and got == want.text


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_killed_rank_ends_every_rank_with_an_error(tmp_path, pair_dirs, n):
    """SIGKILL rank 1 mid-generation: every other rank exits non-zero with one
    error line, within seconds (no hang): the lost link when the ring backend
    notices the closed socket (about a second), else the watchdog's."""
    model, draft = pair_dirs["dense"]
    procs = launch(
        tmp_path, n, _cli(model, draft, ["-n", "4000", "--baseline", "--pipeline-timeout", "8"]), script=False
    )
    _wait_for_output(procs[0], 120)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    outs = wait_all([p for r, p in enumerate(procs) if r != 1], 30)
    elapsed = time.monotonic() - t0
    assert elapsed < 20
    for rc, _, err in outs:
        assert rc == 2, err[-2000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and ("lost the link" in lines[0] or "no message from rank" in lines[0]), err[-2000:]
        assert "Traceback" not in err


@pytest.mark.slow
def test_silent_rank_trips_the_watchdog(tmp_path, pair_dirs):
    """A rank that stops answering without closing its sockets (SIGSTOP, as a
    dropped cable would look) ends rank 0 after --pipeline-timeout seconds."""
    model, draft = pair_dirs["dense"]
    procs = launch(
        tmp_path, 2, _cli(model, draft, ["-n", "4000", "--baseline", "--pipeline-timeout", "3"]), script=False
    )
    try:
        _wait_for_output(procs[0], 120)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        ((rc, _, err),) = wait_all(procs[:1], 30)
        elapsed = time.monotonic() - t0
    finally:
        procs[1].kill()
        procs[1].wait()
    assert rc == 2 and 2.5 < elapsed < 15, (rc, elapsed, err[-2000:])
    assert "error: rank 0: no message from rank 1 for 3 s" in err


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--die-after-s", type=float, default=None)
    ap.add_argument("--cases", nargs="+", default=["plain"])
    _rank_main(ap.parse_args())
