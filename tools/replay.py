"""Replaying a width policy against recorded (or scripted) acceptance.

A greedy DFlash draft's proposal from an anchor depends only on the committed
tokens before it, not on the widths chosen earlier: the draft always runs its
full block (``Policy._chain``) and a verified chain of width W keeps
min(right, W - 1) of it. So one plain decoding, with the draft proposing from
every position, records what every policy would see (``record``), and a
policy can be replayed against it (``drive``) and priced by a cost model
(``seconds``) without timing noise: regret at the modelled costs.
"""

from typing import Callable, Dict, List, Sequence, Tuple

from mlx_dflash.config import GenerationConfig
from mlx_dflash.decode import Hooks, longest_match, open_decoder
from mlx_dflash.models.draft import propose
from mlx_dflash.policy import CostModel, Plan, interpolate


def drive(
    policy, accept, cycles, room=10_000, tokens=None, context=0, clock=None, committed=None, reads=None, unread=0
):
    """Run the policy against a draft whose first ``accept(width)`` drafts are
    right (or ``accept(width, tokens committed before it)``), for ``cycles`` plans (or until ``tokens`` are committed) at about
    ``context`` tokens of cache; returns the plans. Plain runs carry shadow
    drafts as the decoder's do (the first after ``plan.shadow`` steps, the
    next after the steps ``policy.shadowed`` returns; scored once the block's
    tokens are committed or, from the second step on, once a miss shows, or
    while all right so far if the policy takes that as enough; a 0
    ends the run after the step already queued), each right for
    ``accept(block)`` tokens.
    ``clock(plan, committed, read)``: the seconds the cycle took, for ``policy.timed``;
    ``committed``: a list to append each plan's committed tokens to;
    ``reads``: one for the committed rows the draft read in each plan (its
    shadows' included), the first ``unread`` of them (the prompt's) unread
    at the start."""
    if accept.__code__.co_argcount == 1:  # a draft as good everywhere in the text
        accept = (lambda f: lambda B, at: f(B))(accept)
    plans = []
    done = 0
    shadow_in, shadow = None, None  # the decoder's countdown and the shadow in flight: (at, right)
    block = policy.max_width
    while (len(plans) < cycles) if tokens is None else (done < tokens):
        left = room if tokens is None else min(room, tokens - done)
        plan = policy.plan(left, context, unread)
        plans.append(plan)
        read = 0
        if plan.width == 1:
            n, last = 0, False
            if plan.shadow and shadow_in is None:
                shadow_in = plan.shadow
            while n < plan.steps:
                n += 1
                done += 1
                unread += 1
                if last:
                    break
                if shadow is not None:
                    seen = done - shadow[0]
                    if seen >= min(block - 1, 2):
                        whole = seen >= block - 1 or shadow[1] < seen
                        seen = min(seen, block - 1)
                        gap = policy.shadowed(seen, min(shadow[1], seen), shadow[2], partial=not whole)
                        if gap is not None:  # booked (a partial look may not be yet)
                            shadow, shadow_in = None, (gap or None)
                            last = gap == 0  # drafting pays: the step already queued is the run's last
                if not last and plan.shadow and shadow is None and shadow_in is not None:
                    shadow_in -= 1
                    if shadow_in <= 0 and (tokens is None or tokens - done > 1):
                        shadow = (done, min(accept(block, done), block - 1), unread)
                        read, unread = read + unread, 0
            if shadow is not None:  # the run ended before the block was scored
                seen = done - shadow[0]
                if seen:
                    gap = policy.shadowed(seen, min(shadow[1], seen), shadow[2])
                    shadow_in = gap or None
                shadow = None
            policy.observe(plan, n)
            if clock:
                policy.timed(plan, n, clock(plan, n, read), read)
            done_by = n
        else:
            n = 1 + min(accept(plan.width, done), plan.width - 1)
            read, unread = unread, n
            policy.observe(plan, n)
            if clock:
                policy.timed(plan, n, clock(plan, n, read), read)
            done += n
            shadow_in = None
            done_by = n
        if committed is not None:
            committed.append(done_by)
        if reads is not None:
            reads.append(read)
    return plans


def parts(
    plans: Sequence[Plan], kept: Sequence[int], costs: CostModel, context: int = 0, read: int = 0
) -> Tuple[float, float]:
    """(plain part, drafted part) of what a run's plans cost under ``costs``:
    plain runs their fill once and their steps; drafted cycles (each drafting
    the full block) their cost, and ``read`` committed rows read by the draft."""
    plain = drafted = 0.0
    done = 0
    for p, n in zip(plans, kept):
        if p.width == 1:  # a run: its fill once, then its steps
            plain += costs.plain_fill + n * costs.cycle(1, context + done)
        else:
            drafted += costs.cycle(p.width, context + done)
        done += n
    return plain, drafted + costs.read(read)


def changes(plans: Sequence[Plan]) -> int:
    """Changes between plain steps and drafted cycles in a run's plans."""
    kinds = [p.width == 1 for p in plans]
    return sum(a != b for a, b in zip(kinds, kinds[1:]))


def seconds(
    plans: Sequence[Plan], kept: Sequence[int], costs: CostModel, shadows: int = 0, context: int = 0, read: int = 0
) -> float:
    """What a replayed run costs under ``costs``: its plain steps, drafted
    cycles (each drafting the full block), ``shadows`` shadow drafts,
    ``read`` committed rows read by the draft (:func:`parts`), and each
    change between plain steps and drafted cycles (``costs.change``)."""
    return sum(parts(plans, kept, costs, context, read)) + shadows * costs.full_draft() + changes(plans) * costs.change


def pinned_seconds(
    right: Sequence[int], width: int, tokens: int, costs: CostModel, context: int = 0
) -> Tuple[float, List[int]]:
    """A pinned width drafting a block of ``width`` (``right``: recorded at
    that block): its run of ``tokens`` tokens priced by ``costs`` as
    :func:`seconds` prices the default's (the same growth with context);
    returns the seconds and the tokens each cycle committed."""
    total, done, kept = 0.0, 0, []
    per_cycle = interpolate(costs.draft, width) + interpolate(costs.verify, width) + costs.rollback
    while done < tokens:
        w = min(width, tokens - done)
        n = 1 + min(right[done], w - 1) if w > 1 else 1
        if w > 1:
            total += per_cycle + costs.cycle(w, context + done) - costs.cycle(w)  # the verify's growth with context
            total += costs.read(n)  # the next draft reads the rows it commits
        else:  # the last token alone: a plain step, after drafted cycles a change (as the default's is priced)
            total += costs.plain_run(1, context + done) + (costs.change if kept else 0.0)
        kept.append(n)
        done += n
    return total, kept


def plain_seconds(tokens: int, costs: CostModel, context: int = 0) -> float:
    """Plain decoding of ``tokens`` tokens priced as :func:`seconds` prices plain steps."""
    return costs.plain_fill + sum(costs.plain_at(context + k) for k in range(tokens))


def record(
    target, draft, prompt: Sequence[int], tokens: int, blocks: Sequence[int], eos_token_ids=()
) -> Tuple[List[int], Dict[int, List[int]]]:
    """Plain greedy decoding of ``tokens`` tokens after ``prompt``, the draft
    proposing a block of each of ``blocks`` from every anchor. Returns the
    tokens and, per block B, ``right[k]``: how many of the B - 1 drafts from
    the anchor at committed token k match the tokens decoding then commits
    (the first miss ends the count)."""
    c = GenerationConfig.build(None, max_tokens=tokens)
    d = open_decoder(target, list(prompt), c, Hooks(), c.sampler(), draft=draft, eos_token_ids=eos_token_ids)
    d.prefill(c.prefill_chunk)
    out = [d.anchor]
    guesses: Dict[int, List[List[int]]] = {B: [] for B in blocks}
    while len(out) < tokens and not d.finished:
        context = d.draft_context()
        for B in blocks:
            drafted, _ = propose(draft, context, d.anchor, d.pos, B, d.dcache)
            guesses[B].append(drafted.tolist())
            context = None  # the rows are in the draft's cache now
        out += d.cycle(Plan(1))
    # The chain rule the decoder verifies with, against the tokens that followed each anchor.
    right = {
        B: [longest_match(g[: len(out) - k - 1], out[k + 1 : k + 1 + len(g)]) for k, g in enumerate(gs)]
        for B, gs in guesses.items()
    }
    return out, right


def replayed(right: Sequence[int]) -> Callable[[int, int], int]:
    """``accept`` for :func:`drive` from a recorded ``right`` list (past its end: no draft right)."""
    return lambda width, at: right[at] if at < len(right) else 0


def regret_row(
    make_policy: Callable[[], object], right: Dict[int, List[int]], tokens: int, costs: CostModel, widths: Sequence[int]
) -> Dict[str, object]:
    """Seconds of the default policy, each pinned width and plain decoding on
    one recorded prompt (``right`` per block; the policy's block is the widest)."""
    B = max(right)
    policy = make_policy()
    kept: List[int] = []
    reads: List[int] = []
    plans = drive(policy, replayed(right[B]), 0, tokens=tokens - 1, committed=kept, reads=reads)
    row = {"default": seconds(plans, kept, costs, policy.shadows, read=sum(reads)), "plans": plans, "kept": kept}
    row["shadows"] = policy.shadows
    for w in widths:
        row[f"pinned {w}"] = pinned_seconds(right[w], w, tokens - 1, costs)[0]
    row["plain"] = plain_seconds(tokens - 1, costs)
    return row


def widths_used(plans: Sequence[Plan], kept: Sequence[int]) -> str:
    """``width:cycles`` as the regret bench prints them (1 = plain steps)."""
    out: Dict[int, int] = {}
    for p, n in zip(plans, kept):
        out[p.width] = out.get(p.width, 0) + (n if p.width == 1 else 1)
    return " ".join(f"{w}:{c}" for w, c in sorted(out.items()))
