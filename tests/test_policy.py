"""The width policy: plain steps when the draft is useless, the widest block
for an oracle, and a cost curve measured once per model and machine."""

import json
import random
from pathlib import Path

import pytest
from support.reference import reference_greedy
from test_decode import ScriptedDraft

from mlx_dflash.decode import GenerationStats, Hooks, _generate_tokens, generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.policy import CHANGE_STEPS, Acceptance, CostModel, Plan, Policy, load_costs, recent_median
from tools import tiny
from tools.replay import drive

ROOT = Path(__file__).resolve().parents[1]

PROMPT = [1, 10, 20, 30, 40]


def synthetic_costs():
    """Costs shaped like the embedded pair's (ms): a 16-token cycle ~2.5 plain steps."""
    return CostModel(
        plain=0.010,
        verify={2: 0.012, 4: 0.013, 8: 0.015, 16: 0.019},
        draft={2: 0.004, 4: 0.004, 8: 0.0045, 16: 0.005},
        rollback=0.001,
    )


def test_useless_draft_goes_plain_and_looks_only_by_shadow_drafts():
    """Once plain, a useless draft is looked at by shadow drafts alone (no
    verify), one per ``shadow_every`` plain tokens: their cost stays under
    the policy's share of plain decoding's time."""
    policy = Policy(16, synthetic_costs())
    plans = drive(policy, lambda B: 0, 0, tokens=3000)
    assert plans[:2] == [Plan(1, steps=Policy.settle_steps), Plan(1, steps=Policy.calibration_steps)]
    first_plain = next(i for i, p in enumerate(plans) if p.width == 1 and i > 1)
    assert first_plain <= 6  # a few cycles to learn the draft is wrong
    assert all(p.width == 1 for p in plans[first_plain:]), [p.width for p in plans]
    plain_tokens = sum(p.steps for p in plans if p.width == 1)
    assert plain_tokens > 2950
    every = policy.shadow_every
    assert 16 <= every <= Policy.plain_run
    assert policy.shadows == pytest.approx(plain_tokens / every, abs=len(plans))
    c = synthetic_costs()
    assert policy.shadows * c.draft[16] <= 1.1 * Policy.shadow_share * plain_tokens * c.plain


def test_oracle_draft_gets_the_widest_block():
    policy = Policy(16, synthetic_costs())
    plans = drive(policy, lambda B: B - 1, 12)
    assert plans[-1].width == 16 and all(p.width == 16 for p in plans[5:])
    assert all(p.width > 1 for p in plans[2:])  # after the settling and calibration steps


def accept_each_with(p, seed=0):
    """A draft whose every token is right with probability ``p``, independently."""
    rng = random.Random(seed)

    def accept(B):
        n = 0
        while n < B - 1 and rng.random() < p:
            n += 1
        return n

    return accept


def stalled_clock(policy, stall_from, stall_to, factor=3.0):
    """Cycle times: a plain step at 0.9 and a drafted cycle at 1.2 of the
    measured costs (the model is off, differently for each kind), and every
    cycle from the ``stall_from``-th to the ``stall_to``-th ``factor`` times
    slower (a stall of the machine, alike for every width)."""
    n = [0]

    def clock(plan, committed, read=0):
        n[0] += 1
        slow = factor if stall_from <= n[0] < stall_to else 1.0
        if plan.width == 1:
            return slow * 0.9 * committed * policy.costs.cycle(1)
        return slow * 1.2 * policy.costs.cycle(plan.width)

    return clock


@pytest.mark.parametrize("p", [0.85, 0.6, 0.45])
def test_a_stall_that_slows_every_width_alike_changes_no_choice(p):
    """The same draft, the same machine, with and without a stretch of 30
    cycles timed 3x slow: the same widths, cycle for cycle. (Acceptance 0.85:
    wide blocks; 0.6: narrow ones; 0.45: plain runs and drafting in turn.)"""
    runs = []
    for stall in ((0, 0), (40, 70)):
        policy = Policy(16, synthetic_costs())
        clock = stalled_clock(policy, *stall)
        plans = drive(policy, accept_each_with(p), 200, clock=clock)
        runs.append([(q.width, q.steps) for q in plans])
    assert runs[0] == runs[1]
    assert len({w for w, _ in runs[0][40:]}) > 1 or p > 0.8  # the choice is live, not stuck


def test_first_drafted_cycles_are_narrow_where_verifies_are_dear():
    """A 16-token cycle at 12 plain steps (a slow BLAS, a big target): the
    first drafted cycles are as wide as pays under the prior, not the block;
    a draft that keeps everything still gets the widest block."""
    dear = CostModel(plain=0.005, verify={2: 0.020, 4: 0.025, 8: 0.030, 16: 0.040}, draft={16: 0.018}, rollback=0.001)
    plans = drive(Policy(16, dear), lambda B: 0, 0, tokens=64)
    drafted = [p.width for p in plans if p.width > 1]
    assert drafted and max(drafted) <= 8, drafted
    plans = drive(Policy(16, dear), lambda B: B - 1, 8)
    assert plans[-1].width == 16, [p.width for p in plans]


def test_good_draft_again_after_plain_run_returns_to_drafting():
    policy = Policy(16, synthetic_costs())
    drive(policy, lambda B: 0, 20)  # learns the draft is useless
    plans = drive(policy, lambda B: B - 1, 12)  # text the draft now predicts
    assert plans[-1].width == 16


def long_context_costs():
    """As synthetic_costs, but each verified row pays 1 us per context token
    beyond 64 (a plain step 0.5 us): at 4k tokens a 16-row verify costs 6 plain steps."""
    c = synthetic_costs()
    c.context, c.per_key_verify, c.per_key_plain = 64, 1e-6, 0.5e-6
    return c


def test_costs_grow_with_the_context_and_wide_blocks_most():
    c = long_context_costs()
    assert c.cycle(16, 64) == synthetic_costs().cycle(16)
    assert c.cycle(1, 4064) == pytest.approx(0.010 + 0.5e-6 * 4000)
    assert c.cycle(16, 4064) - c.cycle(16, 64) == pytest.approx(16 * 1e-6 * 4000)
    assert c.cycle(16, 4064) / c.cycle(2, 4064) > c.cycle(16, 64) / c.cycle(2, 64)


def test_a_good_draft_drafts_narrower_deep_in_a_long_context():
    def accept_each_with(p, seed=0):  # every draft right with probability p, independently
        rng = random.Random(seed)

        def accept(B):
            n = 0
            while n < B - 1 and rng.random() < p:
                n += 1
            return n

        return accept

    mean_width = {}
    for ctx in (100, 4000):
        plans = drive(Policy(16, long_context_costs()), accept_each_with(0.85), 200, context=ctx)[-100:]
        mean_width[ctx] = sum(p.width for p in plans) / len(plans)
    assert mean_width[100] > 9  # cheap verifies: wide blocks for the chance of more
    assert mean_width[4000] < 0.6 * mean_width[100]  # dear verifies: narrower


def test_a_useless_draft_costs_no_verify_deep_in_a_long_context():
    policy = Policy(16, long_context_costs())
    plans = drive(policy, lambda B: 0, 0, tokens=1500, context=4000)
    first_plain = next(i for i, p in enumerate(plans) if p.width == 1 and i > 1)
    assert all(p.width == 1 for p in plans[first_plain:])
    assert sum(p.steps for p in plans if p.width == 1) > 1450


def test_pinned_width_and_tree_ignore_the_costs():
    assert Policy(16, None, fixed=4).plan(100) == Plan(4)
    assert Policy(16, None, fixed=4).plan(3) == Plan(3)
    assert Policy(16, None, tree_budget=12).plan(100) == Plan(13, tree=True, block=16)
    assert Policy(16, None).plan(1) == Plan(1, steps=1)


def test_expected_tokens_follow_per_depth_acceptance():
    acc = Acceptance(8, weight=1e-9)  # no prior: the counts alone
    for _ in range(10):
        acc.observe(7, 2)  # always 2 accepted of 7
    assert acc.p(1) == pytest.approx(1.0) and acc.p(2) == pytest.approx(1.0) and acc.p(3) < 1e-6
    assert acc.expected(8) == pytest.approx(3.0)


@pytest.fixture(scope="module")
def pair(dense):
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(
        cfg, num_hidden_layers=2, block_size=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8
    )
    return model, target, tiny.build_draft(dcfg, seed=11).bind(target)


class DelayedProposal:
    """A draft whose proposal takes ``delay(rows of features read)`` seconds more."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        return self.inner(*args)

    def propose(self, features, *args):
        import time

        time.sleep(self.delay(0 if features is None else features.shape[0]))
        return self.inner.propose(features, *args)


def test_the_curve_prices_the_draft_as_the_loop_runs_it(pair):
    """A drafted cycle and a shadow take the draft's proposal, not its logits:
    a DFlash 2 draft's selector walks its candidates after them (a third of
    its cost on the bench pair). A draft whose proposal costs 20 ms beyond
    its logits is priced with them (the curve timed the logits alone before)."""
    model, target, draft = pair
    fast = CostModel.measure(target, draft, reps=2)
    slow = CostModel.measure(target, DelayedProposal(draft, lambda rows: 0.02), reps=2)
    assert slow.full_draft() - fast.full_draft() > 0.015, (fast.draft, slow.draft)
    assert fast.full_draft() < 0.015  # the tiny draft alone is far cheaper than the sleep


def test_the_curve_prices_reading_many_rows_at_their_own_rate(pair):
    """A draft forward's rows share its work: reading more rows costs less
    per row. A draft whose proposal pays 20 ms for reading any rows beyond
    the one every forward reads, and 0.5 ms per row, is priced so at 64 and
    at 256 rows (priced at 32 rows' rate, as before, 256 rows came out at
    twice their cost)."""
    model, target, draft = pair
    c = CostModel.measure(
        target, DelayedProposal(draft, lambda rows: 0.020 + 0.0005 * rows if rows > 1 else 0.0), reps=2
    )
    assert set(c.reads) == {32, 128}
    for rows in (64, 256):
        assert c.read(rows) == pytest.approx(0.020 + 0.0005 * rows, rel=0.2), (rows, c.reads, c.draft_row)
    assert c.draft_row == pytest.approx(0.0005, rel=0.2)


def test_a_curve_without_measured_reads_prices_rows_at_one_rate():
    """Curves that hold no ``reads`` (built by hand, or replayed from a
    recorded ratio) price every row at ``draft_row``; with them, reading is
    piecewise linear through the measured points and at ``draft_row`` beyond."""
    c = synthetic_costs()
    c.draft_row = 0.001
    assert c.read(10) == pytest.approx(0.010)
    c.reads = {32: 0.016, 128: 0.032}
    assert c.read(16) == pytest.approx(0.008) and c.read(80) == pytest.approx(0.024)
    assert c.read(228) == pytest.approx(0.032 + 100 * 0.001)
    assert CostModel.from_dict(c.to_dict()) == c


def test_cost_curve_cached_and_invalidated(pair, moe, tmp_path):
    model, target, draft = pair
    costs, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert measured and costs.plain > 0 and set(costs.verify) == {2, 3, 4, 6, 8, 12, 16}
    assert costs.plain_fill >= 0 and set(costs.reads) == {32, 128}
    assert costs.context == 64 and min(costs.per_key_verify, costs.per_key_plain, costs.per_key_base) >= 0
    # Verifies are kept as measured (a wider one may cost less; Policy.ladder skips the narrower then).
    assert all(v > 0 for v in costs.verify.values())
    again, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert not measured and again == costs  # the second load reads the file
    # Another model (same shapes, other weights) is measured anew.
    other = Target(tiny.build_target(tiny.target_config(), seed=99))
    odraft = tiny.build_draft(
        tiny.draft_config(
            tiny.target_config(),
            num_hidden_layers=2,
            block_size=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        seed=11,
    ).bind(other)
    _, measured = load_costs(other, odraft, cache_dir=tmp_path)
    assert measured
    # A file written on another machine (or another mlx) does not count.
    path = tmp_path / "costs.json"
    data = json.loads(path.read_text())
    for e in data["entries"]:
        e["machine"] = "another-machine"
    path.write_text(json.dumps(data))
    _, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert measured
    data = json.loads(path.read_text())
    for e in data["entries"]:
        e["mlx"] = "0.0.1"
    path.write_text(json.dumps(data))
    _, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert measured
    _, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert not measured


def run(target, n, **kw):
    stats = GenerationStats()
    out = []
    for toks in _generate_tokens(target, PROMPT, max_tokens=n, stats=stats, hooks=Hooks.take(kw), **kw):
        out.extend(toks)
    return out, stats


class FrozenClock(Policy):
    """Prices cycles from the given curve only: the machine's timing noise
    (a loaded CI box) cannot move the widths these tests check."""

    def timed(self, plan, committed, seconds, read=0):
        pass


def test_always_wrong_draft_decodes_plainly_with_identical_tokens(pair):
    model, target, real = pair
    N = 80
    ref = reference_greedy(model, PROMPT, N)
    wrong = ScriptedDraft(PROMPT, ref, target.vocab_size, accept=0)
    out, stats = run(target, N, draft=wrong, policy=FrozenClock(16, synthetic_costs()))
    assert out == ref
    widths = stats.tree_sizes
    calib = Policy.calibration_steps
    assert widths[:calib] == [1] * calib  # plain steps time the machine first
    first_plain = widths.index(1, calib)
    assert first_plain <= calib + 8  # B = 1 after a bounded number of cycles
    assert sum(w > 1 for w in widths[first_plain:]) <= 3, widths  # then rare probes only
    assert stats.widths[1] >= N - 20


class Booking(FrozenClock):
    """Records each shadow draft as booked: (tokens compared, accepted)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.booked = []

    def shadowed(self, drafted, accepted, read=0, partial=False):
        gap = super().shadowed(drafted, accepted, read, partial)
        if gap is not None:
            self.booked.append((drafted, accepted))
        return gap


def test_a_useless_draft_costs_its_warm_up_and_early_scored_shadows(pair):
    """A draft wrong from its first token: the warm-up cycle is the only
    drafted one before plain decoding (a verdict for plain right after it
    is not one unlucky cycle: the warm-up was evidence), and each shadow
    draft is booked as soon as its miss shows, two plain steps after it, not
    after its whole block of 15 (which would delay the next look)."""
    model, target, _ = pair
    N = 120
    ref = reference_greedy(model, PROMPT, N)
    wrong = ScriptedDraft(PROMPT, ref, target.vocab_size, accept=0)
    policy = Booking(16, synthetic_costs())
    out, stats = run(target, N, draft=wrong, policy=policy)
    assert out == ref
    widths = stats.tree_sizes
    calib = Policy.settle_steps + Policy.calibration_steps
    assert sum(w > 1 for w in widths[: widths.index(1, calib)]) == Policy.warmup_cycles == 1, widths
    assert len(policy.booked) >= 3 and all(b == (2, 0) for b in policy.booked[:-1]), policy.booked


def test_oracle_draft_decodes_at_the_widest_block(pair):
    model, target, real = pair
    N = 80
    ref = reference_greedy(model, PROMPT, N)
    oracle = ScriptedDraft(PROMPT, ref, target.vocab_size)
    out, stats = run(target, N, draft=oracle, policy=FrozenClock(16, synthetic_costs()))
    assert out == ref
    # Replay the cycles: an oracle's cycle of width w commits w tokens (a
    # plain step one). After the calibration steps every cycle is the full
    # block while one fits: the first look at the draft is at its full block
    # (2.5 plain steps here), and an oracle keeps it there.
    done, wide_room = 1, []
    for i, w in enumerate(stats.tree_sizes):
        if i >= Policy.settle_steps + Policy.calibration_steps and N - done >= 16:
            wide_room.append(w)
        done += w
    assert done == N and len(wide_room) >= 4 and set(wide_room) == {16}, stats.tree_sizes


def test_depths_a_narrow_width_never_reaches_go_stale():
    """One early miss at depth 4, then blocks of 3 drafts all right: the
    estimate at depth 4 drifts back toward depth 3's within a few blocks
    (those depths go stale faster), so the width is looked at again instead
    of staying at 4 for the rest of the text (seen on an easy prompt)."""
    a = Acceptance(16)
    a.observe(15, 3)
    for _ in range(8):
        a.observe(3, 3)
    assert a.p(4) >= 0.8 * a.p(3), (a.p(3), a.p(4))
    assert a.p(2) > 0.85  # tested depths keep their evidence


def test_first_look_is_the_full_block_unless_it_is_dear():
    """The first warm-up cycle drafts the full block where it costs at most
    ``full_look`` plain steps; where verifies are dear, as wide as the prior
    pays (here: a 16-wide cycle at 10 plain steps)."""
    plans = drive(Policy(16, synthetic_costs()), lambda B: B - 1, 6)
    assert [p.width for p in plans if p.width > 1][0] == 16
    dear = synthetic_costs()
    dear.verify = {2: 0.012, 4: 0.016, 8: 0.040, 16: 0.095}
    plans = drive(Policy(16, dear), lambda B: B - 1, 6)
    assert 1 < [p.width for p in plans if p.width > 1][0] < 16


def test_first_look_is_narrow_where_a_full_block_costs_several_narrow_ones():
    """At the Qwen3.5-35B-A3B shape's measured ratios (bench/results/moe-shape.md:
    a block reads every expert its rows pick, so verifying 8 rows costs 3.26
    plain steps and 3 rows 1.77, with a draft of 0.53) a full first look is
    3.8 plain steps, under ``full_look``'s 4, but 1.6 times the 3-wide cycle
    the prior pays best at: the first look is that narrow one (the old rule
    took the full block, 4.4% of 128 tokens where plain decoding is best).
    The ratio compares drafted cycles alone: a correction that makes them all
    dearer does not change it."""
    moe = CostModel(
        plain=1.0,
        verify={2: 1.39, 3: 1.77, 4: 2.04, 6: 2.73, 8: 3.26},
        draft={B: 0.53 for B in (2, 3, 4, 6, 8)},
        rollback=0.0,
    )
    first = [p.width for p in drive(Policy(8, moe), lambda B: 0, 6) if p.width > 1][0]
    assert first in (3, 4), first
    full = CostModel(plain=1.0, verify={2: 1.2, 4: 1.3, 8: 1.5}, draft={2: 0.5, 4: 0.5, 8: 0.5}, rollback=0.0)
    for fix in (1.0, 1.3):  # drafted cycles as measured, or all 1.3x dearer: 2.6 plain steps, under 4
        full.fixes[:] = [fix] * 5
        assert [p.width for p in drive(Policy(8, full), lambda B: 0, 6) if p.width > 1][0] == 8


def test_cycle_times_reach_the_policy(pair, tmp_path):
    """The real loop times each cycle for the policy (the tests above freeze
    that clock): plain runs and drafted cycles both give load samples, and
    their neighbours a correction of the drafted widths."""
    model, target, real = pair
    costs, _ = load_costs(target, real, cache_dir=tmp_path)
    ref = reference_greedy(model, PROMPT, 100)
    policy = Policy(16, costs)
    out, stats = run(target, 100, draft=ScriptedDraft(PROMPT, ref, target.vocab_size), policy=policy)
    assert out == ref
    assert len(policy.loads) >= 2 and len(policy.fixes) >= 1, (policy.loads, policy.fixes, stats.tree_sizes)


class Timings(FrozenClock):
    """Records what the loop times: (width, tokens, seconds) per cycle or plain run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.times, self.plans = [], []

    def plan(self, room, context=0, unread=0):
        p = super().plan(room, context, unread)
        self.plans.append(p)
        return p

    def timed(self, plan, committed, seconds, read=0):
        self.times.append((plan.width, committed, seconds))


def test_plain_runs_are_timed_whole_as_drafted_cycles_are(pair):
    """Each timed span runs from one cycle's start to the next's, plain runs
    included: every token committed before the last cycle lies in one, and
    the spans tile the decode. (Timed from a plain run's first token read,
    the run's first step was left out, and a 4-step calibration run looked
    0.6-0.7 of a plain step: the correction then read drafted cycles as
    1.6-1.8x their price.)"""
    model, target, _ = pair
    N = 150
    ref = reference_greedy(model, PROMPT, N)
    wrong = ScriptedDraft(PROMPT, ref, target.vocab_size, accept=0)  # mostly plain runs
    policy = Timings(16, synthetic_costs())
    out, stats = run(target, N, draft=wrong, policy=policy)
    assert out == ref
    # A useless draft's plain runs go their planned length (no shadow ends them).
    runs = [p.steps for p in policy.plans if p.width == 1]
    plain = [n for w, n, _ in policy.times if w == 1]
    assert len(plain) >= 3 and plain == runs[: len(plain)], (plain, runs)
    assert plain[:2] == [Policy.settle_steps, Policy.calibration_steps]
    assert sum(sec for _, _, sec in policy.times) <= stats.decode_time


class SlowDraft(ScriptedDraft):
    """Right until position ``good_until``, then wrong; each forward takes ``pause`` seconds."""

    def __init__(self, *a, good_until, pause, **kw):
        super().__init__(*a, **kw)
        self.good_until, self.pause = good_until, pause

    def __call__(self, features, anchor, anchor_pos, B, cache):
        import time

        time.sleep(self.pause)
        self.accept = None if anchor_pos < self.good_until else 0
        return super().__call__(features, anchor, anchor_pos, B, cache)


def test_each_drafted_cycle_is_timed_with_its_own_draft(pair):
    """A drafted cycle launches the next one's draft before it hands out its
    tokens; its timed span ends there, so every drafted cycle's span holds
    its own draft forward, the last before a plain run too. (Timed up to the
    next cycle's start, the cycle before a plain run held no draft and the
    one after a plain run two: on the bench pairs 0.7-0.8x and 1.3x the
    cycles around them, and the correction's samples, taken at those
    changes, scattered with them.)"""
    model, target, _ = pair
    N = 150
    ref = reference_greedy(model, PROMPT, N)
    pause = 0.05  # far above the tiny target's verify
    draft = SlowDraft(PROMPT, ref, target.vocab_size, good_until=len(PROMPT) + 40, pause=pause)
    policy = Timings(16, synthetic_costs())
    out, stats = run(target, N, draft=draft, policy=policy)
    assert out == ref
    widths = [w for w, _, _ in policy.times]
    last_drafted = max(i for i, w in enumerate(widths) if w > 1 and 1 in widths[i + 1 :])
    assert widths[last_drafted + 1] == 1 and sum(w > 1 for w in widths) >= 3, widths
    drafted = [sec for w, _, sec in policy.times if w > 1]
    assert min(drafted) >= pause, (widths, drafted)


def drive_on_the_modelled_clock(policy, tokens=400):
    """Replay stretches of 40 tokens where drafting pays and where it does
    not (switches both ways, shadows in the plain runs) on a clock that
    takes exactly the modelled times: a cycle and the rows its draft read,
    a plain run's fill, its steps, the shadow drafts it carried and their
    rows. Returns the plans."""
    c = policy.costs
    seen = [0]

    def clock(plan, n, read=0):
        if plan.width > 1:
            return c.cycle(plan.width) + c.read(read)
        shadows, seen[0] = policy.shadows - seen[0], policy.shadows
        return c.plain_run(n) + shadows * c.full_draft() + c.read(read)

    rng = random.Random(1)
    return drive(policy, lambda B, at: B - 1 if (at // 40) % 2 else rng.randrange(2), 0, tokens=tokens, clock=clock)


def test_a_plain_runs_shadow_drafts_are_priced_in_its_modelled_time():
    """A plain run's time includes the shadow drafts it carried, so its
    modelled time does too: on a clock that takes exactly the modelled
    times, every plain run and drafted cycle reads as the curve says (load
    1, correction 1). (Priced as plain steps alone, a run with shadows read
    up to 18% slow, and the correction took drafted cycles for cheaper.)"""
    policy = Policy(16, synthetic_costs())
    plans = drive_on_the_modelled_clock(policy)
    assert policy.shadows >= 3 and len({p.width == 1 for p in plans}) == 2
    assert len(policy.fixes) >= 2
    assert policy.fixes == pytest.approx([1.0] * len(policy.fixes)) and policy.load() == pytest.approx(1.0)


def test_a_plain_runs_fill_is_priced_once_a_run():
    """A run of plain steps pays its first step's host work once (no step
    before it overlaps it): on a clock that takes the fill once per run,
    the 4-step calibration run and the 64-step runs read alike, and the
    correction stays 1. (Priced as so many plain steps, a run of 4 read
    ~15% dearer than a run of 64 here, and every generation's first
    sample of the correction was that much off.) Plain decoding's rate is
    a step of a run as long as plain runs go."""
    c = synthetic_costs()
    c.plain_fill = 0.6 * c.plain
    policy = Policy(16, c)
    plans = drive_on_the_modelled_clock(policy)
    assert len({p.steps for p in plans if p.width == 1}) >= 3 and len(policy.fixes) >= 3
    assert policy.fixes == pytest.approx([1.0] * len(policy.fixes)) and policy.load() == pytest.approx(1.0)
    assert policy.cost(1) == pytest.approx(c.plain + c.plain_fill / Policy.plain_run)


def test_the_first_plain_step_after_the_prompt_is_not_timed():
    """The first step after the prompt pays one-off work (what the prefill
    left lazy, first allocations): it runs alone before the calibration
    run and is not timed, so a first step twice a plain step's cost moves
    neither the correction nor the load. (Timed with the calibration run,
    each generation's first sample of the correction read ~8% low on the
    bench pairs; here it would read 0.8.)"""
    c = synthetic_costs()
    policy = Policy(16, c)
    first = [True]

    def clock(plan, n, read=0):
        extra = c.plain if first[0] else 0.0  # the one-off work, in the first plan whatever it is
        first[0] = False
        return extra + (c.cycle(plan.width) if plan.width > 1 else n * c.plain)

    drive(policy, lambda B: B - 1, 0, tokens=60, clock=clock)
    assert policy.fixes and policy.fixes[0] == pytest.approx(1.0), policy.fixes
    assert policy.load() == pytest.approx(1.0)


def reading_costs(row):
    """The synthetic curve with the draft paying ``row`` plain steps per committed row it reads."""
    c = synthetic_costs()
    c.draft_row = row * c.plain
    return c


def shadow_seconds(policy, plans, reads):
    """What the shadow drafts of a replayed run cost: their blocks and the rows they read."""
    c = policy.costs
    rows = sum(r for p, r in zip(plans, reads) if p.width == 1)
    return policy.shadows * c.full_draft() + c.read(rows)


@pytest.mark.parametrize("row", [0.005, 0.01])
def test_shadow_drafts_pay_for_the_rows_they_read_within_their_share(row):
    """A shadow draft first reads every row committed since the draft last
    did (one per plain token), so a useless draft's shadows, blocks and
    rows together, stay within their share of plain decoding's time plus
    the banked ones. (Priced by their blocks alone, shadows 25 tokens apart
    cost 2.5-3% at these costs.)"""
    policy = Policy(16, reading_costs(row))
    reads, kept = [], []
    plans = drive(policy, lambda B: 0, 0, tokens=3000, committed=kept, reads=reads)
    c = policy.costs
    plain = sum(n for p, n in zip(plans, kept) if p.width == 1)
    assert plain > 2950 and policy.shadows >= plain / Policy.plain_run / 2  # they still look
    spent = shadow_seconds(policy, plans, reads)
    assert spent <= Policy.shadow_share * plain * c.plain + policy.bank(), (spent / (plain * c.plain), policy.shadows)
    assert policy.shadow_every == pytest.approx(c.full_draft() / (policy.earned() - c.draft_row), abs=1)


def test_where_reading_a_row_costs_more_than_its_share_only_banked_shadows_look():
    """A draft that pays more per row it reads than a plain token earns of
    the shadows' share: however far apart, a shadow draft would cost more
    than its share, so after the banked ones (the early looks of a plain
    stretch) none is drafted. (Before, one per 64 plain tokens: 5% of plain
    decoding's time here.)"""
    policy = Policy(16, reading_costs(0.03))
    reads, kept = [], []
    plans = drive(policy, lambda B: 0, 0, tokens=2000, committed=kept, reads=reads)
    plain = sum(n for p, n in zip(plans, kept) if p.width == 1)
    assert 1 <= policy.shadows <= Policy.shadow_bank, policy.shadows
    starts = [sum(kept[:i]) for i in range(len(kept))]
    assert all(r == 0 for at, r in zip(starts, reads) if at >= 200), list(zip(starts, reads))  # none later
    assert plain > 1950


def test_a_plain_stretch_after_drafting_keeps_its_shadows_where_few_rows_cost_more_per_row():
    """Reading a few rows costs more per row than reading many (a forward's
    rows share its work): the wait that affords the next shadow is searched
    at the rates the curve has, not worked out at the many-rows rate. A
    draft right from token 20 to 120 and again from 400: the plain stretch
    after 120 still carries shadow drafts, and they bring the loop back to
    drafting soon after 400. (Worked out at one rate, the wait fell short,
    came out as never, and the loop stayed plain to the end.)"""
    c = reading_costs(0.004)
    c.reads = {32: 32 * 0.015 * c.plain, 128: (32 * 0.015 + 96 * 0.004) * c.plain}
    policy = Policy(16, c)
    kept = []
    plans = drive(policy, lambda B, at: B - 1 if 20 <= at < 120 or at >= 400 else 0, 0, tokens=700, committed=kept)
    starts = [sum(kept[:i]) for i in range(len(kept))]
    assert any(p.width > 1 for p, at in zip(plans, starts) if 20 <= at < 120)  # it drafted in the good stretch
    assert all(p.shadow > 0 for p, at in zip(plans, starts) if p.width == 1 and at >= 120), list(zip(starts, plans))
    back = next(at for p, at in zip(plans, starts) if p.width > 1 and at >= 400)
    assert back <= 400 + policy.shadow_every + 16, back


def test_the_rows_a_draft_reads_are_priced_in_the_modelled_time():
    """Drafted cycles read the rows the cycle before committed, shadow drafts
    every row since the last read: on a clock that takes exactly the
    modelled times, reading included, every plain run and drafted cycle
    reads as the curve says (load 1, correction 1). Priced without the
    rows, plain runs with shadows read slow and drafted cycles slower."""
    policy = Policy(16, reading_costs(0.01))
    plans = drive_on_the_modelled_clock(policy)
    assert policy.shadows >= 3 and len({p.width == 1 for p in plans}) == 2
    assert len(policy.fixes) >= 2
    assert policy.fixes == pytest.approx([1.0] * len(policy.fixes)) and policy.load() == pytest.approx(1.0)


class Reads(FrozenClock):
    """Records the rows the loop says the draft read: per timed span and per shadow draft."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.spans, self.shadow_reads = [], []

    def timed(self, plan, committed, seconds, read=0):
        self.spans.append((plan.width, committed, read))

    def shadowed(self, drafted, accepted, read=0, partial=False):
        gap = super().shadowed(drafted, accepted, read, partial)
        if gap is not None:
            self.shadow_reads.append(read)
        return gap


def test_the_loop_reports_the_rows_the_draft_reads(pair):
    """The tiny random draft (it reads the target's features): pinned, each
    drafted cycle's span reads the rows that cycle committed (the next draft
    is launched in it; the last one's is not: one token was left); adaptive, it decodes plainly and a plain run's span
    reads what its shadow drafts read, every row committed since the last."""
    model, target, real = pair
    N = 120
    ref = reference_greedy(model, PROMPT, N)
    pinned = Reads(16, fixed=4)
    out, _ = run(target, N, draft=real, policy=pinned)
    assert out == ref
    assert len(pinned.spans) >= 30 and all(r == n for _, n, r in pinned.spans[1:-1]), pinned.spans
    policy = Reads(16, synthetic_costs())
    out, stats = run(target, N, draft=real, policy=policy)
    assert out == ref and stats.shadow_drafts >= 2
    spans, shadows = policy.spans, policy.shadow_reads
    warm = spans[2]  # after the settling step and the calibration run; it reads the prompt
    assert warm[0] > 1 and warm[2] == len(PROMPT) + Policy.settle_steps + Policy.calibration_steps
    plain = sum(r for w, _, r in spans if w == 1)
    assert 0 < plain <= sum(shadows), (spans, shadows)  # the last run is not timed
    # Every committed row is read once at most, and the shadows leave at most a run's rows unread.
    assert N - Policy.plain_run - 16 <= warm[2] + sum(shadows) - len(PROMPT) <= N, (spans, shadows)


class LateDraft(ScriptedDraft):
    """Wrong until position ``good_from``, then right (an oracle)."""

    def __init__(self, prompt, reference, vocab, good_from):
        super().__init__(prompt, reference, vocab)
        self.good_from = good_from

    def __call__(self, features, anchor, anchor_pos, B, cache):
        self.accept = 0 if anchor_pos < self.good_from else None
        return super().__call__(features, anchor, anchor_pos, B, cache)


def test_shadow_drafts_bring_the_loop_back_to_drafting(pair):
    """A draft wrong for the first 60 tokens, then right: the loop goes plain,
    its shadow drafts see the draft turn right, and it drafts again within a
    shadow spacing and a few tokens; the tokens are plain decoding's. The
    shadow that brings it back is booked while it is right so far, a few
    tokens in, not once its whole block of 15 is committed (15 plain steps
    where cycles commit 16 tokens each)."""
    model, target, _ = pair
    N = 200
    ref = reference_greedy(model, PROMPT, N)
    good_from = len(PROMPT) + 60
    draft = LateDraft(PROMPT, ref, target.vocab_size, good_from)
    policy = Booking(16, synthetic_costs())
    out, stats = run(target, N, draft=draft, policy=policy)
    assert out == ref
    done, back = len(PROMPT) + 1, None
    for w, n in zip(stats.tree_sizes, stats.cycle_commits):
        if w > 1 and done >= good_from and back is None:
            back = done
        done += n
    widths = stats.tree_sizes
    assert 1 in widths[Policy.calibration_steps : Policy.calibration_steps + 12]  # it went plain
    assert back is not None and back - good_from <= policy.shadow_every + 4, (back, widths)
    assert stats.shadow_drafts >= 2 and any(
        "plain -> B" in x and "(shadow evidence, margin x" in x for x in stats.switches
    )
    last = policy.booked[-1]
    assert last[0] == last[1] and 2 <= last[0] <= 4, policy.booked


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.9, "seed": 3}, {"temperature": 0.9, "seed": 3, "repetition_penalty": 1.2}],
    ids=["greedy", "sampled", "repetition-penalty"],
)
def test_shadow_drafts_leave_plain_decodings_tokens(pair, sampling):
    """Shadow drafts run (the draft is called more often than cycles were
    drafted) and the text is plain decoding's, greedy or sampled (the
    repetition penalty takes the unpipelined plain steps)."""
    from mlx_dflash.sampling import Sampler

    model, target, _ = pair
    N = 120
    ref = reference_greedy(model, PROMPT, N)
    base, _ = run(target, N, baseline=True, sampler=Sampler(**sampling))
    if not sampling:
        assert base == ref
    wrong = ScriptedDraft(PROMPT, base, target.vocab_size, accept=0)  # wrong about the text to come
    rule = {"accept_rule": "equality"}  # the rule whose text is plain decoding's (the speculative one pins the block)
    policy = FrozenClock(16, synthetic_costs())
    out, stats = run(target, N, draft=wrong, policy=policy, sampler=Sampler(**sampling), **rule)
    assert out == base
    drafted = sum(w > 1 for w in stats.tree_sizes)
    # Every draft call is a drafted cycle or a shadow (the last one maybe launched too late to score).
    assert stats.shadow_drafts >= 3 and 0 <= len(wrong.calls) - drafted - stats.shadow_drafts <= 1


def test_verbose_says_why_each_switch_happened(pair):
    """``--verbose``'s table ends with a line per change of width: from, to,
    why, the candidates' expected tok/s, the acceptance evidence, the load."""
    from mlx_dflash.cli import _stats_table

    model, target, _ = pair
    ref = reference_greedy(model, PROMPT, 120)
    draft = LateDraft(PROMPT, ref, target.vocab_size, good_from=len(PROMPT) + 40)
    _, stats = run(target, 120, draft=draft, policy=FrozenClock(16, synthetic_costs()))
    table = _stats_table(stats, "dflash")
    lines = [x.strip() for x in table.split("width switches:\n", 1)[1].splitlines()]
    assert lines == stats.switches and len(lines) >= 4
    assert lines[0].startswith("token 0: start -> plain (calibration); expected tok/s plain:100 2:")
    assert lines[1].startswith(f"token {Policy.settle_steps + Policy.calibration_steps}: plain -> B")
    assert any(" -> plain (evidence)" in x for x in lines) and any("(shadow evidence, margin x" in x for x in lines)
    for line in lines:
        assert "expected tok/s plain:" in line and "p1..:" in line and "load x" in line, line
    assert "shadow drafts" in table


def test_default_generation_is_adaptive_and_reports_widths(pair):
    model, target, draft = pair
    ref = reference_greedy(model, PROMPT, 40)
    out, stats = run(target, 40, draft=draft)
    assert out == ref
    assert stats.policy.startswith("adaptive") and sum(stats.widths.values()) == stats.cycles
    out, stats = run(target, 40, draft=draft, block_size=4)
    assert out == ref and stats.policy.startswith("pinned") and set(stats.widths) <= {1, 2, 3, 4}


def test_narrow_widths_are_drafted_from_the_full_block(pair):
    """A DFlash block's rows attend to each other, so a shorter block would
    propose other tokens than the one whose acceptance the policy learned:
    every adaptive cycle drafts the full block and verifies a prefix of it."""
    model, target, _ = pair
    N = 60
    ref = reference_greedy(model, PROMPT, N)
    three_right = ScriptedDraft(PROMPT, ref, target.vocab_size, accept=3)
    out, stats = run(target, N, draft=three_right, policy=Policy(16, synthetic_costs()))
    assert out == ref
    assert any(1 < w < 16 for w in stats.tree_sizes), stats.tree_sizes  # the policy narrowed
    assert three_right.calls and set(three_right.calls) == {16}, three_right.calls


def test_speculative_sampling_keeps_the_full_block(pair):
    """The speculative rule's text depends on what was drafted: timing-chosen
    widths would make a seed's text vary between runs, so it stays pinned;
    the equality rule's text does not depend on widths and stays adaptive."""
    from mlx_dflash.sampling import Sampler

    _, target, draft = pair
    out1, st = run(target, 30, draft=draft, sampler=Sampler(0.9, seed=1), accept_rule="speculative")
    out2, _ = run(target, 30, draft=draft, sampler=Sampler(0.9, seed=1), accept_rule="speculative")
    assert st.policy.startswith("pinned") and out1 == out2
    _, st = run(target, 30, draft=draft, sampler=Sampler(0.9, seed=1), accept_rule="equality")
    assert st.policy.startswith("adaptive")


def test_observed_costs_correct_the_model_apart_from_the_load():
    policy = Policy(16, synthetic_costs())  # plain 10 ms, a 16-wide cycle 25 ms
    c = policy.costs
    # The first cycle at a width is not timed (in a fresh process it traces the width's forwards).
    policy.timed(Plan(16, block=16), 5, 0.200)
    assert policy.cost(16) == pytest.approx(c.cycle(16)) and policy.load() == 1.0
    # A machine twice as slow as at measurement, for every width: the load, not the costs.
    for _ in range(5):
        policy.timed(Plan(1, steps=16), 16, 16 * 2 * c.plain)
        policy.timed(Plan(16, block=16), 5, 2 * c.cycle(16))
    assert policy.load() == pytest.approx(2.0)
    assert policy.cost(1) == pytest.approx(c.plain) and policy.cost(16) == pytest.approx(c.cycle(16))
    # Drafted cycles dearer than the curve says next to plain steps that are not: that counts.
    for _ in range(5):
        policy.timed(Plan(1, steps=16), 16, 16 * 2 * c.plain)
        policy.timed(Plan(16, block=16), 5, 3 * c.cycle(16))
    assert policy.cost(16) / policy.cost(1) == pytest.approx(1.5 * c.cycle(16) / c.plain)
    # Drafted cycles alone, ten times slower (a stall, or anything else no
    # plain step was timed beside): the load moves, the costs do not.
    for _ in range(5):
        policy.timed(Plan(16, block=16), 5, 30 * c.cycle(16))
    assert policy.cost(16) / policy.cost(1) == pytest.approx(1.5 * c.cycle(16) / c.plain)
    assert policy.load() == pytest.approx(20.0)
    # The next generation on the same curve starts from what this one saw; another curve does not.
    assert Policy(16, c).correction() == pytest.approx(1.5) and Policy(16, synthetic_costs()).correction() == 1.0


def run_between_plain(policy, drafted):
    """Plain runs at the curve's cost, and between them one drafted cycle at
    ``drafted`` times its cost: each gives one sample, with the run before it."""
    c = policy.costs
    for r in drafted:
        policy.timed(Plan(1, steps=16), 16, 16 * c.plain)
        policy.timed(Plan(16, block=16), 5, r * c.cycle(16))
    policy.timed(Plan(1, steps=16), 16, 16 * c.plain)


def test_a_few_noisy_samples_after_many_that_agree_leave_the_correction():
    """A correction sample is one drafted cycle against the plain run beside
    it, and those read 10-20% apart from run to run on a busy machine. After
    six samples that agree with the curve, three reading drafted cycles 20%
    cheaper leave the correction at 1 (a median of the last 5 took them for
    a price, and drafted where plain decoding paid); a change that lasts
    moves it, and on a new curve three in a row move it as before."""
    c = synthetic_costs()
    fresh = Policy(16, c)
    fresh.warm_widths.add(16)
    run_between_plain(fresh, [0.8] * 3)
    assert c.fixes == pytest.approx([0.8] * 3) and fresh.correction() == pytest.approx(0.8)

    c = synthetic_costs()
    policy = Policy(16, c)
    policy.warm_widths.add(16)
    run_between_plain(policy, [1.0] * 6)
    assert c.fixes == pytest.approx([1.0] * 6)
    for _ in range(2):  # drafted cycles 20% cheaper, and a plain run between them
        policy.timed(Plan(16, block=16), 5, 0.8 * c.cycle(16))
        policy.timed(Plan(1, steps=16), 16, 16 * c.plain)
    policy.timed(Plan(16, block=16), 5, 0.8 * c.cycle(16))
    assert c.fixes[-3:] == pytest.approx([0.8] * 3) and len(c.fixes) == 9
    assert policy.correction() == pytest.approx(1.0)
    run_between_plain(policy, [0.8, 0.8])
    assert c.fixes[-5:] == pytest.approx([0.8] * 5) and policy.correction() == pytest.approx(0.8)


def test_a_stalled_cycle_between_two_plain_runs_gives_one_sample():
    """A warm-up cycle or a probe is a drafted cycle between two plain runs.
    Each change beside it gave a sample of the correction, so one stall
    there (that cycle alone 2.5 times slower) gave two samples as far off,
    and two such stalls on a fresh curve (four samples of the five counted)
    put the correction at 2.5: the draft stayed off for the rest of the
    process (in the noisy-clock replay, a prompt at 0.49 of its best mode).
    Each observation now serves one sample at most: two stalls leave the
    correction at 1, and drafted cycles that stay that dear move it, as far
    as ``CORRECTION_BOUND`` (1.5): beyond that a run of stalls is likelier
    than a price, and a correction that keeps the draft off gets no samples
    to come back by."""
    c = synthetic_costs()
    policy = Policy(16, c)
    policy.warm_widths.add(16)
    run_between_plain(policy, [2.5, 2.5])
    assert c.fixes == pytest.approx([2.5, 2.5]) and policy.correction() == 1.0
    run_between_plain(policy, [2.5] * 3)
    assert recent_median(c.fixes, 9) == pytest.approx(2.5) and policy.correction() == pytest.approx(1.5)
    run_between_plain(policy, [0.2] * 9)  # as far the other way
    assert policy.correction() == pytest.approx(1 / 1.5)


def test_a_width_traced_in_this_process_is_timed_from_the_next_generation_on():
    """The first cycle at a width traces its forwards, once per process: it
    is not timed. A later generation on the same curve times its first
    cycle at that width (before, every generation skipped it, so one that
    drafted a single cycle gave no sample); a width not run yet is still
    skipped, and so is a width on another curve."""
    c = synthetic_costs()
    first = Policy(16, c)
    first.timed(Plan(16, block=16), 5, 0.200)  # the trace: not timed
    assert first.loads == []
    second = Policy(16, c)
    second.timed(Plan(16, block=16), 5, 2 * c.cycle(16))
    assert second.loads == [pytest.approx(2.0)]
    second.timed(Plan(8, block=16), 5, 0.200)  # width 8 has not run in this process
    assert len(second.loads) == 1
    other = Policy(16, synthetic_costs())
    other.timed(Plan(16, block=16), 5, 0.200)
    assert other.loads == []


def test_an_early_bad_stretch_costs_only_a_few_plain_tokens():
    """A draft wrong for the first 300 tokens, then right: the policy goes
    plain, and shadow drafts bring it back to drafting soon after the text
    turns predictable (before, it came back only on a probe schedule that
    doubled while probes failed)."""
    policy = Policy(16, synthetic_costs())
    kept = []
    plans = drive(policy, lambda B, at: 0 if at < 300 else B - 1, 0, tokens=600, committed=kept)
    done, back = 0, None
    for p, n in zip(plans, kept):
        if p.width > 1 and done >= 300 and back is None:
            back = done
        done += n
    assert any(p.width == 1 for p in plans[:20])  # it did go plain
    # Within a shadow draft's spacing and its block (and the plain step queued when it is scored).
    assert back is not None and back - 300 <= policy.shadow_every + 16, (back, [p.width for p in plans])
    starts = [sum(kept[:i]) for i in range(len(kept))]
    assert all(p.width == 16 for p, at in list(zip(plans, starts))[-6:] if 600 - at >= 16)


@pytest.mark.parametrize("turn", [20, 40])
def test_an_early_bad_stretch_costs_little_of_a_short_generation(turn):
    """A draft as dear as a plain step (shadow drafts 60 tokens apart once
    settled), wrong until token ``turn``, then right:
    the first shadow draft comes a block after the switch to plain and the
    spacing doubles from there (16, 32, then 60), so a turn in the first
    40 tokens is seen within 48 (with a fixed spacing of 60 the draft was
    not looked at again before token 67)."""
    c = synthetic_costs()
    c.draft = {16: 0.012}
    policy = Policy(16, c)
    assert policy.shadow_every == 60
    kept = []
    plans = drive(policy, lambda B, at: 0 if at < turn else B - 1, 0, tokens=120, committed=kept)
    done, back = 0, None
    for p, n in zip(plans, kept):
        if p.width > 1 and done >= turn and back is None:
            back = done
        done += n
    assert any(p.width == 1 and p.steps > 4 for p in plans)  # it went plain
    assert back is not None and back - turn <= 48, (back, [p.width for p in plans])


@pytest.mark.parametrize("seed", range(3))
def test_low_acceptance_costs_at_most_3_percent_over_plain_decoding(seed):
    """Each draft right with probability 0.25: drafting never pays on the
    synthetic costs. Priced by those costs, the policy's decoding (its
    drafted cycles, plain steps and shadow drafts) takes at most 3% longer
    than plain decoding of the same tokens."""
    policy = Policy(16, synthetic_costs())
    c = policy.costs
    kept = []
    plans = drive(policy, accept_each_with(0.25, seed=seed), 0, tokens=2000, committed=kept)
    seconds = sum(n * c.plain if p.width == 1 else c.cycle(p.width) for p, n in zip(plans, kept))
    seconds += policy.shadows * c.draft[16]
    assert seconds / (sum(kept) * c.plain) < 1.03, [p.width for p in plans if p.width > 1]


@pytest.mark.parametrize("p", [0.3, 0.4])
def test_promising_shadows_keep_to_their_share(p):
    """A draft always close to paying and never paying (every draft right
    with probability ``p`` at costs where drafting needs more): each shadow
    looks promising and asks to look again at once, yet shadows spend at
    most their share of plain decoding's time, plus the few banked for the
    start of a plain stretch. (Before the budget, promising shadows came one
    plain step apart: 2000 tokens took 3-4% over plain decoding.)"""
    policy = Policy(16, synthetic_costs())
    kept = []
    plans = drive(policy, accept_each_with(p, seed=1), 0, tokens=2000, committed=kept)
    plain = sum(n for q, n in zip(plans, kept) if q.width == 1)
    assert policy.shadows <= Policy.shadow_bank + plain / policy.shadow_every + 1, (policy.shadows, plain)
    assert policy.shadows >= plain / policy.shadow_every / 2  # and they still look


def test_widths_come_from_a_ladder_so_few_widths_are_ever_traced():
    policy = Policy(16, synthetic_costs())
    assert policy.ladder(100) == [2, 3, 4, 6, 8, 12, 16]
    assert policy.ladder(7) == [2, 3, 4, 6, 7]  # the room left is a width too
    rng = random.Random(3)

    def accept(B):
        n = 0
        while n < B - 1 and rng.random() < 0.8:
            n += 1
        return n

    widths = {p.width for p in drive(policy, accept, 300)}
    assert widths <= {1, 2, 3, 4, 6, 8, 12, 16} and len(widths) > 2


def test_a_width_whose_verify_costs_more_than_a_wider_ones_is_never_drafted():
    """Measured on a CPU, a verify of 3 rows cost more than one of 4 (6.8 ms
    against 5.8) and 5-7 rows more than 8. Priced between 2 and 4, width 3
    looked no dearer than 4: a draft right to depth 2 was drafted at 3 (a tie
    in expected tokens, the narrower taken) for 49 cycles and lost 18% to the
    pinned block of 4, timed. Each ladder width's verify is measured now, and
    a narrower one that costs as much as a wider one leaves the ladder."""
    v = {2: 5.5, 3: 6.8, 4: 5.8, 6: 7.0, 8: 6.7}
    costs = CostModel(plain=4.9e-3, verify={B: t * 1e-3 for B, t in v.items()}, draft={8: 2.0e-3}, rollback=1e-4)
    policy = Policy(8, costs)
    assert policy.ladder(100) == [2, 4, 8]
    assert policy.ladder(5) == [2, 4, 5]  # the room left, unmeasured, stays (interpolated)

    def accept(B):  # right to depth 2, then wrong
        return min(B - 1, 2)

    plans = drive(policy, accept, 60)
    assert {p.width for p in plans[10:]} == {4}, [p.width for p in plans]
    # Priced from 2, 4 and 8 alone, as before, ties went to width 3.
    measured = {B: costs.verify[B] for B in (2, 4, 8)}
    old = Policy(8, CostModel(plain=costs.plain, verify=measured, draft=costs.draft, rollback=1e-4))
    assert 3 in {p.width for p in drive(old, accept, 60)[10:]}


def test_a_verify_deep_in_a_context_costs_a_base_plus_a_per_row_term():
    c = synthetic_costs()
    c.context, c.per_key_base, c.per_key_verify = 64, 2e-6, 0.25e-6  # cache-read bound, as on a GPU
    extra = lambda B: c.cycle(B, 4064) - c.cycle(B, 64)  # noqa: E731
    assert extra(2) == pytest.approx(4000 * (2e-6 + 2 * 0.25e-6))
    assert extra(16) == pytest.approx(4000 * (2e-6 + 16 * 0.25e-6))
    assert CostModel.from_dict(c.to_dict()) == c


def test_the_in_process_memo_tells_compiled_from_plain_ops(pair, tmp_path):
    _, target, draft = pair
    _, measured = load_costs(target, draft, cache_dir=tmp_path)
    assert measured
    try:
        target.compiled = draft.compiled = False
        _, measured = load_costs(target, draft, cache_dir=tmp_path)
        assert measured  # its own curve, not the compiled one
    finally:
        target.compiled = draft.compiled = True


def tree_costs():
    c = synthetic_costs()
    c.tree = {13: 0.021}  # a 12-node tree: a little dearer than the 16-wide chain's verify
    return c


def drive_trees(policy, chain_kept, tree_kept, cycles):
    """Plans against a draft whose chain cycles keep ``chain_kept(width)``
    tokens and tree cycles ``tree_kept``; returns the drafted plans."""
    plans = []
    while len(plans) < cycles:
        plan = policy.plan(10_000)
        if plan.width == 1:
            policy.observe(plan, plan.steps)
            continue
        plans.append(plan)
        kept = tree_kept if plan.tree else chain_kept(plan.width)
        policy.observe(plan, kept)
        policy.timed(plan, kept, policy.costs.tree_cycle(plan.width) if plan.tree else policy.costs.cycle(plan.width))
    return plans


def test_auto_tree_is_chosen_when_trees_keep_more_and_only_looked_at_when_not():
    chain = lambda B: min(B, 3)  # noqa: E731  (a chain keeps 3 tokens)
    plans = drive_trees(Policy(16, tree_costs(), auto_tree=12), chain, 8, 60)
    assert sum(p.tree for p in plans[10:]) >= 45  # trees keep 8: the policy takes them
    plans = drive_trees(Policy(16, tree_costs(), auto_tree=12), chain, 1, 200)
    trees = [i for i, p in enumerate(plans) if p.tree]
    assert 2 <= len(trees) <= 2 + 200 // Policy.tree_every  # a look now and then, no more
    assert all(p.width == 13 and p.block == 16 for p in plans if p.tree)


def test_auto_tree_decodes_plain_greedy_tokens(pair):
    model, target, draft = pair
    ref = reference_greedy(model, PROMPT, 60)
    stats = GenerationStats()
    out = sum(generate_tokens(target, PROMPT, draft=draft, max_tokens=60, auto_tree=6, stats=stats), [])
    assert out == ref and "tree of 6" in stats.policy
    # A draft that is right (every chain, every tree path): the policy looks at
    # the tree. Synthetic costs: a loaded CI box's measured curve of this tiny
    # pair can price drafting below plain before the first look.
    costs = synthetic_costs()
    costs.tree = {7: 0.014}
    oracle = ScriptedDraft(PROMPT, ref, target.vocab_size)
    out, stats = run(target, 60, draft=oracle, policy=FrozenClock(16, costs, auto_tree=6))
    assert out == ref and 7 in stats.widths, stats.widths
    with pytest.raises(DFlashError, match="not both"):
        next(generate_tokens(target, PROMPT, draft=draft, max_tokens=4, auto_tree=6, tree_budget=6))


def embedded_costs():
    """The embedded pair's curve as measured on the project's CPU (OpenBLAS, one
    thread; bench/results/policy-replay.md): a plain step 8.7 ms, a 16-wide
    cycle 2.9 plain steps, a shadow draft 0.6, a context row the draft reads
    0.004 (measured again when that term came in)."""
    return CostModel(
        plain=0.00872,
        verify={2: 0.0125, 4: 0.0127, 8: 0.0176, 16: 0.0196},
        draft={4: 0.0040, 16: 0.0052},
        rollback=0.0007,
        draft_row=0.004 * 0.00872,
    )


def test_the_replay_prices_every_mode_alike_deep_in_a_context():
    """tools/replay prices plain decoding and a pinned width as it prices the
    default's own plain steps and cycles, growth with the context included:
    an earlier version grew only the default's, charging it 1-2% too much
    at 512 tokens."""
    from tools.replay import pinned_seconds, plain_seconds, seconds

    costs = embedded_costs()
    costs.context, costs.per_key_plain, costs.per_key_verify, costs.per_key_base = 64, 4e-6, 1e-6, 3e-6
    n = 512
    plain_plans = [Plan(1)] * n
    assert plain_seconds(n, costs) == pytest.approx(seconds(plain_plans, [1] * n, costs))
    assert plain_seconds(n, costs) > n * costs.plain * 1.05  # the growth is there to price
    total, kept = pinned_seconds([15] * n, 16, n, costs)
    assert sum(kept) == n
    assert total == pytest.approx(seconds([Plan(16)] * len(kept), kept, costs, read=sum(kept)))  # it reads every row
    # One token more is a plain step after the cycles: a change, priced as the default's changes are.
    total, kept = pinned_seconds([15] * (n + 1), 16, n + 1, costs)
    plans = [Plan(16)] * (len(kept) - 1) + [Plan(1)]
    assert kept[-1] == 1 and total == pytest.approx(seconds(plans, kept, costs, read=sum(kept[:-1])))


@pytest.fixture(scope="module")
def embedded_records():
    """What the embedded draft proposes from every anchor of two shipped bench
    prompts, 128 tokens each (tools/replay.record), at its block and at 4."""
    import mlx_dflash
    from mlx_dflash.benchmark import read_prompts
    from tools.replay import record

    eng = mlx_dflash.load()
    prompts = read_prompts()
    out = {}
    for name in ("code_parse", "prose_module_doc"):
        ids = eng.encode(prompts[name])
        out[name] = record(eng.target, eng.draft, ids, 128, [4, eng.draft.block_size], eng.tokenizer.eos_token_ids)[1]
    return out


@pytest.mark.parametrize("name", ["code_parse", "prose_module_doc"])
def test_replayed_on_the_embedded_draft_the_default_loses_nothing(embedded_records, name):
    """The real embedded draft's acceptance, replayed (no timing): on a prompt
    where the draft misses early and then turns good (code_parse) and on one
    where whole blocks are right (prose_module_doc), the default's modelled
    time is within 3% of the better of the pinned widths and plain decoding.
    It guards the policy as a whole on a real draft's acceptance; timing
    noise is what the replay leaves out (bench/regret.py measures it)."""
    from tools.replay import regret_row

    costs = embedded_costs()
    right = embedded_records[name]
    row = regret_row(lambda: Policy(16, costs), right, 128, costs, [4, 16])
    better = min(row["pinned 4"], row["pinned 16"], row["plain"])
    assert better / row["default"] >= 0.97, (name, {k: v for k, v in row.items() if k not in ("plans", "kept")})


def block8_costs():
    """The block-8 DFlash 2 draft's curve with the embedded target on the
    project's CPU (bench/results/policy-replay.md): a plain step 8.8 ms, an
    8-wide cycle 3.2 plain steps, a shadow draft 0.7, a context row the draft
    reads 0.004 (measured again when that term came in)."""
    return CostModel(
        plain=0.00878,
        verify={2: 0.0163, 4: 0.0179, 8: 0.0211},
        draft={2: 0.0056, 8: 0.0062},
        rollback=0.0010,
        draft_row=0.004 * 0.00878,
    )


@pytest.fixture(scope="module")
def block8_record():
    """What bench/drafts/dflash2-b8 proposes from every anchor of code_class
    (128 tokens), at its block and at 4."""
    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash.api import DEFAULT_MODEL
    from mlx_dflash.benchmark import read_prompts
    from tools.replay import record

    eng = mlx_dflash.load()
    draft = mlx_dflash.load(DEFAULT_MODEL, str(ROOT / "bench" / "drafts" / "dflash2-b8"), dtype=mx.float32).draft
    ids = eng.encode(read_prompts()["code_class"])
    return record(eng.target, draft, ids, 128, [4, 8], eng.tokenizer.eos_token_ids)[1]


def test_a_draft_that_nearly_pays_is_not_restarted_on_a_few_lucky_shadows(block8_record):
    """The block-8 draft on code_class: plain decoding is best (a cycle costs
    3.2 plain steps and the draft keeps about 2 tokens), but some shadow
    drafts are right for whole blocks. Leaving plain decoding takes a margin
    that shrinks with the evidence (``Policy.margin``), so the default stays
    within 5% of plain decoding; without it two lucky shadows restarted
    drafting twice and it lost 9% (0.912 in the replay).
    The 3% goal is not met here: the warm-up cycle and five shadow drafts
    cost 4.4% of 128 plain steps."""
    from tools.replay import regret_row

    costs = block8_costs()
    row = regret_row(lambda: Policy(8, costs), block8_record, 128, costs, [4, 8])
    better = min(row["pinned 4"], row["pinned 8"], row["plain"])
    assert better == row["plain"]
    assert better / row["default"] >= 0.95, {k: v for k, v in row.items() if k not in ("plans", "kept")}


def test_a_curve_measured_under_load_is_measured_again(pair, tmp_path):
    """A curve timed while something else held the machine (here: every term
    of the cached curve 10x what it costs now) reads as such in a generation
    (load well under 1): the generation says so and marks it stale in the
    cache, and the next load measures the pair again. That new curve is
    never dropped (a machine that always runs faster than it measures keeps
    it), and a curve the runs match stays, under a stall too (slower than
    measured is today's load, not the curve's)."""
    model, target, real = pair
    load_costs(target, real, cache_dir=tmp_path)
    path = tmp_path / "costs.json"
    data = json.loads(path.read_text())
    c = data["entries"][0]["costs"]
    for k in ("plain", "rollback", "per_key_verify", "per_key_plain", "per_key_base"):
        c[k] *= 10
    for k in ("verify", "draft", "tree"):
        c[k] = {w: 10 * t for w, t in c[k].items()}
    path.write_text(json.dumps(data))
    costs, measured = load_costs(target, real, cache_dir=tmp_path)
    assert not measured
    ref = reference_greedy(model, PROMPT, 160)
    oracle = ScriptedDraft(PROMPT, ref, target.vocab_size)
    policy = Policy(16, costs)
    out, stats = run(target, 160, draft=oracle, policy=policy)
    assert out == ref
    assert len(policy.loads) == 5 and policy.load() < Policy.stale_load, policy.loads
    assert any("measured under load" in line for line in stats.switches), stats.switches
    assert [e.get("stale") for e in json.loads(path.read_text())["entries"]] == [True]
    again, measured = load_costs(target, real, cache_dir=tmp_path)
    assert measured and again.plain < costs.plain / 2
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0].get("remeasured") and not entries[0].get("stale")
    # Were the new curve also read as measured under load, it stays.
    again.plain, again.rollback = 10 * again.plain, 10 * again.rollback
    again.verify = {w: 10 * t for w, t in again.verify.items()}
    again.draft = {w: 10 * t for w, t in again.draft.items()}
    policy = Policy(16, again)
    out, stats = run(target, 160, draft=oracle, policy=policy)
    assert out == ref and policy.drifted()
    assert not any("measured under load" in line for line in stats.switches)
    assert json.loads(path.read_text())["entries"] == entries

    for stall in ((0, 0), (150, 200)):
        matched = Policy(16, synthetic_costs())
        drive(matched, accept_each_with(0.6), 200, clock=stalled_clock(matched, *stall))
        assert len(matched.loads) == 5 and not matched.drifted(), matched.loads


def test_a_damaged_cost_cache_is_measured_again_not_an_error(pair, tmp_path):
    """A costs.json that parses but holds the wrong shapes (entries not a
    list, entries not objects, an entry without its costs) is measured over."""
    model, target, real = pair
    costs, _ = load_costs(target, real, cache_dir=tmp_path)
    path = tmp_path / "costs.json"
    entry = json.loads(path.read_text())["entries"][0]
    del entry["costs"]
    for damaged in ({"entries": [1, "x", entry]}, {"entries": None}, [entry]):
        path.write_text(json.dumps(damaged))
        again, measured = load_costs(target, real, cache_dir=tmp_path)
        assert measured and set(again.verify) == set(costs.verify)
        assert [e["model"] for e in json.loads(path.read_text())["entries"]] == [entry["model"]]


def test_the_switch_back_from_plain_says_the_margin_it_cleared_after_many_drafted_cycles():
    """--verbose's line for leaving plain decoding names the evidence margin
    it cleared, also when many drafted cycles came before the plain stretch
    (the warm-up count once ran below zero there and the margin went unsaid)."""
    policy = Policy(16, synthetic_costs())

    def accept(B, at):  # right for whole blocks, then wrong for a long stretch, then right again
        return B - 1 if at < 80 or at >= 200 else 0

    drive(policy, accept, 0, tokens=400)
    back = [x for x in policy.switches if "plain -> B" in x and "shadow evidence" in x]
    assert back and all("margin x" in x for x in back), policy.switches
    assert policy.warmup == 0


def test_a_draft_that_nearly_pays_on_shadow_evidence_is_probed_not_left_plain():
    """Costs of a trained block-8 pair on this CPU (plain steps: a verify of 8
    at 2.14, a draft forward at 1.08, so a shadow is dear and the budget
    allows one per 64 plain tokens): the draft is wrong where the warm-up
    and the first shadow look and then right for whole blocks (the recorded
    start of ``doc_read_file``). The second shadow is right for its whole
    block but, on 2.4 blocks of evidence, drafting does not clear the margin
    over plain decoding; a drafted cycle is then expected to lose a fifth of
    a plain step, far less than a shadow costs, so the next look is that
    cycle (the old policy waited 80 plain tokens for the budget of another
    shadow: 113 of 128 tokens plain, 0.68 of a pinned block's speed). Under
    a stall that slows every width alike, the same plans."""
    plain = 0.00732
    right = [0, 1, 0, 1, 0, 1, 0, 0, 0, 2, 1, 0, 1, 0, 4, 1, 4, 1] + [7] * 200
    runs = []
    for stall in ((0, 0), (3, 12)):
        # A curve each, as in two processes: one generation's timings do not carry to the other.
        costs = CostModel(
            plain=plain,
            verify={2: 1.55 * plain, 4: 1.79 * plain, 8: 2.14 * plain},
            draft={2: 0.92 * plain, 4: 0.97 * plain, 8: 1.08 * plain},
            rollback=0.107 * plain,
            draft_row=0.01 * plain,
        )
        policy = Policy(8, costs)
        kept = []
        plans = drive(
            policy, lambda B, at: right[at], 0, tokens=127, committed=kept, clock=stalled_clock(policy, *stall)
        )
        runs.append([(p.width, p.steps) for p in plans])
        plain_tokens = sum(n for p, n in zip(plans, kept) if p.width == 1)
        assert plain_tokens < 45, (plain_tokens, policy.switches)
        assert any("probe" in line for line in policy.switches), policy.switches
    assert runs[0] == runs[1]


class Looking(Policy):
    """Adds up what shadow drafts cost, at the curve's prices, as they are booked."""

    looked = 0.0

    def shadowed(self, drafted, accepted, read=0, partial=False):
        gap = super().shadowed(drafted, accepted, read, partial)
        if gap is not None:
            self.looked += self.costs.shadow(read)
        return gap


@pytest.mark.parametrize("tokens", [64, 128, 200])
def test_a_short_generation_spends_at_most_its_share_on_shadows(tokens):
    """The shadows' bank is an advance on what later plain tokens earn: on a
    short generation where the draft never helps, the shadows it carries
    cost at most ``shadow_share`` of its plain time, and it still looks.
    Costs like the trained block-8 pairs' (a shadow 0.7 plain steps, the
    block's cycle 2.9): with the bank alone, 64 tokens spent 1.6 times the
    share, 200 tokens 1.2 times."""
    c = CostModel(plain=0.006, verify={2: 0.015, 4: 0.0157, 8: 0.0172}, draft={8: 0.0042}, rollback=0.0005)
    policy = Looking(8, c)
    drive(policy, lambda B: 0, 0, tokens=tokens)
    assert policy.shadows >= 1
    assert policy.looked <= Policy.shadow_share * tokens * c.plain_at() + 1e-12, (
        policy.shadows,
        policy.looked / c.plain,
    )


def steady(p, blocks=400.0, depths=8):
    """Acceptance evidence of ``blocks`` blocks, right at every depth with probability ``p``."""
    acc = Acceptance(depths)
    acc.trials = [blocks] * (depths + 1)
    acc.hits = [p * blocks] * (depths + 1)
    return acc


@pytest.mark.parametrize(
    "now, faster, room, change",
    [(8, 1.03, 8, False), (8, 1.03, 60, True), (1, 1.03, 60, False), (1, 1.06, 60, True)],
)
def test_a_change_that_saves_less_than_it_costs_is_not_made(now, faster, room, change):
    """A change between plain steps and drafted cycles costs a fraction of a
    plain step beyond its parts (``bench/switch_cost.py``: 0.2-0.4 on this
    CPU), spread over the stretch it starts: a plain run leaving drafting,
    a block leaving plain decoding. Drafting (cycles of 8) with plain steps
    3% faster on ample evidence, the policy keeps drafting with a block
    left and changes with 60; decoding plainly, it keeps to plain steps
    where drafting is 3% faster and changes where it is 6% faster. Under a
    stall that slows every kind alike, the same. The policy before changes
    were priced changed wherever the other kind was faster."""
    c = CostModel(plain=0.006, verify={2: 0.015, 4: 0.0157, 8: 0.0172}, draft={8: 0.0042}, rollback=0.0005)
    assert 0.2 <= CHANGE_STEPS <= 0.4

    def ratio(policy, room):  # the best drafted width's rate over plain's, no change priced (as at the start)
        last, policy.last = policy.last, 0
        r = policy.rates(room)
        policy.last = last
        return max(v for B, v in r.items() if B > 1) / r[1]

    def made(p, stall=1.0):
        policy = Policy(8, c)
        policy.settle, policy.plain_left, policy.warmup = None, 0, 0
        for _ in range(4):  # earlier cycles, every kind ``stall`` times slower than the curve says
            policy.timed(Plan(1, steps=4), 4, stall * c.plain_run(4))
            policy.timed(Plan(8, block=8), 3, stall * c.cycle(8))
        policy.tokens, policy.last, policy.plain_votes = 50, now, 1
        policy.acc = steady(p)
        return policy, policy.plan(room).width

    target = faster if now == 1 else 1 / faster  # the other kind this much faster
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the acceptance that puts it there
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(made(mid)[0], room) < target else (lo, mid)
    policy, width = made(lo)
    assert ratio(policy, room) == pytest.approx(target, rel=1e-6)
    assert policy.margin() < 1.02  # ample evidence: the margin for leaving plain is not what decides
    assert ((width == 1) != (now == 1)) == change, policy.switches
    assert made(lo, stall=3.0)[1] == width  # a stall that slows every kind alike: the same choice
