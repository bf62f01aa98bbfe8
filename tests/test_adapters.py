"""Fine-tuning adapters (--adapter-path) as mlx-lm's lora trainer writes them,
checked against mlx-lm's own load(..., adapter_path=...)."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support.reference import reference_greedy

import mlx_dflash
from mlx_dflash.errors import DFlashError
from tools import tiny

PROMPT = [1, 5, 9, 33, 71, 100, 4, 8, 200, 301, 17]


def write_adapters(model_dir, out, kind: str, num_layers: int = 2, seed: int = 0, keys=None, config_keys="same"):
    """An adapter folder as `mlx_lm.lora` leaves it after training: mlx-lm's
    own layer conversion, the trainable parameters saved, its config file
    with the trainer's defaults. Training is stood in for by random values
    (a fresh LoRA's B is zero: it would change nothing). ``keys``: the
    lora_parameters.keys trained (default: mlx-lm's, every linear layer);
    ``config_keys``: those the config file says, where another differs."""
    import mlx_lm
    from mlx_lm.lora import CONFIG_DEFAULTS
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config

    model, _ = mlx_lm.load(str(model_dir))
    model.freeze()
    params = {"rank": 4, "dropout": 0.0, "scale": 10.0}
    if keys is not None:
        params["keys"] = keys
    if kind == "full":
        for layer in model.layers[-num_layers:]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    mx.random.seed(seed)
    trained = [(k, v + 0.05 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.trainable_parameters())]
    model.load_weights(trained, strict=False)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = dict(CONFIG_DEFAULTS, model=str(model_dir), fine_tune_type=kind, num_layers=num_layers)
    config["lora_parameters"] = dict(params)
    if config_keys != "same":
        config["lora_parameters"].pop("keys", None)
        if config_keys is not None:
            config["lora_parameters"]["keys"] = config_keys
    save_config(config, out / "adapter_config.json")
    return out


@pytest.fixture(scope="module")
def pair(dense, tok_dir, tmp_path_factory):
    cfg, model = dense
    root = tmp_path_factory.mktemp("adapters")
    path = tiny.save_mlx(model, cfg, root / "m", tokenizer_dir=tok_dir)
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    draft = tiny.save_draft(tiny.build_draft(dcfg, seed=2), dcfg, root / "draft")
    return path, draft, root


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_adapters_give_mlx_lms_logits_and_tokens_in_every_mode(pair, kind):
    import mlx_lm

    path, draft, root = pair
    adapters = write_adapters(path, root / kind, kind)
    ref, _ = mlx_lm.load(str(path), adapter_path=str(adapters))
    want_logits = ref(mx.array([PROMPT]))[0]
    want = reference_greedy(ref, PROMPT, 24)

    engine = mlx_dflash.load(path, draft, adapter_path=adapters)
    assert engine.adapter_path == adapters
    np.testing.assert_allclose(np.array(engine.target(PROMPT)), np.array(want_logits), atol=1e-4, rtol=0)
    base = mlx_dflash.load(path).target(PROMPT)
    assert mx.abs(base - want_logits).max().item() > 1e-2  # the adapters changed the model
    for mode in ({"baseline": True}, {"block_size": 8}, {}, {"tree_budget": 6}):
        got = mlx_dflash.generate(engine, PROMPT, max_tokens=24, **mode)
        assert got.tokens == want, mode


def test_adapters_on_a_gguf_target_follow_its_folder(pair, dense, tok_dir, tmp_path):
    from gguf_writer import convert_hf_to_gguf

    path, _, root = pair
    cfg, model = dense
    hf = tiny.save_hf(model, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    gguf = convert_hf_to_gguf(hf, tmp_path / "m.gguf")
    adapters = write_adapters(path, tmp_path / "lora", "lora", seed=4)
    from_gguf = mlx_dflash.load(gguf, adapter_path=adapters)
    from_folder = mlx_dflash.load(path, adapter_path=adapters)
    np.testing.assert_allclose(
        np.array(from_gguf.target(PROMPT)), np.array(from_folder.target(PROMPT)), atol=1e-4, rtol=0
    )


def test_cli_generate_takes_adapter_path(pair, capsys):
    from test_cli import cli

    path, draft, root = pair
    adapters = write_adapters(path, root / "cli", "lora", seed=5)
    engine = mlx_dflash.load(path, draft, adapter_path=adapters)
    want = mlx_dflash.generate(engine, "hello", max_tokens=12, chat_template=False).text
    code, out, err = cli(
        capsys, "generate", "-m", str(path), "-d", str(draft), "--adapter-path", str(adapters),
        "--no-chat-template", "-n", "12", "hello",
    )  # fmt: skip
    assert code == 0, err
    assert out.rstrip("\n") == want


def test_bad_adapter_folders_are_one_clear_error(pair, tmp_path, capsys):
    from test_cli import cli

    path, _, root = pair
    with pytest.raises(DFlashError, match="adapter path does not exist"):
        mlx_dflash.load(path, adapter_path=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="has no adapter_config.json or adapters.safetensors"):
        mlx_dflash.load(path, adapter_path=tmp_path / "empty")
    good = write_adapters(path, tmp_path / "good", "lora")
    cfg = json.loads((good / "adapter_config.json").read_text())
    for edit, words in (
        (dict(fine_tune_type="qlora"), "fine_tune_type 'qlora' is not one of lora, dora, full"),
        (dict(lora_parameters={"rank": 4}), "lora_parameters lacks scale"),
    ):
        (good / "adapter_config.json").write_text(json.dumps(dict(cfg, **edit)))
        with pytest.raises(DFlashError, match=words):
            mlx_dflash.load(path, adapter_path=good)
    (good / "adapter_config.json").write_text(json.dumps(cfg))
    # Adapters trained for another model: their shapes do not fit this one.
    other_cfg = tiny.target_config(hidden_size=32)
    other = tiny.save_mlx(tiny.build_target(other_cfg, seed=1), other_cfg, tmp_path / "other")
    foreign = write_adapters(other, tmp_path / "foreign", "lora")
    with pytest.raises(DFlashError, match="do not fit this model"):
        mlx_dflash.load(path, adapter_path=foreign)
    code, out, err = cli(capsys, "generate", "-m", str(path), "--adapter-path", str(foreign), "-n", "4", "hi")
    assert code == 2 and err.startswith("error: adapters") and "Traceback" not in err
    # A damaged weights file is named as that, not as adapters for another model.
    data = (good / "adapters.safetensors").read_bytes()
    (good / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashError, match="cannot read .*adapters.safetensors"):
        mlx_dflash.load(path, adapter_path=good)


def test_chat_and_serve_take_adapter_path(tmp_path, capsys):
    # Both load through the same call as generate; a missing folder is named before any load.
    from test_cli import cli
    from test_server_batch import _serve_load_error

    code, _, err = cli(capsys, "chat", "--adapter-path", str(tmp_path / "nope"))
    assert code == 2 and err.strip() == f"error: adapter path does not exist: {tmp_path / 'nope'}"
    last = _serve_load_error("--adapter-path", str(tmp_path / "nope"))
    assert last == f"error: adapter path does not exist: {tmp_path / 'nope'}"


def test_dora_on_the_experts_of_an_moe_target_is_refused_before_the_load(moe, tok_dir, tmp_path, capsys, monkeypatch):
    """mlx-lm has no DoRA form of expert (SwitchLinear) layers: the adapters
    were refused after the target's weights were read, as adapters "that do not
    fit this model" ("ValueError: SwitchLinear doesn't support DoRA yet.")."""
    import mlx_lm
    from test_cli import cli

    import mlx_dflash.api
    from mlx_dflash.loading import load_target

    cfg, model = moe
    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    # DoRA on the attention and the router (plain linear layers) works, as mlx-lm's does.
    keys = ["self_attn.q_proj", "self_attn.v_proj", "linear_attn.in_proj_qkv", "mlp.gate"]
    fine = write_adapters(path, tmp_path / "fine", "dora", keys=keys)
    ref, _ = mlx_lm.load(str(path), adapter_path=str(fine))
    got = mlx_dflash.load(path, adapter_path=fine).target(PROMPT)
    np.testing.assert_allclose(np.array(got), np.array(ref(mx.array([PROMPT]))[0]), atol=1e-4, rtol=0)
    # Its config saying no keys (mlx-lm's default: every layer, experts too), or naming an expert layer.
    for name, config_keys in (("default", None), ("experts", keys + ["mlp.switch_mlp.gate_proj"])):
        adapters = write_adapters(path, tmp_path / name, "dora", keys=keys, config_keys=config_keys)
        words = (
            f"{adapters / 'adapter_config.json'}: a DoRA adapter (fine_tune_type 'dora') cannot apply to this "
            "MoE target: it would adapt the target's mixture-of-experts layers (layers.2.mlp.switch_mlp."
        )
        with pytest.raises(DFlashError, match=re.escape(words)):
            load_target(path, adapter_path=adapters)  # after the load too (a pipeline stage loads first)

        def loaded(*a, **k):
            raise AssertionError("the target was loaded before the adapters were checked")

        with monkeypatch.context() as mp:
            mp.setattr(mlx_dflash.api, "load_target", loaded)
            with pytest.raises(DFlashError, match=re.escape(words)):
                mlx_dflash.load(path, adapter_path=adapters)
        code, _, err = cli(capsys, "generate", "-m", str(path), "--adapter-path", str(adapters), "-n", "2", "hi")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
