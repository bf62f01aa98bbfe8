"""Quantized GGUF files made by llama.cpp's own quantizer (tests/data, made by
tests/make_quant_fixtures.py) load in the file's own form: the engine on a
quantized file computes what it computes on an F32 GGUF holding gguf-py's
exact dequantization of that file (gguf-py's decode equals llama.cpp's
``dequantize_row_*``), exactly for the types with an exact MLX form, and
within a small fraction of the file's own quantization error for Q6_K."""

import json
from pathlib import Path

import make_quant_fixtures as fx
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from mlx_dflash.cli import main
from mlx_dflash.decode import generate_tokens
from mlx_dflash.loading.gguf import load_gguf_target

PROMPT = [3, 17, 90, 41, 250, 7, 128, 66, 12, 301, 5, 77, 200, 9, 160, 33]
EXACT = ("Q8_0", "Q4_0")  # every matrix in a type with an exact MLX form
MIXED = ("Q4_K_M", "Q5_K_M", "Q6_K")  # hold Q6_K tensors, which have none


def dequantized_gguf(src: Path, dst: Path) -> Path:
    """``src`` with every tensor replaced by gguf-py's dequantization, as F32
    (same names, same metadata): the reference the engine must match."""
    r = GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    out = {"source": fx.source_gguf(d)}
    for name in fx.FTYPES:
        out[name] = fx.fixture(name)
        out[name + "-deq"] = dequantized_gguf(fx.fixture(name), d / f"{name}-deq.gguf")
    return out


def run(path, dtype=mx.float32):
    target, cfg = load_gguf_target(path, dtype=dtype)
    return target, np.array(target(PROMPT).astype(mx.float32), np.float64)


def greedy(target, n=64):
    out = []
    for t in generate_tokens(target, PROMPT, max_tokens=n):
        out.extend(t)
    return out


def rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


def types_of(path):
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def param_types(path):
    """MLX parameter name -> the GGUF type of the tensor it comes from."""
    from mlx_dflash.loading.gguf import gguf_config, open_gguf, tensor_map

    gtypes = types_of(path)
    return {p: gtypes[g] for g, (p, _) in tensor_map(gguf_config(open_gguf(path))).items()}


def test_fixtures_are_llama_cpp_quantizations_of_the_source(files):
    # The committed files are what the README says: quantizations of the
    # seeded source this test rebuilds, with llama.cpp's type choices.
    src = {t.name: np.asarray(t.data, np.float32) for t in GGUFReader(str(files["source"])).tensors}
    for name in fx.FTYPES:
        r = GGUFReader(str(fx.fixture(name)))
        assert r.get_field("general.file_type").contents() == fx.FTYPES[name][0]
        for t in r.tensors:
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
            assert np.linalg.norm(w - src[t.name]) <= 0.15 * np.linalg.norm(src[t.name]), (name, t.name)
    kinds = {name: set(types_of(fx.fixture(name)).values()) for name in fx.FTYPES}
    assert kinds["Q8_0"] == {"F32", "Q8_0"} and kinds["Q4_0"] == {"F32", "Q4_0"}
    assert {"Q4_K", "Q6_K"} <= kinds["Q4_K_M"] and {"Q5_K", "Q6_K"} <= kinds["Q5_K_M"]
    assert "Q6_K" in kinds["Q6_K"]


@pytest.mark.parametrize("name", EXACT)
def test_exact_types_compute_the_dequantized_model(files, name):
    # Old loader: requantized to 8/4-bit groups of 64, greedy parted early.
    q, lq = run(files[name])
    f, lf = run(files[name + "-deq"])
    assert np.abs(lq - lf).max() <= 1e-4
    assert greedy(q) == greedy(f)


@pytest.mark.parametrize("name", EXACT + MIXED)
def test_every_exact_type_tensor_is_the_files_values(files, name):
    # Weight by weight: each parameter from a Q8_0/Q4_0/Q4_K/Q5_K/Q5_0/Q5_1
    # tensor dequantizes (MLX) to gguf-py's values bit for bit; Q6_K's 8-bit
    # form is within a fifth of Q6_K's own error.
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    q, _ = load_gguf_target(files[name], dtype=mx.float32)
    f, _ = load_gguf_target(files[name + "-deq"], dtype=mx.float32)
    src, _ = load_gguf_target(files["source"], dtype=mx.float32)
    by_param = param_types(files[name])
    qp = dict(tree_flatten(dequantize_model(q.model).parameters()))
    sp = dict(tree_flatten(src.model.parameters()))
    seen = set()
    for k, v in tree_flatten(f.model.parameters()):
        got, want, orig = np.array(qp[k]), np.array(v), np.array(sp[k])
        kind = by_param.get(k, "F32")
        seen.add(kind)
        if kind == "Q6_K":
            assert rms(got - want) <= 0.25 * rms(want - orig), k
        else:
            assert np.array_equal(got, want), (k, kind)
    assert len(seen) > 1


@pytest.mark.parametrize("name", MIXED)
def test_mixed_files_add_a_small_fraction_of_their_own_error(files, name):
    # Own error: the dequantized file vs the unquantized source. Added: the
    # engine on the file vs on its dequantization (only Q6_K tensors add:
    # a fifth of their own error, so a pure Q6_K file adds about that).
    _, ls = run(files["source"])
    _, lf = run(files[name + "-deq"])
    _, lq = run(files[name])
    own, added = rms(lf - ls), rms(lq - lf)
    assert own > 0 and added <= (0.25 if name == "Q6_K" else 0.1) * own, (own, added)


def test_scales_keep_their_exact_type(files):
    # K-quant scales (fp16 d times a 6-bit integer) need float32, so K-quant
    # files load as float32; Q8_0's fp16 d is exact in float16.
    from mlx.utils import tree_flatten

    t, cfg = load_gguf_target(files["Q8_0"])
    assert cfg["torch_dtype"] == "float16"
    assert {v.dtype for k, v in tree_flatten(t.model.parameters()) if k.endswith(".scales")} == {mx.float16}
    t, cfg = load_gguf_target(files["Q4_K_M"])
    assert cfg["torch_dtype"] == "float32"
    # asked for float16, K-quant scales stay float32 (exact), the fp16-scaled types' go float16
    t16, _ = load_gguf_target(files["Q4_K_M"], dtype=mx.float16)
    src = param_types(files["Q4_K_M"])
    scales = {k: v.dtype for k, v in tree_flatten(t16.model.parameters()) if k.endswith(".scales")}
    for k, dt in scales.items():
        kind = src[k[: -len("scales")] + "weight"]
        assert dt == (mx.float32 if kind.endswith("_K") else mx.float16), (k, kind, dt)
    assert mx.float32 in scales.values()


def test_convert_writes_the_files_form_and_mlx_lm_loads_it(files, tmp_path):
    # convert keeps the per-layer forms (4/5/8 bits, group 32) in the config;
    # mlx-lm's own load of the folder computes the same logits as the engine.
    from mlx_lm import load as mlx_lm_load

    out = tmp_path / "mlx"
    with pytest.raises(SystemExit) as e:
        main(["convert", str(files["Q5_K_M"]), str(out)])
    assert e.value.code in (0, None)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert q["group_size"] == 32 and q["mode"] == "affine"
    bits = {q["bits"]} | {v["bits"] for v in q.values() if isinstance(v, dict)}
    assert {5, 8} <= bits
    model, _ = mlx_lm_load(str(out))
    eng, le = run(files["Q5_K_M"])
    got = np.array(model(mx.array([PROMPT]))[0].astype(mx.float32), np.float64)
    assert np.abs(got - le).max() <= 1e-4


# --- every block type, from raw blocks --------------------------------------------

# byte offsets of each type's fp16 fields (set to sane values in random blocks)
FP16_AT = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "Q3_K": [108],
    "Q2_K": [80, 82],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "IQ2_XXS": [0],
    "IQ3_S": [0],
    "MXFP4": [],
    "NVFP4": [],
}
EXACT_FORMS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4")


@pytest.mark.parametrize(
    "name, rows, n",
    [(t, 4, 512) for t in FP16_AT] + [("Q6_K", 18, 1 << 18)],
    ids=list(FP16_AT) + ["Q6_K-decoded-in-slices"],
)
def test_block_types_decode_to_gguf_py_values(name, rows, n):
    # Random blocks of every type llama.cpp writes for these models: the MLX
    # form dequantizes (mx.dequantize) to gguf-py's values, bit for bit where
    # an exact form exists; else within 1/200 of the values' RMS.
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    from mlx_dflash.loading.gguf import _codes, default_bits, group_of, pack

    qt = getattr(Q, name)
    block, size = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(rows * n // block, size), dtype=np.uint8)
    for o in FP16_AT[name]:
        raw[:, o : o + 2] = rng.uniform(1e-3, 2e-2, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    if name == "MXFP4":
        raw[:, 0] = rng.integers(110, 130, size=len(raw))  # e8m0 exponents near 1
    if name == "NVFP4":  # any ue4m3 scale llama.cpp reads (0x7F reads 0, bit 7 is ignored) but 0xFF (480)
        raw[:, :4][raw[:, :4] == 0xFF] = 0x7F
    data = raw.reshape(rows, -1)
    want = np.asarray(dequantize(data, qt), np.float32)
    k, s, z, mode = _codes(SimpleNamespace(data=data, tensor_type=qt, shape=[n, rows]))
    b = default_bits(name)
    got = np.array(
        mx.dequantize(
            mx.array(pack(k, b)),
            mx.array(s),
            None if z is None else mx.array(z),
            group_size=group_of(name),
            bits=b,
            mode=mode,
            dtype=mx.float32,
        )
    )
    if name in EXACT_FORMS:
        assert np.array_equal(got, want)
    else:
        assert rms(got - want) <= 5e-3 * rms(want)


def test_mxfp4_experts_load_as_mlx_mxfp4(tmp_path):
    # llama.cpp's MXFP4 (MoE experts): MLX's own mxfp4 mode holds the same
    # e8m0 scales and e2m1 codes, so the experts are exact.
    import sys

    from gguf import GGMLQuantizationType as Q

    from tools import tiny

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_writer import convert_hf_to_gguf

    cfg = tiny.target_config(moe=True, hidden_size=64, moe_intermediate_size=64)
    hf = tiny.save_hf(tiny.build_target(cfg, seed=4), cfg, tmp_path / "hf")
    # experts fused as ffn_gate_up_exps (split at load), the other matrices Q8_0
    path = convert_hf_to_gguf(
        hf, tmp_path / "m.gguf", lambda n, w: Q.MXFP4 if "_exps" in n else Q.Q8_0, tokenizer=False, fuse_gate_up=True
    )
    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in GGUFReader(str(path)).tensors)
    deq = dequantized_gguf(path, tmp_path / "deq.gguf")
    t, qcfg = load_gguf_target(path, dtype=mx.float32)
    modes = {v.get("mode") for v in qcfg["quantization"].values() if isinstance(v, dict)}
    assert qcfg["quantization"]["mode"] == "mxfp4" or "mxfp4" in modes
    f, _ = load_gguf_target(deq, dtype=mx.float32)
    np.testing.assert_allclose(np.array(t(PROMPT[:8])), np.array(f(PROMPT[:8])), atol=1e-4, rtol=0)


def test_nvfp4_weights_load_as_mlx_nvfp4(tmp_path):
    # NVFP4 (an unsigned e4m3 scale per 16 values, e2m1 codes): MLX's nvfp4
    # mode holds the same scales and codes, so the matrices are exact (they
    # loaded as the nearest 8-bit form). The DeltaNet value heads of 32 keep
    # even the head-reordered ssm_out in its own form.
    import sys

    from gguf import GGMLQuantizationType as Q

    from tools import tiny

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_writer import convert_hf_to_gguf

    cfg = tiny.target_config(hidden_size=64, linear_value_head_dim=32, linear_key_head_dim=32)
    hf = tiny.save_hf(tiny.build_target(cfg, seed=5), cfg, tmp_path / "hf")
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", lambda n, w: Q.NVFP4, tokenizer=False)
    held = {t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert "NVFP4" in held
    t, qcfg = load_gguf_target(path, dtype=mx.float32)
    q = qcfg["quantization"]
    assert (q["mode"], q["group_size"]) == ("nvfp4", 16)
    assert not any(isinstance(v, dict) and v.get("mode") != "nvfp4" for v in q.values())  # no layer fell back
    f, _ = load_gguf_target(dequantized_gguf(path, tmp_path / "deq.gguf"), dtype=mx.float32)
    np.testing.assert_allclose(np.array(t(PROMPT[:8])), np.array(f(PROMPT[:8])), atol=1e-4, rtol=0)


def test_info_says_how_each_type_loads(capsys):
    with pytest.raises(SystemExit):
        main(["info", str(fx.fixture("Q4_K_M"))])
    out = capsys.readouterr().out
    assert "loads as: float32" in out
    assert "Q4_K -> 4-bit/32, exact" in out and "Q5_0 -> 5-bit/32, exact" in out
    assert "Q6_K -> 8-bit/32 float32 scales, nearest (not exact)" in out


def test_head_reorder_that_would_split_groups_stays_float(tmp_path):
    # DeltaNet value heads of 16: the head reorder of ssm_out's input columns
    # would split groups of 32, so that tensor stays float (exact); the rest
    # keep their Q8_0 form.
    import sys

    import mlx.nn as nn
    from gguf import GGMLQuantizationType as Q

    from tools import tiny

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_writer import convert_hf_to_gguf

    cfg = tiny.target_config()  # linear_value_head_dim 16, Hv = 2 Hk
    hf = tiny.save_hf(tiny.build_target(cfg, seed=6), cfg, tmp_path / "hf")
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", lambda n, w: Q.Q8_0, tokenizer=False)
    assert types_of(path)["blk.0.ssm_out.weight"] == "Q8_0"
    t, qcfg = load_gguf_target(path, dtype=mx.float32)
    layer = t.model.language_model.model.layers[0].linear_attn
    assert type(layer.out_proj) is nn.Linear and isinstance(layer.in_proj_qkv, nn.QuantizedLinear)
    f, _ = load_gguf_target(dequantized_gguf(path, tmp_path / "deq.gguf"), dtype=mx.float32)
    np.testing.assert_allclose(np.array(t(PROMPT)), np.array(f(PROMPT)), atol=1e-4, rtol=0)
