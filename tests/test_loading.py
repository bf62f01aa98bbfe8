"""HF- and MLX-format folders (incl. 4-bit) through the public loader; bad input."""

import copy
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dflash
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import load_draft, load_target
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPT = [1, 5, 9, 33, 71, 100, 4, 8, 200, 301, 17]


def logits_of(target):
    return target(PROMPT)


@pytest.mark.parametrize("fmt", ["hf", "mlx"])
def test_folder_gives_same_logits_as_in_memory(any_model, tok_dir, tmp_path, fmt):
    cfg, model = any_model
    save = tiny.save_hf if fmt == "hf" else tiny.save_mlx
    path = save(model, cfg, tmp_path / fmt, tokenizer_dir=tok_dir)
    want = logits_of(Target(model))
    got = logits_of(load_target(path))
    assert mx.abs(got - want).max().item() <= 1e-5


def test_hf_folder_holds_raw_conventions(dense, tmp_path):
    cfg, model = dense
    path = tiny.save_hf(model, cfg, tmp_path / "hf")
    w = mx.load(str(path / "model.safetensors"))
    assert "model.language_model.layers.0.linear_attn.conv1d.weight" in w
    assert w["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1
    # zero-centred: stored weight = scale - 1
    stored = w["model.language_model.norm.weight"]
    assert mx.allclose(stored + 1.0, model.language_model.model.norm.weight).item()


def test_quantized_4bit_folder(any_model, tok_dir, tmp_path):
    from mlx_lm.utils import quantize_model

    cfg, model = any_model
    path = tiny.save_mlx(model, cfg, tmp_path / "q4", tokenizer_dir=tok_dir, quantize={"bits": 4, "group_size": 32})
    saved = json.loads((path / "config.json").read_text())
    assert saved["quantization"]["bits"] == 4
    if cfg["text_config"].get("num_experts"):
        # mlx-lm keeps the MoE router at 8 bits: a per-layer override.
        assert any(isinstance(v, dict) and v.get("bits") == 8 for v in saved["quantization"].values())
    qmodel, _ = quantize_model(copy.deepcopy(model), copy.deepcopy(cfg), group_size=32, bits=4)
    want = logits_of(Target(qmodel))
    got = logits_of(load_target(path))
    assert mx.abs(got - want).max().item() <= 1e-4
    # Quantization really happened, and it is close to the fp32 model.
    fp = logits_of(Target(model))
    assert mx.abs(got - fp).max().item() > 0


def test_tokenizer_and_chat_template_from_folder(dense, tok_dir, tmp_path):
    cfg, model = dense
    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    eng = mlx_dflash.load(path)
    ids = eng.encode("hello world", chat_template=True, system="be brief")
    text = eng.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert eng.encode("hello world") == eng.tokenizer.encode("hello world", add_special_tokens=False)


# --- bad input -----------------------------------------------------------------


def test_a_draft_or_nothing_given_as_the_target_is_named(tmp_path):
    """A draft given where the target goes said only "unsupported model_type
    'qwen3'" (or GGUF architecture 'dflash'); an empty path loaded the current folder."""
    from mlx_dflash.api import DEFAULT_DRAFT

    with pytest.raises(DFlashError, match="is a DFlash draft, not a target model: give it as the draft"):
        mlx_dflash.load(DEFAULT_DRAFT)
    with pytest.raises(DFlashError, match="a model or draft path is empty"):
        mlx_dflash.load("")


def test_missing_and_non_model_paths(tmp_path):
    with pytest.raises(DFlashError, match="does not exist"):
        load_target(tmp_path / "nope")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(DFlashError, match="a file, not a model folder"):
        load_target(f)
    g = tmp_path / "model.gguf"  # named .gguf, but not one: the message says what is wrong with it
    g.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(DFlashError, match="not a GGUF file .*'GGUF'"):
        load_target(g)
    with pytest.raises(DFlashError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="cannot read"):
        load_target(tmp_path)


def test_unsupported_model_type_and_missing_weights(dense, tmp_path):
    cfg, model = dense
    path = tiny.save_mlx(model, cfg, tmp_path / "m")
    c = json.loads((path / "config.json").read_text())
    c["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match="unsupported model_type 'llama'"):
        load_target(path)
    c["model_type"] = "qwen3_5"
    (path / "config.json").write_text(json.dumps(c))
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(DFlashError, match="no .safetensors"):
        load_target(path)


def test_weights_not_matching_config(dense, tmp_path):
    cfg, model = dense
    path = tiny.save_mlx(model, cfg, tmp_path / "m")
    c = json.loads((path / "config.json").read_text())
    c["text_config"]["num_hidden_layers"] = 6
    (path / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match="cannot load model"):
        load_target(path)


@pytest.fixture(scope="module")
def draft_dir(dense, tmp_path_factory):
    cfg, _ = dense
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    return tiny.save_draft(tiny.build_draft(dcfg, seed=2), dcfg, tmp_path_factory.mktemp("d") / "draft"), dcfg


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(hidden_size=32), "hidden_size 32 != target hidden_size 64"),
        (lambda c: c.update(vocab_size=1000), "vocab_size 1000 != target vocab_size 512"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), r"target_layer_ids \[9\] out of range"),
        (lambda c: c["dflash_config"].update(mask_token_id=9999), "mask_token_id 9999 outside"),
        (lambda c: c.update(num_target_layers=12), "num_target_layers 12 != target's 4"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 2]), "fc.weight takes"),
        (lambda c: c.update(block_size=1), "block_size 1 < 2"),
    ],
)
def test_draft_mismatch_is_named(dense, draft_dir, tmp_path, edit, message):
    target = Target(dense[1])
    src, dcfg = draft_dir
    dst = tmp_path / "draft"
    shutil.copytree(src, dst)
    c = copy.deepcopy(dcfg)
    edit(c)
    (dst / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match=message):
        load_draft(dst, target)


def test_draft_with_wrong_weights_or_bits(dense, draft_dir, tmp_path):
    target = Target(dense[1])
    src, _ = draft_dir
    with pytest.raises(DFlashError, match="4 or 8 bits"):
        load_draft(src, target, quantize_bits=3)
    dst = tmp_path / "d2"
    shutil.copytree(src, dst)
    w = mx.load(str(dst / "model.safetensors"))
    w.pop("norm.weight")
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    with pytest.raises(DFlashError, match="missing"):
        load_draft(dst, target)


def test_a_draft_that_cannot_be_read_fails_before_the_target_loads(tmp_path, monkeypatch):
    import mlx_dflash.api
    from mlx_dflash.api import DEFAULT_MODEL

    def decoded(*a, **k):
        raise AssertionError("the target was loaded before the draft's files were checked")

    monkeypatch.setattr(mlx_dflash.api, "load_target", decoded)
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(16))
    for draft, words in ((tmp_path / "empty", "draft folder has no config.json"), (bad, "truncated or corrupt")):
        with pytest.raises(DFlashError, match=words):
            mlx_dflash.api.load(DEFAULT_MODEL, draft=draft)
    # Its weights, from their headers: gone, cut short, or not the ones its config names.
    from mlx_dflash.api import DEFAULT_DRAFT

    draft = tmp_path / "draft"
    shutil.copytree(DEFAULT_DRAFT, draft)
    weights = draft / "model.safetensors"
    whole = weights.read_bytes()
    weights.unlink()
    with pytest.raises(DFlashError, match="draft folder has no .safetensors weights"):
        mlx_dflash.api.load(DEFAULT_MODEL, draft=draft)
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DFlashError, match=r"model.safetensors: its header places data up to byte \d+ of a"):
        mlx_dflash.api.load(DEFAULT_MODEL, draft=draft)
    w = mx.load(str(DEFAULT_DRAFT / "model.safetensors"))
    w.pop("norm.weight")
    mx.save_safetensors(str(weights), w)
    with pytest.raises(DFlashError, match=r"weight names do not match .*missing \['norm.weight'\]"):
        mlx_dflash.api.load(DEFAULT_MODEL, draft=draft)


@pytest.mark.parametrize("target", ["gguf", "folder"])
def test_a_draft_for_another_model_fails_before_the_target_loads(target, tmp_path, monkeypatch):
    """The fit is decided from the configs: a GGUF target was decoded whole
    (a progress bar, minutes on a large file) before the draft was refused."""
    import mlx_dflash.api
    from mlx_dflash.api import DEFAULT_DRAFT

    def decoded(*a, **k):
        raise AssertionError("the target was loaded before the draft's fit was checked")

    monkeypatch.setattr(mlx_dflash.api, "load_target", decoded)
    cfg = tiny.target_config(hidden_size=48)
    model = (
        Path(__file__).parent / "data" / "tiny-qwen35-Q8_0.gguf"
        if target == "gguf"
        else tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t")
    )
    with pytest.raises(DFlashError, match=r"draft .*(vocab_size|hidden_size) \d+ != target"):
        mlx_dflash.api.load(model, draft=DEFAULT_DRAFT)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda c: c.update(num_hidden_layers="eight"), "num_hidden_layers must be a positive integer, got 'eight'"),
        (lambda c: c.update(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
        (lambda c: c["dflash_config"].update(target_layer_ids=1), "target_layer_ids must be a list"),
        (lambda c: c["dflash_config"].update(mask_token_id="3"), "mask_token_id must be a non-negative integer"),
        (lambda c: c.update(dflash_config="x"), "dflash_config must be an object"),
        # these loaded, and failed with a TypeError traceback in the first drafted cycle
        (lambda c: c.update(rope_theta="x"), "rope_theta must be a positive number, got 'x'"),
        (lambda c: c.update(rms_norm_eps=0), "rms_norm_eps must be a positive number, got 0"),
        (lambda c: c.update(sliding_window="7"), "sliding_window must be a positive integer or null, got '7'"),
        (
            lambda c: c["dflash_config"].update(final_logit_softcapping="x"),
            "final_logit_softcapping must be a positive number or null",
        ),
        (lambda c: c.update(layer_types=["bogus"]), "layer_types must list 'full_attention' or 'sliding_attention'"),
    ],
)
def test_a_draft_config_field_of_the_wrong_kind_is_named(tmp_path, capsys, edit, words):
    """A bare TypeError from deep inside (load, info), or "hidden_size 64 != target
    hidden_size 64" for a string; and info said "does NOT fit" (exit 1), not bad input (2)."""
    from test_cli import cli

    from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL

    d = tmp_path / "draft"
    shutil.copytree(DEFAULT_DRAFT, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=re.escape(words)):
        mlx_dflash.load(DEFAULT_MODEL, draft=d)
    for args in (["info", str(d)], ["info", str(DEFAULT_MODEL), "--draft", str(d)]):
        code, out, err = cli(capsys, *args)
        assert code == 2 and words in err and "Traceback" not in err, (args, err)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '{"model_type": ["qwen3_5"]}'])
def test_a_config_that_is_not_an_object_of_fields_is_named(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(DFlashError, match="config.json( holds a JSON|: model_type must be a string)"):
        mlx_dflash.load(tmp_path)


def test_info_says_the_bits_a_mixed_recipe_holds(tok_dir, tmp_path):
    """mlx_lm.convert's mixed_3_6 overrides the config's default 4 bits on
    every layer: info said "4-bit ... (N per-layer overrides)", where no layer is 4-bit."""
    import contextlib
    import io

    from mlx_lm import convert

    from mlx_dflash.info import describe

    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=3), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(hf), str(tmp_path / "q"), quantize=True, quant_predicate="mixed_3_6", q_group_size=32)
    (line,) = [l for l in describe(tmp_path / "q")[0].splitlines() if l.startswith("quantization:")]
    assert "3-bit affine, group 32" in line and "6-bit affine, group 32" in line and "4-bit" not in line, line


@pytest.mark.parametrize("field,value", [("num_hidden_layers", "eight"), ("hidden_size", 64.0), ("head_dim", 0)])
def test_a_target_config_field_of_the_wrong_kind_is_named(tmp_path, field, value):
    """mlx-lm's own error named neither file nor field ("'str' object cannot be
    interpreted as an integer")."""
    cfg = tiny.target_config()
    folder = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t")
    c = json.loads((folder / "config.json").read_text())
    c["text_config"][field] = value
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match=re.escape(f"config.json: {field} must be a positive integer, got {value!r}")):
        load_target(folder)


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"])
def test_a_target_config_field_that_is_missing_is_named(tmp_path, field):
    """mlx-lm took its default for it: a 351-line "Missing 350 parameters"
    list, or a weight shape "(512, 4096)" that never said which field."""
    cfg = tiny.target_config()
    folder = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t")
    c = json.loads((folder / "config.json").read_text())
    del c["text_config"][field]
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match=re.escape(f"config.json: {field} is missing from text_config")):
        load_target(folder)
    c["text_config"][field] = cfg["text_config"][field]
    c["text_config"]["rms_norm_eps"] = "1e-6"
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashError, match=re.escape("config.json: rms_norm_eps must be a positive number, got '1e-6'")):
        load_target(folder)


# --- a sharded folder with a shard missing (an interrupted download) -----------------------


def save_sharded(weights: dict, config: dict, path, parts: int = 3, *, metadata=None) -> Path:
    """A sharded folder as transformers' save_pretrained writes one: weights in
    ``model-0000i-of-0000n.safetensors`` and a ``model.safetensors.index.json``
    holding ``metadata.total_size`` and a sorted ``weight_map`` (name -> shard)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    step = -(-len(names) // parts)
    weight_map = {}
    for i in range(parts):
        shard = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: weights[n] for n in names[i * step : (i + 1) * step]}
        mx.save_safetensors(str(path / shard), chunk, metadata=metadata or {"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard))
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_a_sharded_folder_missing_a_shard_names_it(dense, draft_dir, tmp_path, capsys):
    """mlx-lm reads the shards that are there: a folder whose download stopped
    half-way failed as "Missing 27 parameters: ...", naming neither file nor cause."""
    from test_cli import cli

    cfg, model = dense
    folder = save_sharded(tiny.hf_weights(model), cfg, tmp_path / "t")
    want = logits_of(Target(model))
    assert mx.abs(load_target(folder)(PROMPT) - want).max().item() <= 1e-5  # whole, it loads
    (folder / "model-00002-of-00003.safetensors").unlink()
    words = (
        f"model folder {folder} is incomplete: model.safetensors.index.json names 1 weight file(s) that are not "
        "there: model-00002-of-00003.safetensors (an interrupted download?"
    )
    with pytest.raises(DFlashError, match=re.escape(words)):
        load_target(folder)
    for args in (["info", str(folder)], ["info", str(folder), "--stages", "2"]):
        code, _, err = cli(capsys, *args)
        assert code == 2 and words in err and "Traceback" not in err, (args, err)
    (folder / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(DFlashError, match=re.escape("names 2 weight file(s) that are not there: model-00002-of-00003")):
        load_target(folder)
    # A draft folder, sharded the same way
    src, dcfg = draft_dir
    draft = save_sharded(mx.load(str(src / "model.safetensors")), dcfg, tmp_path / "d", parts=2, metadata={})
    assert load_draft(draft, Target(model)).block_size == 8
    (draft / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(DFlashError, match=re.escape(f"draft folder {draft} is incomplete")):
        load_draft(draft, Target(model))


# --- eos_token_id -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["top", "text_config"])
@pytest.mark.parametrize("value", ["<|im_end|>", -1, 3.0, True, [2, "<|im_end|>"], [2, -3]])
def test_a_bad_eos_token_id_names_the_config_field(tok_dir, tmp_path, capsys, where, value):
    """A string was taken by mlx-lm's tokenizer as the set of its characters, a
    negative id kept silently, a float failed as a tokenizer error ("'float'
    object is not iterable"). (An id past the vocabulary is let be: it is never
    sampled; a config whose vocabulary was cut down keeps its published ids.)"""
    from test_cli import cli

    cfg = tiny.target_config()  # vocab_size 512
    folder = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t", tokenizer_dir=tok_dir)
    c = json.loads((folder / "config.json").read_text())
    (c if where == "top" else c["text_config"])["eos_token_id"] = value
    (folder / "config.json").write_text(json.dumps(c))
    field = "eos_token_id" if where == "top" else "text_config.eos_token_id"
    words = f"{folder / 'config.json'}: {field} must be a token id (an integer >= 0) or a list of them, got {value!r}"
    with pytest.raises(DFlashError, match=re.escape(words)):
        mlx_dflash.load(folder)
    code, _, err = cli(capsys, "generate", "-m", str(folder), "-n", "2", "hi")
    assert code == 2 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["abc", 2.5, [2, -3]])
def test_a_bad_eos_token_id_in_generation_config_is_named_too(tok_dir, tmp_path, value):
    """mlx-lm's load_config takes generation_config.json's eos_token_id over
    config.json's (transformers' save_pretrained writes one): "abc" became the
    stop ids {'a', 'b', 'c'}, 2.5 failed as a tokenizer error."""
    cfg = tiny.target_config()
    folder = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t", tokenizer_dir=tok_dir)
    gen = folder / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": value, "do_sample": True}))
    words = f"{gen}: eos_token_id must be a token id (an integer >= 0) or a list of them, got {value!r}"
    with pytest.raises(DFlashError, match=re.escape(words)):
        mlx_dflash.load(folder)
    gen.write_text(json.dumps({"eos_token_id": [7, 11]}))
    assert {7, 11} <= set(mlx_dflash.load(folder).tokenizer.eos_token_ids)


def test_a_list_of_eos_token_ids_is_kept(tok_dir, tmp_path):
    cfg = tiny.target_config()
    folder = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "t", tokenizer_dir=tok_dir)
    c = json.loads((folder / "config.json").read_text())
    c["eos_token_id"] = [7, 11, 4096]  # 4096: past the vocabulary of 512, never sampled
    (folder / "config.json").write_text(json.dumps(c))
    assert {7, 11} <= set(mlx_dflash.load(folder).tokenizer.eos_token_ids)


def test_a_half_precision_load_keeps_a_log_as_mlx_lm_convert_does(tok_dir, tmp_path):
    """--dtype bfloat16 cast Qwen3.5's A_log too, where mlx_lm.convert's
    cast_predicate keeps it float32 (and the GGUF loader kept it): the same
    folder loaded two ways then gave other logits."""
    import contextlib
    import io

    from mlx.utils import tree_flatten
    from mlx_lm import convert

    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=4), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(hf), str(tmp_path / "bf16"), dtype="bfloat16")
    ours = dict(tree_flatten(load_target(hf, dtype=mx.bfloat16).model.parameters()))
    theirs = dict(tree_flatten(load_target(tmp_path / "bf16").model.parameters()))
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
    assert any(k.endswith("A_log") and v.dtype == mx.float32 for k, v in ours.items())
    ids = mx.array([[3, 17, 42, 5, 99, 7]])
    a, b = load_target(hf, dtype=mx.bfloat16), load_target(tmp_path / "bf16")
    assert mx.array_equal(a.model(ids), b.model(ids)).item()
