"""train-draft: loss goes down, the folder loads and decodes losslessly, the
training mask isolates blocks, resume continues from the checkpoint."""

import json
import re
import tempfile

import mlx.core as mx
import numpy as np
import pytest

import mlx_dflash
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.draft import train_logits, training_mask
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.train import TrainConfig, train_draft
from tools import tiny

CFG = dict(seq_len=48, batch_size=4, blocks_per_seq=4, block_size=8, lr=3e-3, warmup=3, log_every=1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tok_dir):
    cfg = tiny.target_config(vocab_size=512)
    model = tiny.build_target(cfg, seed=4)
    d = tmp_path_factory.mktemp("train")
    path = tiny.save_mlx(model, cfg, d / "target", tokenizer_dir=tok_dir)
    corpus = d / "corpus.txt"
    corpus.write_text(tiny._CORPUS * 6)
    return path, corpus


def test_training_lowers_loss_and_output_loads_losslessly(target_dir, tmp_path):
    path, corpus = target_dir
    s = train_draft(path, tmp_path / "draft", corpus=[corpus], config=TrainConfig(steps=25, **CFG), log=lambda _: None)
    losses = [h["loss"] for h in s["history"]]
    assert np.mean(losses[-5:]) < losses[0] - 0.3
    eng = mlx_dflash.load(path, tmp_path / "draft")
    assert eng.draft.block_size == 8
    for prompt in ("def fib", "class Stack:"):
        a = mlx_dflash.generate(eng, prompt, max_tokens=24)
        b = mlx_dflash.generate(eng, prompt, max_tokens=24, baseline=True)
        assert a.tokens == b.tokens and len(a.tokens) == 24


def test_mask_block_sees_itself_and_only_earlier_context():
    anchors = mx.array([[2, 5]])
    m = np.array(training_mask(anchors, L=7, B=3))[0]
    want = np.zeros((6, 7 + 6), bool)
    want[0:3, 0:2] = True  # block 0 (anchor 2): context 0, 1
    want[3:6, 0:5] = True  # block 1 (anchor 5): context 0..4
    want[0:3, 7:10] = True  # own slots, bidirectional
    want[3:6, 10:13] = True
    assert (m == want).all()
    ms = np.array(training_mask(anchors, L=7, B=3, sliding_window=3))[0]
    want_s = want.copy()
    want_s[0:3, 0:2] = [[True, True]] * 3  # p >= 2 - 2
    want_s[3:6, 0:3] = False  # p >= 5 - 2 only
    want_s[0:3, 7:10] = np.tril(np.ones((3, 3), bool))
    want_s[3:6, 10:13] = np.tril(np.ones((3, 3), bool))
    assert (ms == want_s).all()


def test_training_forward_has_no_leak(dense):
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(cfg, block_size=4, target_layer_ids=[0, 2])
    draft = tiny.build_draft(dcfg, seed=1).bind(target)
    L = 20
    tokens = mx.random.randint(4, 500, (1, L), key=mx.random.key(0))
    feats = mx.random.normal((1, L, 2 * 64), key=mx.random.key(1))
    anchors = mx.array([[6, 12]])
    base = train_logits(draft, feats, tokens, anchors)
    # Features at or after an anchor must not change that block.
    f2 = feats.at[:, 6:].add(5.0)
    out = train_logits(draft, f2, tokens, anchors)
    assert mx.allclose(out[:, 0], base[:, 0], atol=1e-5).item()
    assert not mx.allclose(out[:, 1], base[:, 1], atol=1e-3).item()  # block 1 sees 6..11
    # Tokens other than a block's anchor (e.g. its labels) never reach it.
    t2 = tokens.at[:, 7:12].add(1)
    out = train_logits(draft, feats, t2, anchors)
    assert mx.allclose(out, base, atol=1e-5).item()


def test_resume_continues_from_checkpoint_step(target_dir, tmp_path):
    path, corpus = target_dir
    quiet = lambda _: None
    full = train_draft(
        path, tmp_path / "a", corpus=[corpus], config=TrainConfig(steps=6, checkpoint_every=0, **CFG), log=quiet
    )

    def killed_at_5(line):  # a run stopped after the checkpoint at step 3
        if line.startswith("step 5/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_draft(
            path,
            tmp_path / "b",
            corpus=[corpus],
            config=TrainConfig(steps=6, checkpoint_every=3, **CFG),
            log=killed_at_5,
        )
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 3
    # the same command again without --resume: it deleted the stopped run's checkpoint and started over
    with pytest.raises(DFlashError, match=r"holds a stopped run's checkpoint \(step 3 of 6\): give --resume"):
        train_draft(path, tmp_path / "b", corpus=[corpus], config=TrainConfig(steps=6, **CFG), log=quiet)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 3
    assert sorted(f.name for f in (tmp_path / "b" / "checkpoint").glob("*.safetensors")) == [
        "model-3.safetensors",
        "optimizer-3.safetensors",
    ]

    def resume(steps):
        cfg = TrainConfig(steps=steps, checkpoint_every=3, **CFG)
        return train_draft(path, tmp_path / "b", corpus=[corpus], resume=True, config=cfg, log=quiet)

    resumed = resume(6)
    assert resumed["start_step"] == 3
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-4)
    wa = mx.load(str(tmp_path / "a" / "model.safetensors"))
    wb = mx.load(str(tmp_path / "b" / "model.safetensors"))
    for k in wa:
        assert mx.allclose(wa[k], wb[k], atol=1e-5).item(), k
    # the finished run is checkpointed too: more --steps train on from it
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 6
    more = resume(8)
    assert more["start_step"] == 6 and [h["step"] for h in more["history"]] == [7, 8]
    assert not (tmp_path / "b" / ".partial").exists()


def test_generate_from_prompts_and_feature_cache(target_dir, tmp_path):
    path, _ = target_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\nclass Stack:\nimport os\n")
    logs = []
    cfg = TrainConfig(steps=2, gen_tokens=30, **{**CFG, "seq_len": 32})
    train_draft(path, tmp_path / "d", generate_from=prompts, feature_cache=tmp_path / "fc", config=cfg, log=logs.append)
    assert any("generating target continuations for 3 prompts" in l for l in logs)
    logs.clear()
    train_draft(path, tmp_path / "d", generate_from=prompts, feature_cache=tmp_path / "fc", config=cfg, log=logs.append)
    assert any("features from cache" in l for l in logs)
    assert not any("generating" in l for l in logs)  # the cache holds the generated tokens too


def test_a_damaged_feature_cache_is_computed_again(target_dir, tmp_path):
    path, corpus = target_dir
    cfg = TrainConfig(steps=1, **CFG)
    train_draft(path, tmp_path / "d", corpus=[corpus], feature_cache=tmp_path / "fc", config=cfg, log=lambda _: None)
    (cached,) = (tmp_path / "fc").glob("features-*.safetensors")
    cached.write_bytes(cached.read_bytes()[:100])  # a run killed while writing it (before writes were atomic)
    logs = []
    train_draft(path, tmp_path / "d", corpus=[corpus], feature_cache=tmp_path / "fc", config=cfg, log=logs.append)
    assert any("unreadable" in line and "computing the features again" in line for line in logs)
    assert mx.load(str(cached))["tokens"].shape[0] > 0  # and written again, whole


@pytest.mark.parametrize(
    "bad,words",
    [
        (dict(lr=-1.0), "--lr must be a positive number"),
        (dict(log_every=0), "--log-every must be >= 1"),
        (dict(init="foo"), "--init must be 'target' or 'random'"),
        (dict(warmup=-5), "--warmup must be >= 0"),
        (dict(checkpoint_every=-1), "--checkpoint-every must be >= 0"),
        (dict(selector_weight=float("nan")), "selector weight must be a number >= 0"),
        # the Python API's types: a string, a float, a bool where a count goes (steps=True trained one step)
        (dict(steps="2"), "steps must be an integer, got '2'"),
        (dict(steps=2.5), "steps must be an integer, got 2.5"),
        (dict(steps=True), "steps must be an integer, got True"),
        (dict(batch_size=None), "batch_size must be an integer, got None"),
        (dict(target_layer_ids="1,3"), "target_layer_ids must be a list of integers, got '1,3'"),
        (dict(lr="fast"), "lr must be a number, got 'fast'"),
    ],
)
def test_the_python_api_checks_the_config_as_the_cli_does(target_dir, tmp_path, bad, words):
    """train_draft refuses what the CLI refuses (lr=-1 trained by gradient
    ascent; log_every=0 divided by zero; init='foo' meant random), before any work."""
    path, corpus = target_dir
    with pytest.raises(DFlashError, match=re.escape(words)):
        train_draft(path, tmp_path / "d", corpus=[corpus], config=TrainConfig(**{**CFG, **bad}))
    assert not (tmp_path / "d").exists()


def test_a_feature_cache_under_home_is_written_where_it_was_made(target_dir, tmp_path, monkeypatch):
    """``--feature-cache ~/fc`` is one folder: the one made is the one written
    (the file used to go to a literal ``~`` folder beside the working one)."""
    path, corpus = target_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    train_draft(path, tmp_path / "d", corpus=[corpus], feature_cache="~/fc", config=TrainConfig(steps=1, **CFG))
    assert len(list((tmp_path / "home" / "fc").glob("features-*.safetensors"))) == 1
    assert not (tmp_path / "~").exists()


def test_bad_output_and_resume_are_refused_before_any_work(target_dir, tmp_path):
    """A draft never overwrites a model (the target's folder, or another
    model's); --resume without a checkpoint, or with --steps already done,
    and an unusable --feature-cache are refused before the features are computed."""
    path, corpus = target_dir
    cfg = TrainConfig(steps=2, **CFG)
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(DFlashError, match="is the target's folder"):
        train_draft(path, path, corpus=[corpus], config=cfg, log=lambda _: None)
    assert sorted(p.name for p in path.iterdir()) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(DFlashError, match="holds a model that is not a DFlash draft"):
        train_draft(path, other, corpus=[corpus], config=cfg, log=lambda _: None)
    with pytest.raises(DFlashError, match="--resume: no checkpoint"):
        train_draft(path, tmp_path / "new", corpus=[corpus], resume=True, config=cfg, log=lambda _: None)
    train_draft(
        path, tmp_path / "d", corpus=[corpus], config=TrainConfig(steps=3, checkpoint_every=2, **CFG), log=print
    )
    with pytest.raises(DFlashError, match="the checkpoint is at step 3; give --steps above it"):
        train_draft(path, tmp_path / "d", corpus=[corpus], resume=True, config=cfg, log=lambda _: None)
    # another draft than the checkpoint's, or a damaged checkpoint: before the features (it was a traceback after)
    c3 = TrainConfig(**{**CFG, "steps": 6, "num_layers": 3})
    with pytest.raises(
        DFlashError, match=r"this run's draft is not the checkpoint's .*num_hidden_layers: checkpoint 2, now 3"
    ):
        train_draft(path, tmp_path / "d", corpus=[corpus], resume=True, config=c3, log=lambda _: None)
    c6 = TrainConfig(**{**CFG, "steps": 6})
    state = (tmp_path / "d" / "checkpoint" / "state.json").read_text()
    (tmp_path / "d" / "checkpoint" / "state.json").write_text(state[:10])
    with pytest.raises(DFlashError, match=r"state.json is damaged"):
        train_draft(path, tmp_path / "d", corpus=[corpus], resume=True, config=c6, log=lambda _: None)
    (tmp_path / "d" / "checkpoint" / "state.json").write_text(state)
    weights = tmp_path / "d" / "checkpoint" / "model-3.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DFlashError, match=r"model-3.safetensors is missing or damaged"):
        train_draft(path, tmp_path / "d", corpus=[corpus], resume=True, config=c6, log=lambda _: None)
    weights.write_bytes(whole)
    with pytest.raises(DFlashError, match="config must be a TrainConfig, got dict"):
        train_draft(path, tmp_path / "d", corpus=[corpus], config={"steps": 2})
    train_draft(path, tmp_path / "d", corpus=[corpus], config=cfg, log=lambda _: None)  # a draft's folder: retrained
    # its checkpoint now this run's (the earlier run's, at step 3, stayed where a run saved none)
    assert json.loads((tmp_path / "d" / "checkpoint" / "state.json").read_text())["step"] == 2
    c0 = TrainConfig(**{**CFG, "steps": 2, "checkpoint_every": 0})
    train_draft(path, tmp_path / "d", corpus=[corpus], config=c0, log=lambda _: None)
    assert not (tmp_path / "d" / "checkpoint").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DFlashError, match="the --feature-cache folder .*afile is a file; give a folder path"):
        train_draft(path, tmp_path / "d2", corpus=[corpus], feature_cache=tmp_path / "afile", config=cfg)
    # a run refused after its folders were made leaves none of them behind
    with pytest.raises(DFlashError, match="out of range"):
        c = TrainConfig(target_layer_ids=[0, 99], **CFG)
        train_draft(path, tmp_path / "d3", corpus=[corpus], feature_cache=tmp_path / "fc3", config=c)
    assert not (tmp_path / "d3").exists() and not (tmp_path / "fc3").exists()


def test_features_stay_on_disk_and_are_read_a_batch_at_a_time(target_dir, tmp_path, monkeypatch):
    """The features are written as they are computed, into a safetensors file
    (read here by the safetensors library itself) that training reads a
    batch of rows at a time: MLX's peak memory stays under half the
    features' size, where it used to hold them all (about twice their size
    here). Without --feature-cache the file is temporary, gone after the run."""
    from safetensors.numpy import load_file

    from mlx_dflash.train import compute_features

    path, corpus = target_dir
    big = tmp_path / "big.txt"
    big.write_text(corpus.read_text() * 36)
    cfg = TrainConfig(steps=2, **{**CFG, "seq_len": 128})
    mx.synchronize()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what other tests in this process hold: the peak starts there
    train_draft(path, tmp_path / "a", corpus=[big], feature_cache=tmp_path / "fc", config=cfg, log=lambda _: None)
    peak = mx.get_peak_memory() - held
    (cached,) = (tmp_path / "fc").glob("features-*.safetensors")
    data = load_file(str(cached))
    tokens, feats = data["tokens"], data["features"]
    assert feats.dtype == np.float32 and feats.shape[:2] == tokens.shape and tokens.shape[1] == 128
    assert peak < feats.nbytes / 2, (peak, feats.nbytes)
    eng = mlx_dflash.load(path)
    ids = json.loads((tmp_path / "a" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    for i in (0, tokens.shape[0] - 1):
        ref = compute_features(eng.target, [tokens[i].tolist()], ids)[0]
        np.testing.assert_allclose(feats[i], np.array(ref), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    logs = []
    train_draft(path, tmp_path / "b", corpus=[corpus], config=TrainConfig(steps=1, **CFG), log=logs.append)
    assert any("(removed at the end)" in line for line in logs)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_features_that_do_not_fit_on_disk_are_refused_before_computing(target_dir, tmp_path, monkeypatch):
    path, corpus = target_dir
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    logs = []
    with pytest.raises(DFlashError, match=r"need .* on disk, .* has .* free; give --feature-cache a folder with room"):
        train_draft(path, tmp_path / "d", corpus=[corpus], config=TrainConfig(steps=1, **CFG), log=logs.append)
    assert not any("/" in line and "  " in line for line in logs)  # no progress lines: nothing was computed


def test_generation_features_equal_a_plain_forward(target_dir):
    """Features captured while generating (cached, token by token) are the
    ones a no-cache forward over the finished sequences gives."""
    from mlx_dflash.train import compute_features, generated_sequences

    path, _ = target_dir
    eng = mlx_dflash.load(path)
    seqs, feats = generated_sequences(eng, ["def fibonacci(n):", "class Stack:", "import os"], 24, 20, capture=[0, 2])
    assert feats is not None and len(feats) == 3
    for s, f in zip(seqs, feats):
        ref = compute_features(eng.target, [s], [0, 2])[0]
        assert f.shape == ref.shape == (len(s), 2 * eng.target.hidden_size)
        np.testing.assert_allclose(np.array(f), np.array(ref), rtol=1e-4, atol=1e-4)


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_train_draft_cli(target_dir, tmp_path, capsys):
    path, corpus = target_dir
    code, out = cli(
        capsys,
        "train-draft",
        "-m",
        str(path),
        "-o",
        str(tmp_path / "d"),
        "--corpus",
        str(corpus),
        "--steps",
        "2",
        "--seq-len",
        "40",
        "--batch-size",
        "2",
        "--block-size",
        "4",
    )
    assert code in (0, None), out
    assert "wrote" in out and (tmp_path / "d" / "config.json").exists()
    dcfg = json.loads((tmp_path / "d" / "config.json").read_text())
    # The context window defaults to the training length: every layer slides over it.
    assert dcfg["layer_types"] == ["sliding_attention"] * 2 and dcfg["sliding_window"] == 41
    assert dcfg["sliding_block_causal"] is False
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = ["train-draft", "-m", str(path), "-o", str(tmp_path / "x")]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    one_word = tmp_path / "one.txt"
    one_word.write_text("hello\n")
    for args, msg in [
        (
            ["train-draft", "-m", str(path), "-o", str(a_file / "out"), "--corpus", str(corpus)],
            f"cannot make the output folder {a_file / 'out'}",
        ),
        (
            ["train-draft", "-m", str(path), "-o", str(a_file), "--corpus", str(corpus)],
            "a_file is a file; give a folder",
        ),
        (base + ["--corpus", str(tmp_path / "nope.txt")], "corpus path does not exist"),
        (base + ["--corpus", str(empty)], "corpus is empty"),
        (
            ["train-draft", "-m", str(llama), "-o", str(tmp_path / "x"), "--corpus", str(corpus)],
            "unsupported model_type",
        ),
        (base + ["--corpus", str(corpus), "--block-size", "1"], "block size must be in 2..64"),
        (base + ["--corpus", str(corpus), "--target-layer-ids", "0,9"], "out of range"),
        (base + ["--corpus", str(corpus), "--target-layer-ids", "a,b"], "comma list"),
        (base, "exactly one data source"),
        (base + ["--corpus", str(corpus), "--resume"], "no checkpoint"),
        (base + ["--corpus", str(corpus), "--context-window", "-3"], "context window must be >= 0"),
        (base + ["--corpus", str(corpus), "--target-layer-ids", ""], "comma list"),
        (base + ["--corpus", str(corpus), "--warmup", "-5"], "--warmup must be >= 0"),
        (base + ["--corpus", str(corpus), "--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
        (base + ["--corpus", str(corpus), "--log-every", "0"], "--log-every must be >= 1"),
        # NaN compares false to every bound: it trained an all-NaN draft and exited 0
        (base + ["--corpus", str(corpus), "--lr", "nan"], "--lr must be a positive number"),
        (base + ["--corpus", str(corpus), "--grad-clip", "inf"], "--grad-clip must be a positive number"),
        (base + ["--corpus", str(corpus), "--gamma", "nan"], "--gamma must be a positive number"),
        (base + ["--corpus", str(corpus), "--weight-decay", "-1"], "--weight-decay must be a number >= 0"),
        (base + ["--generate-from", str(latin1)], "is not UTF-8 text"),
        (base + ["--generate-from", str(one_word), "--gen-tokens", "3"], "give more --gen-tokens"),
        (base + ["--corpus", str(corpus), "--gen-tokens", "64"], "a --corpus has none"),
    ]:
        code, out = cli(capsys, *args)
        assert code == 2, (args, out)
        assert msg in out and "Traceback" not in out, (args, out)


def test_train_dflash2_lowers_both_losses_and_decodes_losslessly(target_dir, tmp_path, capsys):
    """--arch dflash2: convolutions start as the identity (the first step's
    head loss is the v1 draft's), the head and selector losses fall, and the
    folder loads as a DFlash 2 draft that decodes like plain decoding."""
    path, corpus = target_dir
    quiet = lambda _: None
    v1 = train_draft(path, tmp_path / "v1", corpus=[corpus], config=TrainConfig(steps=1, **CFG), log=quiet)
    s = train_draft(
        path,
        tmp_path / "draft",
        corpus=[corpus],
        log=quiet,
        config=TrainConfig(steps=60, arch="dflash2", selector_top_k=4, selector_rank=8, **CFG),
    )
    h = s["history"]
    assert h[0]["head_loss"] == pytest.approx(v1["history"][0]["loss"], rel=1e-4)
    head = [x["head_loss"] for x in h]
    sel = [x["selector_loss"] for x in h]
    assert np.mean(head[-10:]) < head[0] - 0.3
    assert np.mean(sel[-10:]) < np.mean(sel[5:15])  # the selector learns once candidates hold the target's token
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["selector_top_k"] == 4 and cfg["dflash_config"]["conv_group_size"] == 64
    w = mx.load(str(tmp_path / "draft" / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in w and "layers.0.mlp_conv.base_kernel" in w
    eng = mlx_dflash.load(path, tmp_path / "draft")
    assert eng.draft.config.is_v2
    for prompt in ("def fib", "class Stack:"):
        a = mlx_dflash.generate(eng, prompt, max_tokens=24)
        b = mlx_dflash.generate(eng, prompt, max_tokens=24, baseline=True)
        assert a.tokens == b.tokens and len(a.tokens) == 24
    code, out = cli(
        capsys, "train-draft", "-m", str(path), "-o", str(tmp_path / "x"), "--corpus", str(corpus), "--arch", "dflash3"
    )
    assert code == 2 and "--arch must be" in out


def test_corpus_folders_skip_what_is_not_text(tmp_path):
    from mlx_dflash.train import read_texts

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "c" / "w.safetensors").write_bytes(b"\x00\x01\xff" * 100)
    logs = []
    assert read_texts([tmp_path / "c"], log=logs.append) == ["def f(x):\n    return x\n"]
    assert logs == [f"skipped 1 corpus files that are not UTF-8 text (the first: {tmp_path / 'c' / 'w.safetensors'})"]
    with pytest.raises(DFlashError, match="is not UTF-8 text"):
        read_texts([tmp_path / "c" / "w.safetensors"])
    (tmp_path / "n.jsonl").write_text('{"text": null}\n')
    with pytest.raises(DFlashError, match="the 'text' field is not a string"):
        read_texts([tmp_path / "n.jsonl"])
    # a byte-order mark (as Windows editors save UTF-8) read as "not a JSON line"; one path given alone
    (tmp_path / "bom.jsonl").write_text('{"text": "a b"}\n', encoding="utf-8-sig")
    assert read_texts(tmp_path / "bom.jsonl") == ["a b"]
    assert read_texts(str(tmp_path / "c" / "a.txt")) == ["def f(x):\n    return x\n"]
    # --text-field where no file is JSONL: it was ignored, and the whole files trained on
    with pytest.raises(DFlashError, match="--text-field 'body' names a JSONL field, and no corpus file is JSONL"):
        read_texts([tmp_path / "c" / "a.txt"], "body")
    (tmp_path / "b.jsonl").write_text('{"body": "x = 1"}\n')
    assert read_texts([tmp_path / "c" / "a.txt", tmp_path / "b.jsonl"], "body") == [
        "def f(x):\n    return x\n",
        "x = 1",
    ]
