"""GGUF targets: K-quant encoders, loading every layout convention, tokenizer,
convert, lossless decoding, and bad files."""

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import mlx_dflash
from mlx_dflash import tiny
from mlx_dflash.cli import main
from mlx_dflash.decode import GenerationStats, generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.gguf import load_gguf_target, open_gguf, write_tokenizer
from mlx_dflash.models.qwen35 import Target

from gguf_writer import encode_q4_k, encode_q6_k, write_gguf

PROMPT = [1, 5, 9, 33, 71, 100, 4, 8, 200, 301, 17]


def rel_err(a, b):
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("enc, qt, step", [(encode_q4_k, Q.Q4_K, 15), (encode_q6_k, Q.Q6_K, 63)])
def test_k_quant_encoders_decode_with_gguf(enc, qt, step):
    x = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32)
    y = dequantize(enc(x), qt)
    assert y.shape == x.shape
    # Error within about half a quantization step of each 256-value block's range.
    rng = (x.reshape(-1, 256).max(1) - np.minimum(x.reshape(-1, 256).min(1), 0)).max()
    assert np.abs(y - x).max() <= rng / step


@pytest.fixture(scope="module")
def wide():
    """Dims that are multiples of 256, so K-quants apply."""
    out = {}
    for moe in (False, True):
        cfg = tiny.target_config(moe=moe, vocab_size=512, hidden_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                 linear_value_head_dim=64, moe_intermediate_size=256,
                                 shared_expert_intermediate_size=256)
        out[moe] = (cfg, tiny.build_target(cfg, seed=12))
    return out


def qtype_fn(kind):
    def f(name, w):
        if kind == "F32":
            return Q.F32
        if kind == "F16":
            return Q.F16
        if kind == "Q4_K_M":  # llama.cpp's mix: Q6_K for output/embeddings/down, Q4_K elsewhere
            if w.shape[-1] % 256:
                return Q.Q8_0
            return Q.Q6_K if any(s in name for s in ("output.", "token_embd", "ffn_down", "attn_v")) else Q.Q4_K
        return getattr(Q, kind)
    return f


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("kind, tol", [("F32", 1e-5), ("F16", 5e-3)])
def test_float_gguf_logits_match_reference(wide, tmp_path, moe, kind, tol):
    # Float files pin every layout convention: names, reversed dims, ssm_a,
    # dt bias, conv squeeze, norm shifts, value-head order.
    cfg, model = wide[moe]
    path = write_gguf(model, cfg, tmp_path / f"m-{kind}.gguf", qtype_fn(kind))
    target, qcfg = load_gguf_target(path)
    assert "quantization" not in qcfg
    got, want = target(PROMPT), Target(model)(PROMPT)
    assert rel_err(got, want) <= tol, (kind, rel_err(got, want))


def weight_errors(a_model, b_model):
    from mlx.utils import tree_flatten

    b = dict(tree_flatten(b_model.parameters()))
    out = {}
    for k, v in tree_flatten(a_model.parameters()):
        x, y = np.array(v.astype(mx.float32), np.float64), np.array(b[k].astype(mx.float32), np.float64)
        out[k] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12))
    return out


def dequantized(model):
    import copy

    from mlx_lm.utils import dequantize_model

    return dequantize_model(copy.deepcopy(model))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("kind, tol, bits", [("Q8_0", 0.01, 8), ("Q5_1", 0.05, 8), ("Q4_0", 0.12, 4),
                                             ("Q4_1", 0.12, 4), ("Q4_K_M", 0.12, 4)])
def test_quantized_gguf_weights_within_quantization_error(wide, tmp_path, moe, kind, tol, bits):
    # A tiny random network amplifies weight noise chaotically, so quantized
    # files are checked weight by weight: decoded (keep_precision) weights are
    # within the source type's error of the originals (a wrong layout or
    # decode gives errors near 1.4), and the requantized MLX weights within
    # the MLX quantization error of those.
    cfg, model = wide[moe]
    path = write_gguf(model, cfg, tmp_path / f"m-{kind}.gguf", qtype_fn(kind))
    exact, _ = load_gguf_target(path, keep_precision=True)
    for k, e in weight_errors(exact.model, model).items():
        assert e <= tol, (k, e)
    target, qcfg = load_gguf_target(path)
    assert qcfg["quantization"]["bits"] == bits
    for k, e in weight_errors(dequantized(target.model), exact.model).items():
        assert e <= (0.12 if bits == 4 else 0.01), (k, e)
    assert np.isfinite(np.array(target(PROMPT))).all()


def test_gguf_keep_precision_and_bits_map(wide, tmp_path):
    cfg, model = wide[False]
    path = write_gguf(model, cfg, tmp_path / "m.gguf", qtype_fn("Q8_0"))
    t8, c8 = load_gguf_target(path)
    assert c8["quantization"]["bits"] == 8
    t4, c4 = load_gguf_target(path, bits={"Q8_0": 4})
    assert c4["quantization"]["bits"] == 4
    tf, cf = load_gguf_target(path, keep_precision=True)
    assert "quantization" not in cf
    want = Target(model)(PROMPT)
    assert rel_err(tf(PROMPT), want) < rel_err(t4(PROMPT), want)


def test_gguf_tokenizer_equals_hf_tokenizer(tok_dir, tmp_path, wide):
    from mlx_dflash.loading import load_tokenizer

    cfg, model = wide[False]
    path = write_gguf(model, cfg, tmp_path / "t.gguf", tokenizer_dir=tok_dir)
    hf = load_tokenizer(tok_dir)
    ours = load_tokenizer(write_tokenizer(open_gguf(path), tmp_path / "tok"))
    for s in ["def fibonacci(n):\n    return n", "  spaces\tand\ttabs\n\n", "unicode: é ü 中文 🙂",
              "<|im_start|>user\nhi<|im_end|>", "Beautiful is better than ugly."]:
        assert ours.encode(s, add_special_tokens=False) == hf.encode(s, add_special_tokens=False), s
    assert ours.chat_template == hf.chat_template
    assert ours.eos_token_ids == hf.eos_token_ids


def test_generate_from_gguf_is_lossless_and_convert_roundtrips(wide, tok_dir, tmp_path, capsys):
    cfg, model = wide[True]
    path = write_gguf(model, cfg, tmp_path / "m.gguf", qtype_fn("Q4_K_M"), tokenizer_dir=tok_dir)
    eng = mlx_dflash.load(path)
    dcfg = tiny.draft_config(cfg, block_size=8)
    draft = tiny.build_draft(dcfg, seed=3).bind(eng.target)
    plain, spec = [], []
    for t in generate_tokens(eng.target, PROMPT, max_tokens=20):
        plain.extend(t)
    for t in generate_tokens(eng.target, PROMPT, draft=draft, max_tokens=20, block_size=8):
        spec.extend(t)
    assert spec == plain
    # convert -> folder -> same logits as the GGUF directly.
    with pytest.raises(SystemExit) as e:
        main(["convert", str(path), str(tmp_path / "mlx")])
    assert e.value.code in (0, None)
    folder = mlx_dflash.load(tmp_path / "mlx")
    assert mx.array_equal(folder.target(PROMPT), eng.target(PROMPT)).item()
    assert folder.tokenizer.encode("def f(x):") == eng.tokenizer.encode("def f(x):")
    # info on a GGUF file.
    with pytest.raises(SystemExit):
        main(["info", str(path)])
    out = capsys.readouterr().out
    assert "qwen35moe" in out and "Q4_K" in out and "Q6_K" in out


def test_bad_gguf_files(wide, tmp_path, capsys):
    cfg, model = wide[False]
    good = write_gguf(model, cfg, tmp_path / "good.gguf")
    raw = good.read_bytes()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(raw[: len(raw) // 2])
    missing = write_gguf(model, cfg, tmp_path / "missing.gguf", skip={"blk.0.ssm_a"})
    llama = write_gguf(model, cfg, tmp_path / "llama.gguf", arch="llama")
    # An unknown tensor type: patch the first tensor's type field to 99.
    from gguf import GGUFReader

    r = GGUFReader(str(good))
    f = r.tensors[0].field
    type_offset = f.offset + sum(p.nbytes for p in f.parts[:-2])
    bad = bytearray(raw)
    bad[type_offset : type_offset + 4] = (99).to_bytes(4, "little")
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(bad))
    cases = [(trunc, "truncated or corrupt"), (missing, "missing tensors ['blk.0.ssm_a']"),
             (llama, "unsupported GGUF architecture 'llama'"), (unknown, "truncated or corrupt")]
    for path, msg in cases:
        with pytest.raises(DFlashError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            load_gguf_target(path)
        with pytest.raises(SystemExit) as e:
            main(["generate", "hi", "--model", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err


@pytest.mark.parametrize("qt, tol", [(Q.F32, 1e-5), (Q.F16, 2e-2), (Q.BF16, 5e-2), (Q.Q8_0, 5e-2)])
def test_gguf_draft_loads_like_a_folder_draft(dense, tmp_path, qt, tol):
    from gguf_writer import write_draft_gguf
    from mlx_dflash.loading import load_draft

    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(cfg, block_size=8, num_hidden_layers=2)
    draft = tiny.build_draft(dcfg, seed=4).bind(target)
    path = write_draft_gguf(draft, dcfg, tmp_path / "draft.gguf", qt)
    loaded = load_draft(path, target, dtype=mx.float32)
    assert loaded.block_size == 8 and loaded.target_layer_ids == dcfg["dflash_config"]["target_layer_ids"]
    feats = mx.random.normal((9, 2 * 64), key=mx.random.key(0))
    a = draft(feats, 5, 9, 8, draft.make_cache())
    b = loaded(feats, 5, 9, 8, loaded.make_cache())
    assert rel_err(b, a) <= tol
    plain, spec = [], []
    for t in generate_tokens(target, PROMPT, max_tokens=16):
        plain.extend(t)
    for t in generate_tokens(target, PROMPT, draft=loaded, max_tokens=16, block_size=8):
        spec.extend(t)
    assert spec == plain
