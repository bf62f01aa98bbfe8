"""Speculative greedy output equals plain greedy output in half precision.

Checkpoints are made the way users make them: tiny Qwen3.5 targets saved in
Hugging Face format and converted by ``mlx_lm.convert`` itself (bf16, 4-bit
and 8-bit). A verified row must be what a single step computes, bit for bit
(fused_exp.row_exact): else a bf16 rounding flips a near-tie within a few dozen
tokens (it did after 7 tokens before verify rows were made exact).
"""

import mlx.core as mx
import pytest
from test_decode import ScriptedDraft, run

from mlx_dflash.kernels import fused_exp
from mlx_dflash.loading import load_target
from tools import tiny

N = 200
PROMPTS = [[1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300, 17, 45, 201, 3, 9]]
KINDS = {  # name: mlx_lm.convert arguments
    "bf16": dict(dtype="bfloat16"),
    "q4": dict(quantize=True, q_bits=4, q_group_size=32, dtype="bfloat16"),
    "q8": dict(quantize=True, q_bits=8, q_group_size=32, dtype="float16"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tok_dir):
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("half")
    hf = {}
    for moe in (False, True):
        cfg = tiny.target_config(moe=moe)
        hf[moe] = tiny.save_hf(tiny.build_target(cfg, seed=5 if moe else 3), cfg, root / f"hf{moe}", tok_dir)

    def get(kind, moe):  # converted on first use, so the default run converts one
        path = root / f"{kind}-{'moe' if moe else 'dense'}"
        if not path.exists():
            convert(str(hf[moe]), str(path), **KINDS[kind])
        return path

    return get


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# MLX's CPU backend runs gather_mm (unquantized MoE experts) in float32 only,
# so a bf16 MoE target cannot run here at all (plain or not); quantized MoE
# experts go through gather_qmm, which does.
CASES = [(kind, moe) for kind in KINDS for moe in (False, True) if (kind, moe) != ("bf16", True)]


# The default run decodes bf16 dense (two prompts); the rest of the matrix is slow.
MARKED = [pytest.param(k, m, marks=() if (k, m) == ("bf16", False) else pytest.mark.slow) for k, m in CASES]


@pytest.mark.parametrize("kind,moe", MARKED, ids=[f"{k}-{'moe' if m else 'dense'}" for k, m in CASES])
def test_chain_and_tree_equal_plain_in_half_precision(converted, kind, moe):
    target = load_target(converted(kind, moe))
    assert fused_exp.row_exact(target.embed_tokens(mx.array([[1]])).dtype)
    vocab = target.vocab_size
    for prompt in PROMPTS:
        plain, _ = run(target, prompt, N)
        # Oracle drafts keep whole blocks; partly-right ones roll back at varied depths.
        for accept, seed in ((None, None), (None, 0)):
            draft = ScriptedDraft(prompt, plain, vocab, block_size=8, accept=accept, seed=seed)
            chain, st = run(target, prompt, N, draft=draft, block_size=8)
            assert chain == plain, (kind, moe, prompt, "chain", first_diff(chain, plain))
            assert st.cycles < N  # blocks were verified, not plain steps
            tree, st = run(target, prompt, N, draft=draft, tree_budget=10, tree_topk=2)
            assert tree == plain, (kind, moe, prompt, "tree", first_diff(tree, plain))
            assert st.cycles < N


def test_verify_rows_equal_single_steps_bf16(converted):
    """Every layer's output row of a verified block equals the same token run
    as a single step, to the bit, and so does the state after a rollback."""
    target = load_target(converted("bf16", False))
    prompt = PROMPTS[1]
    block = run(target, prompt, 8)[0]
    c1, c2 = target.make_cache(), target.make_cache()
    target.prefill(prompt, c1)
    target.prefill(prompt, c2)
    layers = list(range(target.num_layers))
    logits, feats = target.forward(block, c1, capture=layers, record=True)
    for i, t in enumerate(block):
        lg, f = target.forward([t], c2, capture=layers)
        assert mx.array_equal(lg[0], logits[i]).item(), i
        assert mx.array_equal(f[0], feats[i]).item(), i
        if i == 4:
            c1.rollback(5)
            for a, b in zip(c1.state(), c2.state()):
                assert mx.array_equal(a, b).item()
