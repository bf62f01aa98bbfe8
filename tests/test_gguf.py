"""GGUF files written the way llama.cpp's converter writes them (tests/gguf_writer.py,
independent of our loader): every layout convention, MTP blocks, float types,
tokenizer, stop tokens, drafts, convert, info, and bad files."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_writer import convert_draft_to_gguf, convert_hf_to_gguf, encode_q4_k, encode_q6_k
from support.reference import reference_greedy
from test_cli import cli

import mlx_dflash
from mlx_dflash.cli import main
from mlx_dflash.decode import generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.gguf import load_gguf_target, open_gguf, write_tokenizer
from mlx_dflash.models.qwen35 import Target
from tools import tiny

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
PROMPT = [1, 5, 9, 33, 71, 100, 4, 8, 200, 301, 17]


def rel_err(a, b):
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def plain_greedy(target, prompt, n):
    out = []
    for t in generate_tokens(target, prompt, max_tokens=n):
        out.extend(t)
    return out


def mlx_lm_model(folder):
    """mlx-lm's own load of a folder: the reference."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    return model


def add_mtp(hf_dir: Path, seed: int = 0) -> None:
    """Give an HF folder one MTP block as Qwen3.5 checkpoints ship it
    (``mtp.*`` tensors, ``mtp_num_hidden_layers`` in the config); mlx-lm drops it."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = cfg["text_config"]
    H = t["hidden_size"]
    w = mx.load(str(hf_dir / "model.safetensors"))
    full = next(i for i in range(t["num_hidden_layers"]) if (i + 1) % t["full_attention_interval"] == 0)
    pre = f"model.language_model.layers.{full}."
    rng = np.random.default_rng(seed)
    mtp = {"mtp.layers.0." + k[len(pre) :]: v + 0.01 for k, v in w.items() if k.startswith(pre)}
    mtp["mtp.fc.weight"] = mx.array(rng.normal(size=(H, 2 * H)).astype(np.float32) * 0.05)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = mx.array(rng.normal(size=(H,)).astype(np.float32) * 0.1)
    mx.save_safetensors(str(hf_dir / "mtp.safetensors"), mtp, metadata={"format": "pt"})
    t["mtp_num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.mark.parametrize("enc, qt, step", [(encode_q4_k, Q.Q4_K, 15), (encode_q6_k, Q.Q6_K, 63)])
def test_k_quant_encoders_decode_with_gguf(enc, qt, step):
    x = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32)
    y = dequantize(enc(x), qt)
    assert y.shape == x.shape
    # Error within about half a quantization step of each 256-value block's range.
    rng = (x.reshape(-1, 256).max(1) - np.minimum(x.reshape(-1, 256).min(1), 0)).max()
    assert np.abs(y - x).max() <= rng / step


# --- fidelity: the converter's conventions, Hv = 2 Hk and 3 Hk, dense and MoE ----------


@pytest.mark.parametrize(
    "moe, ratio, tied",
    [(False, 2, False), (False, 3, False), (True, 2, False), (True, 3, False), (False, 2, True)],
    ids=["dense-Hv=2Hk", "dense-Hv=3Hk", "moe-Hv=2Hk", "moe-Hv=3Hk", "dense-tied"],
)
def test_converted_f32_gguf_equals_reference(tok_dir, tmp_path, moe, ratio, tied):
    # The reference is mlx-lm's load of the HF folder the GGUF was converted
    # from. A value-head order left tiled in any one tensor (ssm_a was)
    # moves the logits by ~0.4 here. Small Qwen3.5 sizes tie the embeddings
    # (no output.weight in the file).
    cfg = tiny.target_config(
        moe=moe, linear_num_key_heads=2, linear_num_value_heads=2 * ratio, tie_word_embeddings=tied
    )
    hf = tiny.save_hf(tiny.build_target(cfg, seed=10 + ratio), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    assert tied != any(t.name == "output.weight" for t in open_gguf(path).tensors)
    target, qcfg = load_gguf_target(path)
    assert "quantization" not in qcfg and qcfg["torch_dtype"] == "float32"
    ref = mlx_lm_model(hf)
    got, want = target(PROMPT), ref(mx.array([PROMPT]))[0]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=0)
    assert plain_greedy(target, PROMPT, 16) == reference_greedy(ref, PROMPT, 16)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_in_a_gguf_is_the_configs(tok_dir, tmp_path, kind):
    """The rope.scaling keys llama.cpp's converter writes for a rope_scaling
    config were ignored (the logits of a YaRN model moved by ~0.9 here)."""
    cfg = tiny.target_config(max_position_embeddings=64)
    cfg["text_config"]["rope_parameters"].update(rope_type=kind, factor=4.0, original_max_position_embeddings=16)
    hf = tiny.save_hf(tiny.build_target(cfg, seed=12), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    target, _ = load_gguf_target(path)
    ref = mlx_lm_model(hf)
    long = PROMPT * 6  # past the original context, where the scaling matters
    np.testing.assert_allclose(np.array(target(long)), np.array(ref(mx.array([long]))[0]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gguf_with_mtp_block_loads_and_skips_it(tok_dir, tmp_path, moe, capsys):
    # The current converter appends the MTP block as blk.N (counted in
    # block_count, named by nextn_predict_layers); MoE files may fuse gate/up experts.
    cfg = tiny.target_config(moe=moe)
    hf = tiny.save_hf(tiny.build_target(cfg, seed=5), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    add_mtp(hf)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", fuse_gate_up=moe)
    r = open_gguf(path)
    n = cfg["text_config"]["num_hidden_layers"]
    assert any(t.name == f"blk.{n}.nextn.eh_proj.weight" for t in r.tensors)
    assert moe == any("ffn_gate_up_exps" in t.name for t in r.tensors)
    target, qcfg = load_gguf_target(path, progress=True)
    assert target.num_layers == n and qcfg["text_config"]["mtp_num_hidden_layers"] == 1
    err = capsys.readouterr().err
    assert "skipped the GGUF's 1 MTP (nextn) block" in err
    ref = mlx_lm_model(hf)
    np.testing.assert_allclose(np.array(target(PROMPT)), np.array(ref(mx.array([PROMPT]))[0]), atol=1e-4, rtol=0)
    with pytest.raises(SystemExit):
        main(["info", str(path)])
    assert "1 MTP (nextn) block(s), skipped at load" in capsys.readouterr().out


# --- float types and quantized files -------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """HF folders with dims that are multiples of 256, so K-quants apply."""
    out = {}
    for moe in (False, True):
        cfg = tiny.target_config(
            moe=moe,
            vocab_size=512,
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
        )
        model = tiny.build_target(cfg, seed=12)
        out[moe] = (cfg, model, tiny.save_hf(model, cfg, tmp_path_factory.mktemp("hf")))
    return out


def qtype_fn(kind):
    def f(name, w):
        if kind == "Q4_K_M":  # llama.cpp's mix: Q6_K for output/embeddings/down/v, Q4_K elsewhere
            if w.shape[-1] % 256:
                return Q.Q8_0
            return Q.Q6_K if any(s in name for s in ("output.", "token_embd", "ffn_down", "attn_v")) else Q.Q4_K
        return getattr(Q, kind)

    return f


def param_dtypes(model):
    from mlx.utils import tree_flatten

    return {k: v.dtype for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize(
    "kind, want", [("F16", mx.float16), ("BF16", mx.bfloat16), ("Q8_0", mx.float16), ("Q4_K_M", mx.float32)]
)
def test_gguf_keeps_the_float_type_mlx_lm_would(wide, tmp_path, kind, want):
    # As mlx_lm.convert: float weights in the file's half type (scales too for
    # Q8_0-style files, whose fp16 block scales float16 holds), A_log in
    # float32; float32 when the scales need it (K-quants) or when asked.
    cfg, model, hf = wide[False]
    path = convert_hf_to_gguf(hf, tmp_path / f"m-{kind}.gguf", qtype_fn(kind), tokenizer=False)
    target, qcfg = load_gguf_target(path)
    assert qcfg["torch_dtype"] == str(want).split(".")[-1]
    for k, dt in param_dtypes(target.model).items():
        if dt != mx.uint32:  # packed quantized weights aside
            assert dt == (mx.float32 if k.endswith("A_log") else want), (k, dt)
    assert target(PROMPT).dtype == want  # activations follow
    f32, _ = load_gguf_target(path, dtype=mx.float32)
    assert set(param_dtypes(f32.model).values()) - {mx.uint32} == {mx.float32}


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


SLOW = pytest.mark.slow  # the same checks as the Q4_K_M / Q8_0 rows, on more source types


@pytest.mark.parametrize(
    "moe, kind, tol, bits",
    [
        (False, "Q4_K_M", 0.12, 4),
        (True, "Q4_K_M", 0.12, 4),
        (False, "Q8_0", 0.01, 8),
        pytest.param(True, "Q8_0", 0.01, 8, marks=SLOW),
        pytest.param(False, "Q5_1", 0.05, 5, marks=SLOW),
        pytest.param(True, "Q5_1", 0.05, 5, marks=SLOW),
        pytest.param(False, "Q4_0", 0.12, 4, marks=SLOW),
        pytest.param(True, "Q4_0", 0.12, 4, marks=SLOW),
    ],
)
def test_quantized_gguf_weights_within_quantization_error(wide, tmp_path, moe, kind, tol, bits):
    # A tiny random network amplifies weight noise chaotically, so quantized
    # files are checked weight by weight: decoded (keep_precision, float32)
    # weights are within the source type's error of the originals (a wrong
    # layout gives errors near 1.4), the MLX weights (the file's own form)
    # equal to those but for Q6_K's 8-bit form.
    cfg, model, hf = wide[moe]
    path = convert_hf_to_gguf(hf, tmp_path / f"m-{kind}.gguf", qtype_fn(kind), tokenizer=False)
    exact, _ = load_gguf_target(path, keep_precision=True, dtype=mx.float32)
    for k, e in weight_errors(exact.model, model).items():
        assert e <= tol, (k, e)
    target, qcfg = load_gguf_target(path, dtype=mx.float32)
    assert qcfg["quantization"]["bits"] == bits and qcfg["quantization"]["mode"] == "affine"
    for k, e in weight_errors(dequantized(target.model), exact.model).items():
        assert e <= 8e-3, (k, e)  # 0 but for Q6_K (the Q4_K_M rows), ~1/5 of its own error
    assert np.isfinite(np.array(target(PROMPT))).all()


def test_gguf_keep_precision_and_bits_map(wide, tmp_path):
    cfg, model, hf = wide[False]
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", qtype_fn("Q8_0"), tokenizer=False)
    t8, c8 = load_gguf_target(path, dtype=mx.float32)
    assert c8["quantization"]["bits"] == 8
    t4, c4 = load_gguf_target(path, bits={"Q8_0": 4}, dtype=mx.float32)
    assert c4["quantization"]["bits"] == 4
    tf, cf = load_gguf_target(path, keep_precision=True, dtype=mx.float32)
    assert "quantization" not in cf
    want = Target(model)(PROMPT)
    assert rel_err(tf(PROMPT), want) < rel_err(t4(PROMPT), want)


# --- tokenizer and stop tokens ---------------------------------------------------------

# Qwen3.5's tokenizer.json split pattern (combining marks stay with letters).
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MULTILINGUAL = (
    "नमस्ते दुनिया, हिन्दी में लिखा गया पाठ। Crème brûlée, naïve cafe\u0301 re\u0301sume\u0301; "
    "中文字符测试，日本語のテキスト。한국어 문장. Emoji 🙂👍🏽🇫🇷 and code: "
    "def f(x_1):\n    return x_1 ** 2  # 12345678 1,000,000.25\n\t<|im_end|> done"
)


def qwen35_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer built the way Qwen3.5's tokenizer.json is
    (NFC, the Qwen3.5 split, byte-level), trained on multilingual text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=tiny.SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([MULTILINGUAL * 3, tiny._CORPUS], trainer=trainer)
    tok.add_tokens(["<think>", "</think>"])  # Qwen's user-defined (non-special) added tokens
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "add_bos_token": False,
                "chat_template": tiny.CHAT_TEMPLATE,
            }
        )
    )
    return path


def test_gguf_tokenizer_equals_hf_qwen35_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from mlx_dflash.loading import load_tokenizer

    cfg = tiny.target_config(vocab_size=768)
    hf = tiny.save_hf(
        tiny.build_target(cfg, seed=1), cfg, tmp_path / "hf", tokenizer_dir=qwen35_tokenizer(tmp_path / "t")
    )
    ref = AutoTokenizer.from_pretrained(str(hf))
    texts = [MULTILINGUAL, "  spaces\tand\ttabs\n\n", "<think>\nok</think>", "x" + "\u0301" * 3 + "y", "१२३ 123456"]
    ours = {}
    for pre in ("qwen35", "qwen2"):
        path = convert_hf_to_gguf(hf, tmp_path / f"{pre}.gguf", pre=pre)
        tok = load_tokenizer(write_tokenizer(open_gguf(path), tmp_path / f"tok-{pre}"))
        ours[pre] = [tok.encode(s, add_special_tokens=False) for s in texts]
    want = [ref.encode(s, add_special_tokens=False) for s in texts]
    assert ours["qwen35"] == want
    # qwen2's split cuts words at combining marks (Devanagari signs): other tokens.
    assert ours["qwen2"][0] != want[0]
    tok = load_tokenizer(write_tokenizer(open_gguf(tmp_path / "qwen35.gguf"), tmp_path / "again"))
    assert tok.decode(want[0]) == ref.decode(want[0])
    assert tok.chat_template == ref.chat_template


def test_stop_tokens_are_every_end_of_generation_id(tok_dir, tmp_path):
    # eos from the metadata, eot/eom where named, and the tokens llama.cpp
    # stops on by their text (<|endoftext|> here). Generation stops at the
    # first of them: make the model's 4th greedy token the file's eot.
    cfg = tiny.target_config()
    model = tiny.build_target(cfg, seed=21)
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    greedy = reference_greedy(model, PROMPT, 12)
    stop = greedy[3]
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", extra_ids={"eot": stop})
    eng = mlx_dflash.load(path)
    vocab = json.loads((Path(tok_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    assert eng.tokenizer.eos_token_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"], stop}
    res = mlx_dflash.generate(eng, PROMPT, max_tokens=12)
    assert res.tokens == greedy[: greedy.index(stop) + 1]
    assert res.stats.finish_reason == "stop"


def _vocab_gguf(path, tokens, ids=None, **flags):
    """A GGUF holding only a byte-level vocabulary, as gguf-py writes one
    (CONTROL types for the <...> tokens; ``ids``: tokenizer.ggml.KEY_token_id)."""
    from gguf import GGUFWriter, TokenType

    w = GGUFWriter(str(path), "qwen35")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t.startswith(("<", "[")) else TokenType.NORMAL for t in tokens])
    w.add_token_merges(["a b"])
    for key, i in (ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)
    for key, v in flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


def test_end_of_generation_ids_are_llama_cpps(tmp_path):
    """llama.cpp's special_eog_ids (llama-vocab.cpp): the FIM pad / repo /
    file-separator tokens (by key, else by text: every Qwen vocabulary has
    <|file_sep|> and <|repo_name|>), the eos/eot/eom ids and its list of
    texts; <|end|> dropped beside <|return|> and <|call|>, </s> beside
    <|tool_response>. Before, a Qwen GGUF's code completion ran past the
    <|file_sep|> where llama.cpp stops."""
    from mlx_dflash.loading.gguf import eog_token_ids

    qwen = [
        "a",
        "b",
        "ab",
        "<|endoftext|>",
        "<|im_end|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<|im_start|>",
    ]
    r = _vocab_gguf(tmp_path / "qwen.gguf", qwen, {"eos": 4})
    assert sorted(eog_token_ids(r)) == [3, 4, 5, 6, 7]
    # a key names the FIM token: its text is then not looked for
    r = _vocab_gguf(tmp_path / "key.gguf", qwen, {"eos": 4, "fim_sep": 2})
    assert sorted(eog_token_ids(r)) == [2, 3, 4, 5, 6]
    harmony = ["a", "b", "<|end|>", "<|return|>", "<|call|>", "<|start|>"]
    assert sorted(eog_token_ids(_vocab_gguf(tmp_path / "h.gguf", harmony))) == [3, 4]
    assert sorted(eog_token_ids(_vocab_gguf(tmp_path / "e.gguf", harmony[:3]))) == [2]
    gemma = ["a", "b", "</s>", "<eos>", "<turn|>", "<|tool_response>"]
    assert sorted(eog_token_ids(_vocab_gguf(tmp_path / "g.gguf", gemma))) == [3, 4, 5]
    assert sorted(eog_token_ids(_vocab_gguf(tmp_path / "s.gguf", gemma[:3]))) == [2]


def test_a_vocabulary_that_asks_for_a_bos_gets_one(tmp_path):
    """tokenizer.ggml.add_bos_token: llama.cpp puts the BOS before a text it
    tokenizes; the tokenizer built from the file (and the folder convert
    writes, loaded by transformers) does too. Qwen's files say false."""
    from transformers import AutoTokenizer

    tokens = ["<s>", "a", "b", "ab", "</s>"]
    r = _vocab_gguf(tmp_path / "bos.gguf", tokens, {"bos": 0, "eos": 4}, add_bos_token=True)
    folder = write_tokenizer(r, tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(str(folder)).encode("abab") == [0, 3, 3]
    r = _vocab_gguf(tmp_path / "nobos.gguf", tokens, {"bos": 0, "eos": 4}, add_bos_token=False)
    assert AutoTokenizer.from_pretrained(str(write_tokenizer(r, tmp_path / "tok2"))).encode("abab") == [3, 3]


def test_token_types_that_do_not_cover_the_tokens_are_refused(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "qwen35")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DFlashError, match="token_type has 2 entries for 3 tokens"):
        write_tokenizer(open_gguf(tmp_path / "m.gguf"), tmp_path / "tok")


def test_info_refuses_a_tensor_type_the_loader_cannot_decode(tok_dir, tmp_path):
    """An integer tensor where a weight belongs: info called it "8-bit/32,
    nearest" and exited 0, and generate then failed on it."""
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=23), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", lambda n, a: Q.I32 if n == "blk.0.ffn_up.weight" else Q.F32)
    r = run_cli("info", path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "blk.0.ffn_up.weight is of type I32, which this loader cannot decode" in r.stderr


# --- decoding, convert, info -------------------------------------------------------------


def test_generate_from_gguf_is_lossless_and_convert_writes_an_mlx_lm_folder(wide, tok_dir, tmp_path, capsys):
    cfg, model, _ = wide[True]
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", qtype_fn("Q4_K_M"))
    eng = mlx_dflash.load(path, dtype=mx.float32)
    assert "decoding m.gguf" in capsys.readouterr().err  # the tqdm bar
    dcfg = tiny.draft_config(cfg, block_size=8)
    draft = tiny.build_draft(dcfg, seed=3).bind(eng.target)
    plain = plain_greedy(eng.target, PROMPT, 20)
    spec = []
    for t in generate_tokens(eng.target, PROMPT, draft=draft, max_tokens=20, block_size=8):
        spec.extend(t)
    assert spec == plain
    # convert -> an mlx_lm.convert-style folder: mlx-lm loads it, same logits as the GGUF.
    with pytest.raises(SystemExit) as e:
        main(["convert", str(path), str(tmp_path / "mlx"), "--dtype", "float32"])
    assert e.value.code in (0, None)
    out = tmp_path / "mlx"
    saved = json.loads((out / "config.json").read_text())
    assert saved["quantization"]["bits"] == 4 and saved["quantization_config"] == saved["quantization"]
    assert saved["torch_dtype"] == "float32"
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    from mlx_lm import load as mlx_lm_load

    lm_model, lm_tok = mlx_lm_load(str(out))
    np.testing.assert_allclose(
        np.array(lm_model(mx.array([PROMPT]))[0]), np.array(eng.target(PROMPT)), atol=1e-4, rtol=0
    )
    folder = mlx_dflash.load(out)
    assert mx.array_equal(folder.target(PROMPT), eng.target(PROMPT)).item()
    assert folder.tokenizer.encode("def f(x):") == eng.tokenizer.encode("def f(x):")
    assert folder.tokenizer.eos_token_ids == eng.tokenizer.eos_token_ids
    with pytest.raises(SystemExit):
        main(["info", str(path)])
    out = capsys.readouterr().out
    assert "qwen35moe" in out and "Q4_K" in out and "Q6_K" in out and "loads as: float32" in out
    assert "pre-tokenizer qwen35, stops on ids" in out


def test_info_on_a_gguf_checks_the_draft_fit(tok_dir, tmp_path, capsys):
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=2), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    good = tiny.draft_config(cfg, block_size=8)
    bad = tiny.draft_config(tiny.target_config(num_hidden_layers=6), block_size=8, target_layer_ids=[1, 5])
    gd = tiny.save_draft(tiny.build_draft(good, seed=1), good, tmp_path / "good")
    bd = tiny.save_draft(tiny.build_draft(bad, seed=1), bad, tmp_path / "bad")
    gg = convert_draft_to_gguf(gd, hf, tmp_path / "good.gguf")
    for d, verdict, status in ((gd, "fits", 0), (gg, "fits", 0), (bd, "does NOT fit", 1)):
        with pytest.raises(SystemExit) as stop:
            main(["info", str(path), "--draft", str(d)])
        assert stop.value.code == status
        assert f"draft {d}: {verdict}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["info", str(gg)])
    out = capsys.readouterr().out
    assert "DFlash v1 draft" in out and "block size: 8" in out
    # A draft that cannot be read is an error, not a misfit.
    (tmp_path / "empty").mkdir()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(gg.read_bytes()[:1000])
    for d, words in ((tmp_path / "empty", "draft folder has no config.json"), (trunc, "truncated or corrupt")):
        code, out, err = cli(capsys, "info", str(path), "--draft", str(d))
        assert code == 2 and words in err and "fit" not in out, (d, out, err)


@pytest.mark.parametrize(
    "qt, tol, sliding",
    [(Q.F32, 1e-5, False), (Q.F32, 1e-5, True), (Q.F16, 2e-2, False), (Q.BF16, 5e-2, False), (Q.Q8_0, 5e-2, False)],
)
def test_gguf_draft_loads_like_a_folder_draft(dense, tok_dir, tmp_path, qt, tol, sliding):
    from mlx_dflash.loading import load_draft

    cfg, model = dense
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    target = Target(model)
    # a sliding layer with a window shorter than the 9-position context below
    window = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4) if sliding else {}
    dcfg = tiny.draft_config(cfg, block_size=8, num_hidden_layers=2, **window)
    draft = tiny.build_draft(dcfg, seed=4).bind(target)
    folder = tiny.save_draft(draft, dcfg, tmp_path / "draft")
    path = convert_draft_to_gguf(folder, hf, tmp_path / "draft.gguf", qtype=qt)
    loaded = load_draft(path, target, dtype=mx.float32)
    assert loaded.block_size == 8 and loaded.target_layer_ids == dcfg["dflash_config"]["target_layer_ids"]
    assert loaded.config.mask_token_id == dcfg["dflash_config"]["mask_token_id"]
    assert loaded.config.layer_types == dcfg.get("layer_types")
    feats = mx.random.normal((9, 2 * 64), key=mx.random.key(0))
    a = draft(feats, 5, 9, 8, draft.make_cache())
    b = loaded(feats, 5, 9, 8, loaded.make_cache())
    assert rel_err(b, a) <= tol
    plain, spec = plain_greedy(target, PROMPT, 16), []
    for t in generate_tokens(target, PROMPT, draft=loaded, max_tokens=16, block_size=8):
        spec.extend(t)
    assert spec == plain


@pytest.mark.parametrize("key", ["block_size", "mask_token_id", "target_layers"])
def test_draft_gguf_missing_a_dflash_key_is_named(dense, tok_dir, tmp_path, key):
    from mlx_dflash.loading import load_draft

    cfg, model = dense
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    dcfg = tiny.draft_config(cfg, block_size=8)
    folder = tiny.save_draft(tiny.build_draft(dcfg, seed=4), dcfg, tmp_path / "draft")
    path = convert_draft_to_gguf(folder, hf, tmp_path / "d.gguf", drop_keys={key}, tokenizer=False)
    with pytest.raises(DFlashError, match=rf"draft GGUF is missing dflash\.{key} "):
        load_draft(path, Target(model))


# --- bad files: one clear error each ---------------------------------------------------


def test_bad_gguf_files(tok_dir, tmp_path, capsys):
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    good = convert_hf_to_gguf(hf, tmp_path / "good.gguf", tokenizer=False)
    raw = good.read_bytes()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(raw[: len(raw) // 2])
    missing = convert_hf_to_gguf(hf, tmp_path / "missing.gguf", skip={"blk.0.ssm_a"}, tokenizer=False)
    llama = convert_hf_to_gguf(hf, tmp_path / "llama.gguf", arch="llama", tokenizer=False)
    # An unknown tensor type: patch the first tensor's type field to 99.
    from gguf import GGUFReader

    r = GGUFReader(str(good))
    f = r.tensors[0].field
    type_offset = f.offset + sum(p.nbytes for p in f.parts[:-2])
    bad = bytearray(raw)
    bad[type_offset : type_offset + 4] = (99).to_bytes(4, "little")
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(bad))
    cases = [
        (trunc, "truncated or corrupt"),
        (missing, "missing tensors ['blk.0.ssm_a']"),
        (llama, "unsupported GGUF architecture 'llama'"),
        (unknown, "truncated or corrupt"),
    ]
    for path, msg in cases:
        with pytest.raises(DFlashError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            load_gguf_target(path)
        with pytest.raises(SystemExit) as e:
            main(["generate", "hi", "--model", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err


# --- split files (gguf-split / the converter's --split-max-tensors) ------------------------


@pytest.mark.parametrize("small_first", [False, True], ids=["tensors-in-every-part", "metadata-only-first-part"])
def test_split_gguf_loads_as_the_whole_file(wide, tok_dir, tmp_path, capsys, small_first):
    cfg, model, _ = wide[False]
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = convert_hf_to_gguf(hf, tmp_path / "whole" / "m.gguf", qtype_fn("Q8_0"))
    first = convert_hf_to_gguf(
        hf, tmp_path / "split" / "m.gguf", qtype_fn("Q8_0"), split_max_tensors=12, small_first_shard=small_first
    )
    parts = sorted((tmp_path / "split").glob("m-*-of-*.gguf"))
    n = len(parts)
    assert n >= 3 and first == parts[0] and first.name == f"m-00001-of-{n:05d}.gguf"
    from gguf import GGUFReader

    assert (len(GGUFReader(str(first)).tensors) == 0) == small_first
    ref = mlx_dflash.load(whole)
    for given in (first, parts[-1]):  # any part names the file
        eng = mlx_dflash.load(given)
        assert mx.array_equal(eng.target(PROMPT), ref.target(PROMPT)).item()
        assert eng.tokenizer.encode("def f(x):") == ref.tokenizer.encode("def f(x):")
        assert eng.tokenizer.eos_token_ids == ref.tokenizer.eos_token_ids
    with pytest.raises(SystemExit):
        main(["info", str(first)])
    out = capsys.readouterr().out
    assert f"in {n} parts (m-00001-of-{n:05d}.gguf ...)" in out and "Q8_0" in out

    # A part missing, parts renamed, parts of two files mixed: one error naming the cause.
    moved = tmp_path / "moved.gguf"
    parts[1].rename(moved)
    with pytest.raises(DFlashError, match=f"missing part.*m-00002-of-{n:05d}.gguf"):
        open_gguf(first)
    renamed = tmp_path / "split" / "model-part1.gguf"
    moved.rename(parts[1])
    first.rename(renamed)
    with pytest.raises(DFlashError, match="is part 1 of a split GGUF.*name is not llama.cpp's"):
        open_gguf(renamed)
    renamed.rename(first)
    keep = parts[1].read_bytes()
    parts[1].write_bytes(parts[2].read_bytes())  # part 3 in part 2's place
    with pytest.raises(DFlashError, match=f"m-00002-of-{n:05d}.gguf says it is part 3 of {n}, not part 2"):
        open_gguf(first)
    parts[1].write_bytes(keep)
    assert len(open_gguf(first).tensors) == len(open_gguf(whole).tensors)


def test_gguf_tokenizer_folder_is_made_once_and_removed_at_exit(tok_dir, tmp_path):
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = (
        "import os, mlx_dflash\n"
        f"for _ in range(3): mlx_dflash.load({str(path)!r})\n"
        "print(len([n for n in os.listdir(os.environ['TMPDIR']) if n.startswith('mlx_dflash_gguf_tok_')]))\n"
    )
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "1"  # three loads, one folder
    assert not any(n.startswith("mlx_dflash_gguf_tok_") for n in os.listdir(scratch))  # gone at exit


def test_convert_refuses_a_folder_and_a_type_the_file_lacks(tok_dir, tmp_path, capsys):
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    code, _, err = cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "out1"))
    assert code == 2 and f"{tmp_path / 'hf'} is a folder, not a GGUF file" in err
    code, _, err = cli(capsys, "convert", str(path), str(tmp_path / "out2"), "--bits", "Q9_K=4")
    assert code == 2 and "has no Q9_K tensors to requantize (its types: F32)" in err, err
    assert not (tmp_path / "out2").exists()  # the folder it made for the failed run is gone
    (tmp_path / "afile").write_text("x")
    code, _, err = cli(capsys, "convert", str(path), str(tmp_path / "afile"))
    assert code == 2 and "is a file" in err
    code, _, err = cli(capsys, "convert", str(path), str(tmp_path / "out3"), "--keep-precision", "--bits", "Q8_0=4")
    assert code == 2 and "--keep-precision stores floats" in err


def test_convert_bits_that_would_change_nothing_are_refused(tok_dir, tmp_path, capsys):
    """--bits F32=4 on a file whose F32 tensors are norms and the like (llama.cpp
    keeps those F32 in every quantized file) was taken and did nothing: the
    folder came out Q8_0 as without it."""
    src = DATA / "tiny-qwen35-Q8_0.gguf"  # Q8_0 matrices, F32 norms, A_log, dt bias, conv
    code, _, err = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--bits", "F32=4")
    assert code == 2 and "Traceback" not in err, err
    assert (
        "--bits F32=4 matches no layer that can be quantized: its F32 tensors (blk.0.attn_norm.weight, "
        "blk.0.post_attention_norm.weight, blk.0.ssm_a, ...) are norms, biases, convolutions or other tensors "
        "that are no linear layer's weight and stay float (the types of its linear weights: Q8_0)"
    ) in err, err
    assert not (tmp_path / "out").exists()
    for bits, words in (
        (["=4"], "--bits takes TYPE=BITS"),
        (["Q8_0=4", "--bits", "q8_0=8"], "--bits gives Q8_0 two values (4 and 8)"),
    ):
        code, _, err = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--bits", *bits)
        assert code == 2 and words in err, err
    # In an all-F32 file the F32 tensors include the matrices: F32=4 quantizes them.
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    _, qcfg = load_gguf_target(convert_hf_to_gguf(hf, tmp_path / "f32.gguf"), bits={"F32": 4}, dtype=mx.float32)
    assert qcfg["quantization"]["bits"] == 4


def test_a_failed_convert_into_an_empty_folder_leaves_it_empty(tok_dir, tmp_path, capsys, monkeypatch):
    """The weights were written when the tokenizer failed: they go, and the
    folder the user made stays (empty), as it was."""
    import mlx_dflash.loading

    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf")

    def broken(*a, **k):
        raise DFlashError("the tokenizer could not be written")

    monkeypatch.setattr(mlx_dflash.loading, "load_tokenizer", broken)
    (tmp_path / "out").mkdir()
    code, _, err = cli(capsys, "convert", str(path), str(tmp_path / "out"))
    assert code == 2 and "the tokenizer could not be written" in err
    assert (tmp_path / "out").is_dir() and list((tmp_path / "out").iterdir()) == []
    # into folders it made, parents too: none of them stays (the parents did)
    code, _, err = cli(capsys, "convert", str(path), str(tmp_path / "new" / "deeper" / "out"))
    assert code == 2 and not (tmp_path / "new").exists()


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "mlx_dflash", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_acceptance_bad_inputs_exit_2(tok_dir, tmp_path):
    # An unknown pre-tokenizer, a truncated MTP layer, a draft GGUF missing
    # its mask token id: one error line each, exit status 2.
    cfg = tiny.target_config()
    model = tiny.build_target(cfg, seed=4)
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    pre = convert_hf_to_gguf(hf, tmp_path / "pre.gguf", pre="qwen9000")
    add_mtp(hf)
    n = cfg["text_config"]["num_hidden_layers"]
    mtp_cut = convert_hf_to_gguf(hf, tmp_path / "mtp.gguf", skip={f"blk.{n}.nextn.hnorm.weight"})
    dcfg = tiny.draft_config(cfg, block_size=8)
    folder = tiny.save_draft(tiny.build_draft(dcfg, seed=4), dcfg, tmp_path / "draft")
    nomask = convert_draft_to_gguf(folder, hf, tmp_path / "d.gguf", drop_keys={"mask_token_id"})
    with pytest.raises(DFlashError, match=rf"MTP block blk\.{n} .* missing \['blk\.{n}\.nextn\.hnorm\.weight'\]"):
        load_gguf_target(mtp_cut)
    whole = convert_hf_to_gguf(hf, tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"  # the file cut inside its last tensor (the MTP block's)
    cut.write_bytes(whole.read_bytes()[:-64])
    with pytest.raises(DFlashError, match="truncated or corrupt"):
        load_gguf_target(cut)
    cases = [
        (["generate", "hi", "--model", pre], "unknown GGUF pre-tokenizer type 'qwen9000' (tokenizer.ggml.pre)"),
        (["generate", "hi", "--model", mtp_cut], f"MTP block blk.{n}"),
        (["generate", "hi", "--model", whole, "--draft", nomask], "draft GGUF is missing dflash.mask_token_id"),
    ]
    for args, msg in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and msg in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def _reference_tool(module: str, *args, stdin: str = ""):
    """One of gguf-py's own scripts (gguf-set-metadata, gguf-convert-endian), as a llama.cpp user runs it."""
    r = subprocess.run(
        [sys.executable, "-m", f"gguf.scripts.{module}", *map(str, args)], input=stdin, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path):
    """A key_length the q projection does not have (set with gguf-set-metadata)
    loaded, and changed the logits, or failed at the first forward: llama.cpp
    refuses such a file, and so does the loader, naming the tensor and both shapes."""
    path = tmp_path / "m.gguf"
    shutil.copy(DATA / "tiny-qwen35-Q8_0.gguf", path)
    _reference_tool("gguf_set_metadata", path, "qwen35.attention.key_length", "32", "--force")
    with pytest.raises(DFlashError, match=r"gives .*q_proj.weight the shape .* metadata and tensors disagree"):
        load_gguf_target(path)
    # info reads the same header and refuses it too (it printed a report and exited 0)
    r = run_cli("info", path)
    assert r.returncode == 2 and "metadata and tensors disagree" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("keep_precision", [False, True], ids=["as-held", "floats"])
def test_a_head_count_the_per_head_tensors_do_not_have_is_refused(tmp_path, keep_precision):
    """A value-head count (ssm.time_step_rank) the DeltaNet tensors do not
    have: their per-head reorder failed in numpy's reshape (a ValueError,
    a traceback in the CLI) where the tensors are decoded to floats."""
    path = tmp_path / "m.gguf"
    shutil.copy(DATA / "tiny-qwen35-Q8_0.gguf", path)
    _reference_tool("gguf_set_metadata", path, "qwen35.ssm.time_step_rank", "8", "--force")
    with pytest.raises(DFlashError, match=r"tensor blk\.0\.ssm_.* metadata and tensors disagree|cannot decode tensor"):
        load_gguf_target(path, keep_precision=keep_precision)


@pytest.mark.parametrize(
    "key, value", [("attention.layer_norm_rms_epsilon", "-1"), ("rope.freq_base", "0"), ("context_length", "0")]
)
def test_a_metadata_number_out_of_range_names_its_key(tmp_path, key, value):
    """A negative epsilon failed in MLX's RMSNorm (a traceback); a context
    length of 0 loaded and made every prompt too long; a base of 0 gave NaN."""
    path = tmp_path / "m.gguf"
    shutil.copy(DATA / "tiny-qwen35-Q8_0.gguf", path)
    _reference_tool("gguf_set_metadata", path, f"qwen35.{key}", value, "--force")
    with pytest.raises(DFlashError, match=re.escape(f"GGUF metadata qwen35.{key} must be a positive")):
        load_gguf_target(path)


def test_a_big_endian_gguf_is_refused_with_the_way_back(tmp_path):
    """gguf-convert-endian's big-endian file decoded to NaN weights (the block
    scales read in the other byte order); llama.cpp refuses it too."""
    path = tmp_path / "be.gguf"
    shutil.copy(DATA / "tiny-qwen35-Q8_0.gguf", path)
    _reference_tool("gguf_convert_endian", path, "big", stdin="YES\n")
    with pytest.raises(DFlashError, match="big-endian.*gguf-convert-endian be.gguf little"):
        load_gguf_target(path)


@pytest.mark.parametrize("key", ["tokenizer.ggml.merges", "tokenizer.ggml.tokens"])
def test_a_gguf_without_its_merges_or_tokens_is_refused(tmp_path, key):
    """Made with gguf-new-metadata --remove-metadata: without merges every text
    was split byte by byte, without tokens encoded to []; llama.cpp refuses both."""
    path = tmp_path / "m.gguf"
    _reference_tool("gguf_new_metadata", DATA / "tiny-qwen35-Q8_0.gguf", path, "--remove-metadata", key, stdin="YES\n")
    for _ in range(2):  # and the same error again, not an empty temporary folder's
        with pytest.raises(DFlashError, match=f"GGUF {path}: {key} is missing"):
            mlx_dflash.load(path)


def test_f64_tensors_load_as_the_file_holds_them(tok_dir, tmp_path):
    """gguf-py's dequantize does not take F64: the loader failed on a type it lists as float."""
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=13), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    f64 = convert_hf_to_gguf(hf, tmp_path / "f64.gguf", lambda name, arr: Q.F64 if "ffn" in name else Q.F32)
    assert any(t.tensor_type == Q.F64 for t in open_gguf(f64).tensors)
    got, _ = load_gguf_target(f64)
    ref = mlx_lm_model(hf)
    np.testing.assert_allclose(np.array(got(PROMPT)), np.array(ref(mx.array([PROMPT]))[0]), atol=1e-4, rtol=0)
