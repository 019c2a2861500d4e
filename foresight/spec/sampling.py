"""The target distribution p_i of a request, and sampling from it.

`p_i` is the target's next-token distribution after the request's processing, applied in the order
vLLM and HF transformers use:

    1. temperature   z = logits / T                      (T == 0: greedy, p_i = point mass at argmax)
    2. top-k         keep tokens with z >= z_(k)         (z_(k) = k-th largest; ties at z_(k) are kept)
    3. top-p         keep the smallest prefix S of the tokens sorted by probability (descending) with
                     sum_{x in S} softmax(z)(x) >= top_p; the top token is always kept; among equal
                     probabilities the lower token id comes first (stable sort)
    p = softmax(z restricted to the kept tokens)

Everything is computed in float32 whatever the logits' dtype. All functions work on any leading
shape `[..., vocab]`; the verification passes `[positions, vocab]` (or `[batch, positions, vocab]`).

A request's draws are keyed by the position of the token they decide (`PositionDraws`), not taken one
after another from a stream: how the positions were grouped into blocks (which depends on draft lengths,
and those on timings) then changes nothing. With point-mass drafts and exact verification the token
committed at a position is the draw there whether its draft was accepted or not, so a seeded request
samples the same text in every mode, `ar` included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["is_greedy", "process_logits", "target_probs", "sample", "check_sampling", "PositionDraws", "BlockDraws",
           "banned_tokens", "drafts_before_banned"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function (SplitMix64's finaliser): consecutive inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class BlockDraws:
    """A request's draws for the positions of one block (`PositionDraws.block`)."""

    exponentials: torch.Tensor  # [..., n, vocab] float32 Exp(1) per token: the token drawn at each position
    uniforms: torch.Tensor  # [..., n] float64 in [0, 1): the acceptance test of a general proposer's draft


class PositionDraws:
    """One request's random draws, a function of (seed, position, stream) alone.

    The token drawn at a position is the exponential race argmin_x E_x / p(x) (E_x ~ Exp(1), one per
    token; the same law as inverse-CDF sampling). Its decision moves only if two tokens' E_x / p(x) come
    within rounding of each other, as rare as a greedy near-tie: the inverse CDF of a 49k-token vocabulary
    flips wherever rounding shifts the cumulative sum past u, which in fp32 was 3 of 8 HumanEval prompts
    over 96 tokens between a 1-token step and a verify forward."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._key = _splitmix64(self.seed & _MASK64)

    def _seed(self, position: int, stream: int) -> int:
        return _splitmix64(self._key ^ _splitmix64(2 * position + stream)) >> 1  # 63 bits: a generator seed

    def uniforms(self, first: int, n: int, device="cpu") -> torch.Tensor:
        """Stream 1 for positions first..first+n-1: float64 [n] in [0, 1)."""
        values = [(self._seed(pos, 1) >> 10) * 2.0 ** -53 for pos in range(first, first + n)]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def exponentials(self, first: int, n: int, vocab: int, device="cpu") -> torch.Tensor:
        """Stream 0 for positions first..first+n-1: float32 [n, vocab] Exp(1) draws, one per token."""
        rows = []
        for pos in range(first, first + n):
            gen = torch.Generator(device=device).manual_seed(self._seed(pos, 0))
            rows.append(torch.rand(vocab, generator=gen, device=device))
        return -torch.log(torch.stack(rows))  # rand is in [0, 1): an E of inf never wins the race

    def block(self, first: int, n: int, vocab: int, device="cpu") -> BlockDraws:
        return BlockDraws(self.exponentials(first, n, vocab, device), self.uniforms(first, n, device))


def is_greedy(params) -> bool:
    """True for greedy decoding (temperature 0). `params` is a number or has a `.temperature`."""
    temperature = getattr(params, "temperature", params)
    return float(temperature) == 0.0


def _top_k_off(top_k: int | None, vocab: int) -> bool:
    return top_k is None or top_k <= 0 or top_k >= vocab


def check_sampling(temperature: float, top_k: int | None, top_p: float) -> None:
    """Raise ValueError for parameters outside their domain (0 and None mean 'off' for top_k)."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < -1:
        raise ValueError(f"top_k must be >= -1 (<= 0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Scaled float32 logits with the tokens removed by top-k / top-p set to -inf.  # [..., vocab]

    Temperature must be > 0 here (greedy has no logits to scale; see `target_probs`).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        raise ValueError("process_logits needs temperature > 0; greedy is argmax (target_probs)")
    z = logits.float() / temperature  # [..., vocab]
    vocab = z.shape[-1]

    # top-k: z < z_(k) is removed; ties with the k-th value stay (as vLLM / HF).
    if not _top_k_off(top_k, vocab):
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))

    # top-p: in the order (probability desc, token id asc), token j is kept iff the mass strictly
    # before it is < top_p, i.e. S is the smallest prefix whose mass reaches top_p. The first token
    # has mass 0 before it, so at least one token always survives.
    if top_p < 1.0:
        z = z.masked_fill(_top_p_removed(torch.softmax(z, dim=-1), top_p), float("-inf"))
    return z


def _top_p_removed(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens outside the top-p set.  bool [..., vocab]

    A full sort of a 50k vocabulary costs milliseconds per row, so we sort only the top-n candidates
    (n = 256, 4096, ... up to the vocab). With c the n-th largest value, the candidates above c are
    *all* tokens above c; once their mass reaches top_p, every token at or below c has at least
    that much mass before it and is removed, so the candidates decide the set exactly.
    """
    vocab = probs.shape[-1]
    n = min(vocab, 256)
    while True:
        vals, idx = torch.topk(probs, n, dim=-1)  # [..., n]  descending
        if n == vocab:
            break
        above_c = torch.where(vals > vals[..., -1:], vals, 0.0).sum(-1)  # [...]
        if bool((above_c >= top_p).all()):  # host sync, once per try
            break
        n = min(vocab, 16 * n)
    # Order candidates by (probability desc, token id asc): sort by id, then a stable sort by value.
    idx, by_id = torch.sort(idx, dim=-1)  # [..., n]
    vals, by_val = torch.sort(vals.gather(-1, by_id), dim=-1, descending=True, stable=True)
    idx = idx.gather(-1, by_val)  # [..., n]  token ids in (p desc, id asc) order
    mass_before = F.pad(torch.cumsum(vals, dim=-1)[..., :-1], (1, 0))  # [..., n], exclusive
    in_set = mass_before < top_p  # [..., n]
    # The top token stays even when top_p underflows to 0 in float32 (a top_p of 5e-324 is valid).
    in_set[..., 0] = True
    kept = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    return ~kept.scatter_(-1, idx, in_set)


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The target distribution p_i for each position: float32 `[..., vocab]`, rows sum to 1.

    temperature == 0 (greedy) gives the point mass at argmax (first index among equal maxima), which
    top-k and top-p would keep anyway. Callers that only need the token use `argmax` directly.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        top = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    return torch.softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None,
           exponentials: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row: `probs [..., vocab]` (need not be normalised) -> tokens `[...]` (int64).

    With `exponentials` [..., vocab] (the request's position-keyed draws, `PositionDraws`): the exponential
    race argmax p(x) / E_x (zero-probability tokens never win). Else inverse-CDF sampling with one uniform
    per row from `generator`, so a fixed seed reproduces the draws:
    x = min{ j : F(j) > u * F(V) },  F = cumsum(p) in float64.
    Same law as torch.multinomial(probs, 1), which on CPU costs ~1 ms per 50k-vocab row (~20 ms
    for a 16-position block) against ~2 ms for the whole block here. Zero-probability tokens are
    never drawn: F only increases at tokens with p > 0, and u < 1 gives u * F(V) < F(V) in float64
    (the product of a double below 1 and F(V) rounds to at most the double just below F(V)).
    """
    if exponentials is not None:
        return (probs.float() / exponentials.to(probs.device)).argmax(dim=-1)
    cdf = torch.cumsum(probs.double(), dim=-1)  # [..., vocab]
    total = cdf[..., -1:]  # [..., 1]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    tokens = torch.searchsorted(cdf, u * total, right=True)  # [..., 1]
    return tokens.squeeze(-1)


# A logit bias at or below this bans its token (OpenAI's -100): the target gives it at most e^-100 of the row's
# best token's probability, so a draft of it is rejected, and the drafts after it are never verified.
BAN_BIAS = -100.0


def banned_tokens(logit_bias: list[tuple[int, float]]) -> frozenset[int]:
    """The tokens a request's `logit_bias` bans."""
    return frozenset(token for token, bias in logit_bias if bias <= BAN_BIAS)


def drafts_before_banned(tokens: list[int], banned: frozenset[int]) -> int:
    """How many of `tokens` come before the first banned one: the drafts worth verifying. Drafters cut their
    blocks there (speed only: verification would reject the banned draft anyway)."""
    if banned:
        for i, token in enumerate(tokens):
            if token in banned:
                return i
    return len(tokens)
