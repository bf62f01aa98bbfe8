"""Speculative greedy output equals mlx-lm's greedy generation, token for token."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from support.reference import assert_cache_is_plain_forward, reference_greedy

from mlx_dflash.decode import GenerationStats, Hooks, _generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPTS = [[1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300], [2, 450]]
N = 24


class ScriptedDraft:
    """Test draft that proposes from a known continuation of the target.

    ``accept``: how many of its proposals per cycle are right (None = all:
    an oracle); proposals after that are deliberately wrong.
    """

    def __init__(self, prompt, reference, vocab, block_size=16, accept=None, seed=None):
        self.rng = np.random.default_rng(seed) if seed is not None else None
        self.seq = list(prompt) + list(reference)
        self.vocab = vocab
        self.block_size = block_size
        self.accept = accept
        self.target_layer_ids = []
        self.calls = []

    def make_cache(self, window=None):
        return None

    def __call__(self, features, anchor, anchor_pos, B, cache):
        assert self.seq[anchor_pos] == anchor
        self.calls.append(B)
        logits = np.zeros((B - 1, self.vocab), np.float32)
        accept = self.accept if self.rng is None else int(self.rng.integers(0, B))
        for j in range(1, B):
            p = anchor_pos + j
            tok = self.seq[p] if p < len(self.seq) else 0
            if accept is not None and j > accept:
                tok = (tok + 1) % self.vocab
            logits[j - 1, tok] = 1.0
        return mx.array(logits)


def run(target, prompt, n, **kw):
    stats = GenerationStats()
    out = []
    for toks in _generate_tokens(target, prompt, max_tokens=n, stats=stats, hooks=Hooks.take(kw), **kw):
        out.extend(toks)
    return out, stats


@pytest.fixture(scope="module")
def random_drafts(dense, moe):
    out = {}
    for name, (cfg, _) in (("dense", dense), ("moe", moe)):
        dcfg = tiny.draft_config(
            cfg,
            num_hidden_layers=2,
            block_size=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        )
        out[name] = tiny.build_draft(dcfg, seed=11)
    return out


@pytest.mark.parametrize("kind", ["random", "partial", "oracle", "wrong"])
@pytest.mark.parametrize("B", [2, 4, 16])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_speculative_equals_mlx_lm_greedy(dense, moe, random_drafts, which, B, kind):
    cfg, model = dense if which == "dense" else moe
    target = Target(model)
    for prompt in PROMPTS:
        ref = reference_greedy(model, prompt, N)
        base, _ = run(target, prompt, N)
        assert base == ref
        if kind == "random":
            draft = random_drafts[which].bind(target)
        elif kind == "partial":  # a random number of right proposals per cycle
            draft = ScriptedDraft(prompt, ref, target.vocab_size, seed=len(prompt))
        else:
            draft = ScriptedDraft(prompt, ref, target.vocab_size, accept=None if kind == "oracle" else 0)
        out, stats = run(target, prompt, N, draft=draft, block_size=B)
        assert out == ref, (prompt, B, kind)
        assert stats.generated_tokens == N and stats.finish_reason == "length"
        assert sum(stats.accept_hist) == stats.cycles
        assert sum(n * c for n, c in enumerate(stats.accept_hist)) == N - 1
        if kind == "oracle":
            # Every cycle accepts the whole block, save the last one cut by max tokens.
            assert stats.accept_hist[B] == (N - 1) // B
            assert stats.cycles == -(-(N - 1) // B)
        if kind == "partial" and B > 2:
            assert sum(stats.accept_hist[2:B]) > 0  # some cycles accept part of a block
        if kind == "wrong":
            assert stats.accept_hist[1] == stats.cycles == N - 1


@pytest.mark.parametrize("accept", [0, 1, 2, 14])
def test_cache_after_cycles_equals_plain_forward(any_model, accept):
    cfg, model = any_model
    target = Target(model)
    prompt = PROMPTS[1]
    ref = reference_greedy(model, prompt, N)
    draft = ScriptedDraft(prompt, ref, target.vocab_size, accept=accept)
    for n in (accept + 2, N):  # end right after the first cycle, and after many
        cache = target.make_cache()
        out, _ = run(target, prompt, n, draft=draft, block_size=16, cache=cache)
        assert out == ref[:n]
        assert_cache_is_plain_forward(target, cache, prompt + out[:-1])


def test_eos_stops_and_is_never_overshot(dense):
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, N)
    stop_at = 9
    eos = ref[stop_at]
    first = ref.index(eos)
    draft = ScriptedDraft(prompt, ref, target.vocab_size)
    for d in (None, draft):
        out, stats = run(target, prompt, N, draft=d, block_size=16 if d else None, eos_token_ids=[eos])
        assert out == ref[: first + 1]
        assert stats.finish_reason == "stop"
        # Stats count what was handed out: the oracle's block ran past EOS, and the
        # tokens it accepted there are no output (tau counted them before).
        assert 1 + sum(stats.cycle_commits) == stats.generated_tokens == len(out)
        assert sum(n * c for n, c in enumerate(stats.accept_hist)) == sum(stats.cycle_commits)


@pytest.mark.parametrize("profile", [False, True])
def test_plain_loop_cache_is_exact_at_every_stop(dense, profile):
    """The plain loop queues step n+1 before reading step n (profile=False);
    a step queued past an EOS, max_tokens or the context limit is undone."""
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, N)
    first = ref.index(ref[6])
    cases = [
        dict(n=N, eos_token_ids=[ref[6]], want=ref[: first + 1], why="stop"),
        dict(n=5, want=ref[:5], why="length"),
        dict(n=N, max_context=len(prompt) + 7, want=ref[:7], why="length"),
    ]
    for c in cases:
        cache = target.make_cache()
        out, stats = run(
            target,
            prompt,
            c["n"],
            cache=cache,
            profile=profile,
            eos_token_ids=c.get("eos_token_ids", ()),
            max_context=c.get("max_context"),
        )
        assert out == c["want"] and stats.finish_reason == c["why"]
        assert stats.cycles == len(out) - 1 and stats.accept_hist[1] == stats.cycles
        assert_cache_is_plain_forward(target, cache, prompt + out[:-1])


def test_profile_mode_gives_same_tokens_and_a_time_split(dense):
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[2]
    ref = reference_greedy(model, prompt, N)
    draft = ScriptedDraft(prompt, ref, target.vocab_size, accept=3)
    out, stats = run(target, prompt, N, draft=draft, block_size=8, profile=True)
    assert out == ref
    assert stats.draft_time > 0 and stats.verify_time > 0 and stats.rollback_time > 0


def test_block_never_exceeds_remaining_tokens(dense):
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, 10)
    draft = ScriptedDraft(prompt, ref, target.vocab_size)
    out, _ = run(target, prompt, 10, draft=draft, block_size=16)
    assert out == ref
    assert draft.calls == [9]  # one cycle drafts exactly the 9 tokens left
    out, _ = run(target, prompt, 1, draft=draft, block_size=16)
    assert out == ref[:1]


def test_bad_arguments(dense):
    target = Target(dense[1])
    draft = ScriptedDraft([1], [2], target.vocab_size)
    with pytest.raises(DFlashError, match="empty prompt"):
        run(target, [], 4)
    with pytest.raises(DFlashError, match="max_tokens"):
        run(target, [1, 2], 0)
    with pytest.raises(DFlashError, match="num-draft-tokens. must be in 2..16"):
        run(target, [1, 2], 4, draft=draft, block_size=17)
    with pytest.raises(DFlashError, match="num-draft-tokens. must be in 2..16"):
        run(target, [1, 2], 4, draft=draft, block_size=1)
    with pytest.raises(DFlashError, match="context limit"):
        run(target, list(range(50)), 4, max_context=50)
    V = target.vocab_size
    for bad in ([1, V], [1, -1], [1, 10**9]):  # 10**9 read past the embedding: a segfault
        with pytest.raises(DFlashError, match=f"token id {bad[1]} is not a token of this model"):
            run(target, bad, 4)
    with pytest.raises(DFlashError, match="beyond the model's context"):
        run(target, [1, 2], 4, max_context=target.max_context + 1)


def test_public_api_refuses_bad_prompts_and_batches_by_name():
    """Prompts and batches that are not what the API takes: one DFlashError each,
    naming the cause (and, in a batch, the prompt)."""
    import mlx_dflash

    eng = mlx_dflash.load()
    cases = [
        (lambda: mlx_dflash.generate(eng, b"def f", max_tokens=4), "text or a list of token ids, got bytes"),
        (lambda: mlx_dflash.generate(eng, [1, 2.5, 3], max_tokens=4), "token ids must be integers, got 2.5"),
        (lambda: mlx_dflash.generate(eng, None), "text or a list of token ids, got NoneType"),
        (lambda: mlx_dflash.generate(eng, "x", {"max_tokens": 4}), "config must be a GenerationConfig"),
        (lambda: mlx_dflash.batch_generate(eng, "abc", max_tokens=4), "prompts must be a list"),
        (
            lambda: mlx_dflash.batch_generate(eng, ["a", "b"], configs=mlx_dflash.GenerationConfig()),
            "configs must be a list",
        ),
        (lambda: mlx_dflash.batch_generate(eng, ["def f", ""], max_tokens=4), "prompt 1: empty prompt"),
        (lambda: mlx_dflash.batch_generate(eng, [[1, 5000]], max_tokens=4), "prompt 0: prompt token id 5000"),
        (lambda: mlx_dflash.generate(None, "def f"), "engine must be an Engine"),
        (lambda: mlx_dflash.batch_generate(None, ["def f"]), "engine must be an Engine"),
        (lambda: mlx_dflash.generate(eng, "def f", prefix_cache=3), "prefix_cache must be a mlx_dflash.PrefixCache"),
        (lambda: mlx_dflash.batch_generate(eng, ["a"], prefix_cache={}), "prefix_cache must be a"),
        (lambda: mlx_dflash.BatchDecoder(None), "target must be a loaded target"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, eng.draft, policy=3), "policy must be a BatchPolicy"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, eng.draft, eos_token_ids="abc"), "eos_token_ids must be"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, eng.draft).add("def f():"), "add takes token ids"),
        (lambda: mlx_dflash.generate(eng, "def f", system="be brief"), "give chat_template=True"),
        (lambda: mlx_dflash.generate(eng, [1, 2], chat_template=True), "token ids is used as given"),
        (lambda: mlx_dflash.generate(eng, "def f", seed=-1), "seed (--seed) must be in 0..2**63 - 1, got -1"),
        (lambda: mlx_dflash.generate(eng, "def f", seed=2**63), "seed (--seed) must be in 0..2**63 - 1"),
        (lambda: mlx_dflash.generate(eng, "def f", temp=0.7), "temp is make_sampler's name; give temperature"),
        (lambda: mlx_dflash.generate(eng, "def f", num_draft_tokens=3), "give block_size=N + 1"),
        (lambda: mlx_dflash.generate(eng, "def f", prompt_cache=[]), "give prefix_cache="),
        (lambda: mlx_dflash.load(dtype="float64"), "dtype must be one of float32, bfloat16, float16"),
        (lambda: mlx_dflash.load(dtype=mx.int32), "dtype must be one of"),
        (lambda: mlx_dflash.PrefixCache.load("p.safetensors", None), "engine must be an Engine"),
        # mlx-lm's names get their hint; arguments of the wrong kind one error, not a TypeError deep inside
        (lambda: mlx_dflash.generate(eng, "def f", prefill_step_size=64), "give prefill_chunk=N"),
        (lambda: mlx_dflash.generate(eng, "def f", quantized_kv_start=0), "give kv_bits"),
        (lambda: mlx_dflash.generate(eng, "def f", prompt_progress_callback=5), "must be a function"),
        (lambda: mlx_dflash.generate(eng, "x", chat_template=True, chat_template_config=[1]), "must be a dict"),
        (lambda: mlx_dflash.generate(eng, "x", chat_template=True, system=5), "system must be text, got int"),
        (lambda: mlx_dflash.ChatSession("x"), "engine must be an Engine"),
        (lambda: mlx_dflash.ChatSession(eng, chat_template_config="x"), "must be a dict"),
        (lambda: mlx_dflash.ChatSession(eng).send(None), "a message must be text, got NoneType"),
        (lambda: mlx_dflash.load(123), "a path or a Hugging Face id, got int"),
        (lambda: mlx_dflash.load(adapter_path=123), "adapter_path must be a folder path, got int"),
    ]
    for call, words in cases:
        with pytest.raises(DFlashError) as e:
            call()
        assert words in str(e.value)
    assert mlx_dflash.load(dtype="bfloat16").target.embed_tokens.weight.dtype == mx.bfloat16
    assert mlx_dflash.generate(eng, np.array([1, 5, 3]), max_tokens=4).tokens == (
        mlx_dflash.generate(eng, [1, 5, 3], max_tokens=4).tokens
    )
    # whitespace is a prompt (a blank line, an indent): it was refused as empty, its token ids not
    for text in ("\n", "    ", "\n\n    "):
        ids = eng.tokenizer.encode(text)
        assert mlx_dflash.generate(eng, text, max_tokens=6).tokens == mlx_dflash.generate(eng, ids, max_tokens=6).tokens


def test_stream_responses_carry_mlx_lms_fields_as_they_stood(capsys):
    """Each streamed response has mlx-lm's counters of its own step (the live
    ``stats`` ends at the final counts in all of them); generate(verbose=True)
    prints the text and the counts as mlx-lm's generate does."""
    import mlx_dflash

    eng = mlx_dflash.load()
    pieces = list(mlx_dflash.stream_generate(eng, "def f(x):", max_tokens=12))
    counts = [r.generation_tokens for r in pieces]
    assert counts == list(itertools.accumulate(len(r.tokens) for r in pieces)) and counts[-1] == 12
    assert len(set(counts)) == len(pieces) > 1  # a count per step, not the last one everywhere
    assert not hasattr(pieces[0], "token")  # mlx-lm's one token per step: ported code fails, drops none
    assert pieces[0].peak_memory > 0  # the first piece too (prefill's peak)
    assert all(r.prompt_tokens == pieces[-1].stats.prompt_tokens > 0 and r.prompt_tps > 0 for r in pieces)
    assert pieces[-1].generation_tps > 0 and pieces[-1].peak_memory > 0
    result = mlx_dflash.generate(eng, "def f(x):", max_tokens=12, verbose=True)
    out = capsys.readouterr().out
    assert out.startswith("==========\n" + result.text + "\n==========\n")
    assert "Prompt: 5 tokens, " in out and "Generation: 12 tokens, " in out and "Peak memory: " in out


def test_prompt_progress_callback_reports_chunks_and_can_stop_the_prefill():
    """mlx-lm's prompt_progress_callback: (processed, total) after each
    prefill chunk, then (total, total); an exception it raises ends the
    generation before its first token, and the engine decodes on as before."""
    import mlx_dflash

    eng = mlx_dflash.load()
    prompt = list(range(3, 40))
    want = mlx_dflash.generate(eng, prompt, max_tokens=8)
    seen = []
    got = mlx_dflash.generate(
        eng, prompt, max_tokens=8, prefill_chunk=8, prompt_progress_callback=lambda a, b: seen.append((a, b))
    )
    assert got.tokens == want.tokens
    assert seen == [(8, 37), (16, 37), (24, 37), (32, 37), (37, 37)]

    class Gone(Exception):
        pass

    def stop(done, total):
        if done >= 16:
            raise Gone

    with pytest.raises(Gone):
        mlx_dflash.generate(eng, prompt, max_tokens=8, prefill_chunk=8, prompt_progress_callback=stop)
    assert mlx_dflash.generate(eng, prompt, max_tokens=8).tokens == want.tokens


def test_generation_stops_at_context_limit(dense):
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, 12)
    draft = ScriptedDraft(prompt, ref, target.vocab_size)
    out, stats = run(target, prompt, 12, draft=draft, block_size=4, max_context=len(prompt) + 7)
    assert out == ref[:7]  # prompt + output fill the context exactly
    assert stats.finish_reason == "length"


def test_long_prompt_hands_the_draft_only_its_window(dense, random_drafts):
    """Prefill captures features only for the rows a windowed draft keeps, and
    rows the window would drop are never computed; tokens are unchanged."""
    cfg, model = dense
    target = Target(model)
    prompt = [(5 * i + 2) % 400 for i in range(70)]
    ref = reference_greedy(model, prompt, N)
    draft = random_drafts["dense"].bind(target)
    seen = []

    class Spy:
        block_size, target_layer_ids = draft.block_size, draft.target_layer_ids

        def make_cache(self, window=None):
            self.cache = draft.make_cache(window)
            return self.cache

        def __call__(self, features, anchor, pos, B, cache):
            seen.append((0 if features is None else features.shape[0], cache.length, pos))
            return draft(features, anchor, pos, B, cache)

    out, _ = run(target, prompt, N, draft=Spy(), block_size=4, draft_window=(0, 8))
    assert out == ref
    rows, skipped, pos = seen[0]
    assert rows == 8 and skipped + rows == pos == len(prompt)
    assert all(r <= 8 for r, _, _ in seen)


MODES = {
    "plain": dict(),
    "plain-profiled": dict(profile=True),  # the unpipelined plain loop
    "chain": dict(block_size=16),
    "tree": dict(block_size=16, tree_budget=12, tree_topk=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_exact_stops_in_every_mode(dense, mode):
    """max_tokens = 1, EOS as the first token, EOS inside an accepted block and
    the context limit stop on the exact token, in every decoding mode."""
    _, model = dense
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, N)
    kw = dict(MODES[mode])

    def go(n, **extra):
        d = ScriptedDraft(prompt, ref, target.vocab_size) if "block_size" in kw else None
        return run(target, prompt, n, draft=d, **kw, **extra)

    out, stats = go(1)
    assert out == ref[:1] and stats.generated_tokens == 1 and stats.finish_reason == "length"
    out, stats = go(N, eos_token_ids=[ref[0]])
    assert out == ref[:1] and stats.finish_reason == "stop"
    # An EOS the oracle draft proposes in the middle of its first block.
    k = next(i for i in range(4, N) if ref[i] not in ref[:i])
    out, stats = go(N, eos_token_ids=[ref[k]])
    assert out == ref[: k + 1] and stats.finish_reason == "stop" and stats.generated_tokens == k + 1
    if "block_size" in kw:
        assert stats.cycles == 1  # the EOS came inside one accepted block
    for room in (1, 2, 9):
        out, stats = go(N, max_context=len(prompt) + room)
        assert out == ref[:room] and stats.finish_reason == "length"
    # max_tokens below the room left in the context still binds first.
    out, stats = go(3, max_context=len(prompt) + 9)
    assert out == ref[:3]
