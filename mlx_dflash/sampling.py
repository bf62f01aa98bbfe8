"""Samplers for the decode loop, exact under speculative decoding (docs/math.md).

Two acceptance rules (``ACCEPT_RULES``) keep the output distribution the
target's whatever the draft proposes. "equality": a drafted token is kept only
when it equals the target's own pick for its row. Sampling is Gumbel-max with
noise keyed by (seed, absolute position), so the token at position p is the
same function of the target's logits whether it is decoded plainly, in a
chain block or at any node of a tree: the same seed gives the same output in
every mode. "speculative" (``speculative_rule``): the draft samples its block
and a token is kept with probability min(1, p/q).
"""

import math
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_repetition_penalty

from .errors import DFlashError

ACCEPT_RULES = ("speculative", "equality")
# The one default of every layer (decode loop, API, CLI, server): it kept
# more drafted tokens in all four cases of bench/results/accept-rules.md.
DEFAULT_ACCEPT_RULE = "speculative"
# The sampler's filter options, by the names Sampler, Sampler.check and
# GenerationConfig take (the seed apart).
SAMPLER_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens_to_keep",
    "repetition_penalty",
    "repetition_context_size",
    "xtc_probability",
    "xtc_threshold",
    "xtc_special_tokens",
)
# The least temperature above 0: its reciprocal, which scales the scores, is a float32.
MIN_TEMPERATURE = 1e-38


class Sampler:
    """temperature / top-p / min-p / top-k / repetition penalty, as mlx-lm's
    ``make_sampler`` and ``make_repetition_penalty`` apply them.

    A row's logits go through mlx-lm's steps in its order and precision (the
    logits' own dtype): the repetition penalty on the logits, log-probabilities
    ``logits - logsumexp(logits)``, then top-p, min-p (keeping at least
    ``min_tokens_to_keep``) and top-k on those log-probabilities (at
    temperature 1, before the temperature), then ``* (1 / temperature)``.
    Greedy is the argmax of the log-probabilities, as mlx-lm's greedy sampler.
    Only the draw differs: Gumbel noise keyed by (seed, position) instead of
    mlx-lm's global random state, so the distribution is mlx-lm's and the
    draw at a position is the same in every decoding mode.

    ``__call__(logits [N, V], positions [N], contexts)`` -> ids [N]. ``contexts[i]``
    (only when ``needs_context``) is the token history row i sees, most recent last.
    ``top_p`` 0 or 1, ``min_p`` 0 and ``top_k`` 0 turn a filter off.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        repetition_context_size: int = 20,
        seed: Optional[int] = None,
        *,
        min_tokens_to_keep: int = 1,
        xtc_probability: float = 0.0,
        xtc_threshold: float = 0.1,
        xtc_special_tokens: Sequence[int] = (),
    ):
        self.temperature = temperature
        self.top_p, self.top_k, self.min_p = top_p, top_k, min_p
        self.min_tokens_to_keep = min_tokens_to_keep
        self.repetition_penalty = repetition_penalty
        self.repetition_context_size = repetition_context_size
        self.xtc_probability, self.xtc_threshold = xtc_probability, xtc_threshold
        self.xtc_special_tokens = tuple(int(t) for t in xtc_special_tokens)
        # Made once: XTC cuts every sampled row of every cycle.
        self._xtc_kept = mx.array(self.xtc_special_tokens, dtype=mx.int32) if self.xtc_special_tokens else None
        self.check(**{name: getattr(self, name) for name in SAMPLER_OPTIONS})
        # A window past any history is the whole history; capped so mlx-lm's slice of it stays a 32-bit index.
        window = min(repetition_context_size, 2**31 - 1)
        self._penalty = make_repetition_penalty(repetition_penalty, window) if repetition_penalty != 1.0 else None
        if seed is None:
            seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
        self.seed = int(seed)  # a numpy integer would overflow in the keys' arithmetic

    @staticmethod
    def check(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        repetition_context_size,
        min_tokens_to_keep,
        xtc_probability=0.0,
        xtc_threshold=0.1,
        xtc_special_tokens=(),
    ) -> None:
        """The ranges of the sampling options (the one place they are checked)."""
        if not math.isfinite(temperature) or temperature < 0:
            raise DFlashError(f"temperature (--temp) must be a finite number >= 0, got {temperature}")
        if 0 < temperature < MIN_TEMPERATURE:  # 1 / temperature scales the scores: it must be a float32
            raise DFlashError(
                f"temperature (--temp) must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}"
            )
        if not 0.0 <= top_p <= 1.0:
            raise DFlashError(f"top_p (--top-p) must be in [0, 1] (0 or 1: off), got {top_p}")
        if 0 < top_p < MIN_TEMPERATURE:  # a float32 0 there would keep no token at all
            raise DFlashError(f"top_p (--top-p) must be 0 or 1 (off) or at least {MIN_TEMPERATURE:g}, got {top_p}")
        if top_k < 0:
            raise DFlashError(f"top_k (--top-k) must be >= 0, got {top_k}")
        if not 0.0 <= min_p <= 1.0:
            raise DFlashError(f"min_p (--min-p) must be in [0, 1], got {min_p}")
        if min_tokens_to_keep < 1:
            raise DFlashError(f"min_tokens_to_keep (--min-tokens-to-keep) must be >= 1, got {min_tokens_to_keep}")
        if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
            raise DFlashError(
                f"repetition_penalty (--repetition-penalty) must be a finite positive number, got {repetition_penalty}"
            )
        if repetition_context_size < 1:
            raise DFlashError("repetition_context_size (--repetition-context-size) must be positive")
        if not 0.0 <= xtc_probability <= 1.0:
            raise DFlashError(f"xtc_probability (--xtc-probability) must be in [0, 1], got {xtc_probability}")
        if not 0.0 <= xtc_threshold <= 0.5:
            raise DFlashError(f"xtc_threshold (--xtc-threshold) must be in [0, 0.5], got {xtc_threshold}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_context(self) -> bool:
        return self._penalty is not None

    def _penalize(self, logits: mx.array, contexts: Sequence[Sequence[int]]) -> mx.array:
        # mlx-lm's processor, one row at a time (each row has its own history).
        return mx.concatenate(
            [
                self._penalty(mx.array(list(ctx), dtype=mx.int32), logits[i : i + 1]) if len(ctx) else logits[i : i + 1]
                for i, ctx in enumerate(contexts)
            ]
        )

    def _filter(self, logprobs: mx.array, top_k: bool = True) -> mx.array:
        """mlx-lm's filters, in make_sampler's order: top-p, min-p, top-k
        (masked tokens get -inf; XTC, which comes before top-k, is in
        :meth:`_tempered`)."""
        seed = mx.random.state[0]
        try:
            if 0.0 < self.top_p < 1.0:
                logprobs = apply_top_p(logprobs, self.top_p)
            if self.min_p != 0.0 and self.min_tokens_to_keep < logprobs.shape[-1]:  # keeping >= V keeps every token
                logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
            return self._top_k(logprobs) if top_k else logprobs
        except Exception:
            # mlx-lm compiles these filters with MLX's global random state as an
            # input and output: one that raises mid-trace leaves that state a
            # placeholder, and every later sampler that draws its seed from it
            # would fail. Reseeded from the state before (as deterministic).
            mx.random.seed(int(seed[1].item()))
            raise

    def _top_k(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_k < logprobs.shape[-1]:  # top_k >= V keeps every token
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def _xtc_cut(self, logprobs: mx.array) -> mx.array:
        """XTC's cut (mlx-lm's apply_xtc): of the tokens above the threshold
        all but the least likely one go, newline and EOS (the special tokens) kept."""
        probs = mx.softmax(logprobs.astype(mx.float32), axis=-1)
        least = mx.where(probs > self.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        cut = probs > least
        if self._xtc_kept is not None:
            cut[..., self._xtc_kept] = False
        return mx.where(cut, -mx.inf, logprobs)

    def _tempered(self, logprobs: mx.array) -> mx.array:
        """Float32 scores whose softmax is the sampling distribution (T > 0;
        a half-precision 1 / temperature overflows from temperature 1.5e-5 down).

        mlx-lm applies XTC's cut with probability ``xtc_probability``, a coin
        per step; drawn here from the mixture of the two distributions, the
        draw is keyed by (seed, position) as every other one, and both the
        equality and the speculative rule keep the target's distribution."""
        scale = 1.0 / self.temperature

        def temper(x):
            # Shifted to a maximum of 0 first (softmax and the Gumbel argmax
            # ignore a shift): at a temperature near 1e-38 a flat row's scores
            # would all overflow to -inf.
            x = x.astype(mx.float32)
            return (x - mx.max(x, axis=-1, keepdims=True)) * scale

        if not self.xtc_probability:
            return temper(self._filter(logprobs))
        pre = self._filter(logprobs, top_k=False)
        whole = temper(self._top_k(pre))
        cut = temper(self._top_k(self._xtc_cut(pre)))
        p = self.xtc_probability
        whole = whole - mx.logsumexp(whole, axis=-1, keepdims=True) + (math.log(1 - p) if p < 1 else -mx.inf)
        cut = cut - mx.logsumexp(cut, axis=-1, keepdims=True) + math.log(p)
        return mx.logaddexp(whole, cut)

    def _scores(self, logits: mx.array, contexts) -> mx.array:
        """Penalized log-probabilities (greedy: in the logits' dtype, as mlx-lm
        computes them) or filtered ones tempered in float32 (a half-precision
        1 / temperature overflows from temperature 1.5e-5 down)."""
        if self.needs_context:
            if contexts is None:
                raise ValueError("repetition penalty needs each row's context")
            logits = self._penalize(logits, contexts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            return logprobs
        return self._tempered(logprobs)

    def noise(self, positions: Sequence[int], vocab: int) -> mx.array:
        """Gumbel noise [N, V], a fixed function of (seed, position)."""
        return mx.stack(
            [
                mx.random.gumbel((vocab,), key=mx.random.key((self.seed * 1_000_003 + int(p)) % (2**63)))
                for p in positions
            ]
        )

    def probs(self, logits: mx.array, contexts=None) -> mx.array:
        """The distribution a row is sampled from, [N, V] float32 (T > 0)."""
        return mx.softmax(self._scores(logits, contexts).astype(mx.float32), axis=-1)

    def __call__(
        self, logits: mx.array, positions: Sequence[int], contexts: Optional[Sequence[Sequence[int]]] = None
    ) -> mx.array:
        scores = self._scores(logits, contexts)
        if self.greedy:
            return mx.argmax(scores, axis=-1)
        scores = scores.astype(mx.float32)
        return mx.argmax(scores + self.noise(positions, scores.shape[-1]), axis=-1)


def greedy_sampler() -> Sampler:
    return Sampler(0.0, seed=0)


# --- the speculative-sampling rule (docs/dflash2.md) -----------------------------


def _keys(seed: int, positions) -> List[mx.array]:
    return [mx.random.key((seed * 1_000_003 + int(p)) % (2**63)) for p in positions]


def keyed_gumbel(seed: int, positions, n: int, stream: int) -> mx.array:
    """Gumbel noise [len(positions), n] keyed by (seed, position, stream);
    streams >= 1 never reuse the target sampler's own noise."""
    return mx.stack(
        [mx.random.gumbel((n,), key=mx.random.split(k, stream + 1)[stream]) for k in _keys(seed, positions)]
    )


def keyed_uniform(seed: int, positions, stream: int) -> mx.array:
    """One uniform in [0, 1) per position, keyed by (seed, position, stream)."""
    return mx.stack(
        [mx.random.uniform(shape=(), key=mx.random.split(k, stream + 1)[stream]) for k in _keys(seed, positions)]
    )


def speculative_rule(p: mx.array, q: mx.array, drafted: mx.array, picks: mx.array, seed: int, positions: Sequence[int]):
    """Standard speculative sampling of a drafted chain (Leviathan et al.;
    Chen et al.), on the device.

    p [B, V]: the target's sampling distribution for each block row; q [B-1, V]:
    the proposal each drafted token [B-1] was drawn from; picks [B]: the
    sampler's own draws from p (the last one is the bonus). Draft i is
    accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the row's token is drawn from the residual max(p_i - q_i, 0).
    Returns (accepted [B-1] bool, token [B]: what row i emits if it is the
    first row not accepted).
    """
    n = drafted.shape[0]
    d = drafted[:, None].astype(mx.int32)
    pd = mx.take_along_axis(p[:n], d, axis=-1)[:, 0]
    qd = mx.take_along_axis(q, d, axis=-1)[:, 0]
    u = keyed_uniform(seed, positions[:n], stream=2)
    accepted = u * qd < pd
    res = mx.maximum(p[:n] - q, 0.0)
    tot = res.sum(axis=-1, keepdims=True)
    res = mx.where(tot > 0, res / mx.maximum(tot, 1e-30), p[:n])
    g = keyed_gumbel(seed, positions[:n], p.shape[-1], stream=3)
    fix = mx.argmax(mx.log(res) + g, axis=-1).astype(picks.dtype)
    return accepted, mx.concatenate([fix, picks[n:]])
