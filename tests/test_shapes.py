"""tools/shapes.py: the published Qwen3.5 shapes as mlx-lm reads them, the
oracle draft, and long_context.py's hand-over of the engine's state to mlx-lm."""

import copy

import mlx.core as mx
import pytest

from tools import shapes


@pytest.mark.parametrize("size,hidden,inter", [("0.8b", 1024, 3584), ("2b", 2048, 6144)])
def test_published_config_reads_as_published(size, hidden, inter):
    """mlx-lm's own config parsing yields the published shape, not its Qwen3-Next defaults."""
    from mlx_lm.utils import _get_classes

    cfg = shapes.target_config(size)
    _, args_cls = _get_classes(cfg)
    t = args_cls.from_dict(copy.deepcopy(cfg)).text_config
    if isinstance(t, dict):
        from mlx_lm.models.qwen3_5 import TextModelArgs

        t = TextModelArgs.from_dict(t)
    assert (t.hidden_size, t.intermediate_size, t.vocab_size) == (hidden, inter, 248320)
    assert (t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (24, 8, 2, 256)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim) == (
        16,
        16,
        128,
        128,
    )
    assert t.rope_theta == 10000000 and t.partial_rotary_factor == 0.25 and t.tie_word_embeddings
    assert t.full_attention_interval == 4


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The 0.8B layout scaled down 8x, written and loaded as the benches do."""
    paths = shapes.write_models(tmp_path_factory.mktemp("shapes"), "0.8b", scale=8, bits=())
    return shapes.load(paths["fp32"], paths["draft"])


def test_oracle_draft_accepts_every_token(small):
    from mlx_dflash.decode import GenerationStats, generate_tokens

    target, draft = small
    prompt = shapes.prompt_ids(40, target.vocab_size)
    ref, _, _ = shapes.mlx_lm_generate(target.model, prompt, 33)
    st = GenerationStats()
    out = []
    oracle = shapes.OracleDraft(prompt + ref, draft)
    for toks in generate_tokens(target, prompt, draft=oracle, max_tokens=33, block_size=8, stats=st):
        out.extend(toks)
    assert out == ref
    assert st.cycle_commits == [8, 8, 8, 8]  # 1 token from prefill + 4 cycles of 8
    assert oracle.last_cache.length > len(prompt)  # the real draft read the context each cycle


def test_oracle_draft_refuses_another_sequence(small):
    from mlx_dflash.decode import generate_tokens

    target, draft = small
    prompt = shapes.prompt_ids(40, target.vocab_size)
    ref, _, _ = shapes.mlx_lm_generate(target.model, prompt, 4)
    wrong = prompt + [(ref[0] + 1) % target.vocab_size] + ref[1:]
    with pytest.raises(ValueError, match="out of step"):
        for _ in generate_tokens(target, prompt, draft=shapes.OracleDraft(wrong, draft), max_tokens=4, block_size=4):
            pass


def test_a_lenient_oracle_records_the_parting_and_the_output_stays_plain(small):
    """Benchmarks run the oracle leniently: a parting is recorded (the first
    anchor position where the target committed another token than the
    sequence holds), proposals stop, and decoding goes on to the end with the
    target's own tokens."""
    from mlx_dflash.decode import generate_tokens

    target, draft = small
    prompt = shapes.prompt_ids(40, target.vocab_size)
    ref, _, _ = shapes.mlx_lm_generate(target.model, prompt, 12)
    wrong = prompt + ref[:5] + [(ref[5] + 1) % target.vocab_size] + ref[6:]
    oracle = shapes.OracleDraft(wrong, draft, strict=False)
    out = []
    for toks in generate_tokens(target, prompt, draft=oracle, max_tokens=12, block_size=4):
        out.extend(toks)
    assert out == ref
    assert oracle.parted_at == len(prompt) + 5  # where the target committed its own token, not the wrong one
    assert shapes.matching_prefix(out, wrong[len(prompt) :]) == 5


def test_mlx_lm_continues_from_the_engines_state(small):
    """long_context.py hands the engine's prefilled state to mlx-lm: mlx-lm
    then decodes what it decodes after its own prefill, and the engine's
    decode loop from the same state gives the same tokens."""
    import bench.long_context as lc

    target, draft = small
    prompt = shapes.prompt_ids(300, target.vocab_size)
    ref, _, _ = shapes.mlx_lm_generate(target.model, prompt, 20)
    cache = target.make_cache()
    logits, feats = target.prefill(prompt, cache, capture=draft.target_layer_ids)
    anchor = int(mx.argmax(logits[-1]).item())
    assert anchor == ref[0]
    snap = cache.snapshot()
    toks, _, _ = shapes.mlx_lm_generate(target.model, [anchor], 19, prompt_cache=lc.mlx_cache_from(target.model, cache))
    assert toks == ref[1:]
    cache.restore(snap)
    dc = draft.make_cache()
    draft.add_context(feats, dc)
    out, _, st = lc.engine_decode(target, prompt, cache, dc, shapes.OracleDraft(prompt + ref, draft), anchor, 19)
    assert out == ref[1:] and st.tau > 8
    # --kv-bits: the same rows quantized, the oracle following the engine's own plain decoding of them.
    cache.restore(snap)
    q = lc.quantized_cache(cache, 8)
    qsnap = q.snapshot()
    plain, _, _ = lc.engine_decode(target, prompt, q, None, None, anchor, 19)
    q.restore(qsnap)
    qdc = draft.make_cache()
    draft.add_context(feats, qdc)
    oracle = shapes.OracleDraft(prompt + [anchor] + plain, draft)
    out, _, st = lc.engine_decode(target, prompt, q, qdc, oracle, anchor, 19)
    assert out == plain and st.tau > 8
    cache.restore(snap)
    toks, _, _ = shapes.mlx_lm_generate(
        target.model, [anchor], 19, prompt_cache=lc.mlx_cache_from(target.model, cache, 8)
    )
    assert len(toks) == 19


def test_moe_config_is_transformers_35b_a3b_default():
    """tools/shapes.moe_config is what mlx-lm parses into the values that
    transformers' Qwen3_5MoeTextConfig defaults to (its docstring names
    Qwen/Qwen3.5-35B-A3B), not Qwen3-Next's defaults."""
    from mlx_lm.utils import _get_classes
    from transformers import Qwen3_5MoeTextConfig

    ref = Qwen3_5MoeTextConfig()
    cfg = shapes.moe_config()
    model_cls, args_cls = _get_classes(cfg)
    t = args_cls.from_dict(copy.deepcopy(cfg)).text_config
    if isinstance(t, dict):  # the MoE model reads its text config with the dense one's class
        from mlx_lm.models.qwen3_5 import TextModelArgs

        t = TextModelArgs.from_dict(t)
    for f in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "vocab_size",
    ):
        assert getattr(t, f) == getattr(ref, f), f
    assert cfg["text_config"]["layer_types"] == list(ref.layer_types) and t.full_attention_interval == 4
    assert not t.tie_word_embeddings and t.tie_word_embeddings == ref.tie_word_embeddings


def test_shared_experts_route_per_layer():
    """build_shared_experts: one set of routed experts for every layer, but
    each layer's own router (so rows pick other experts layer by layer)."""
    cfg = shapes.moe_config(2)
    t = cfg["text_config"]
    t.update(hidden_size=64, num_experts=16, moe_intermediate_size=8, shared_expert_intermediate_size=8, vocab_size=64)
    t.update(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=2)
    t.update(linear_num_key_heads=2, linear_num_value_heads=4)
    model = shapes.build_shared_experts(cfg)
    a, b = (layer.mlp for layer in model.language_model.model.layers)
    assert a.switch_mlp is b.switch_mlp and a.gate is not b.gate
    assert not mx.array_equal(a.gate.weight, b.gate.weight).item()
