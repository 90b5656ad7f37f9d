"""Turns a batch of next-token logits into sampled tokens (plus their logprobs).

Per row, in this order:
  logit_bias -> repetition penalty (prompt + output) -> presence/frequency penalties (output)
  -> min_tokens ban of stop tokens -> greedy argmax, or: temperature -> min_p -> top_k -> top_p -> sample.

Sampling inverts the row's cumulative distribution at one uniform number per row (two levels:
float64 sums of 256-token chunks, then a float64 cumsum inside the chosen chunk, so tail tokens
keep their mass). A seeded row draws that number only from its own generator, exactly one per
step, so its tokens depend on nothing but its seed, its logits and its history, never on the batch
around it. Unseeded rows draw from the sampler's own generator (seeded with EngineArgs.seed).

Logprobs (`SampledToken.logprob`, `rank`, `top_logprobs`) always describe the distribution
log_softmax(logits) of the logits the sampler is given, before any penalty, bias or temperature:
the model's, or for a request with a structured-output constraint the model's masked to the tokens
the constraint allows (the runner masks before sampling). Tokens at -inf are never listed among
the top alternatives.

Non-finite scores never reach the arithmetic: NaN logits count as -inf (never sampled) and +inf
as the largest float, before and after temperature. A row left with no finite score (the model
produced NaN for it) gets a `SamplingFault` for that row alone; the other rows are sampled as
usual, so one bad sequence fails only its own request.

Large [B, V] temporaries are the main cost on CPU (each fresh one page-faults), so a Sampler keeps
one float32 scratch buffer of the largest batch seen and works in place in it. A Sampler is
therefore not safe to call from two threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from depthserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # seeded per sequence when params.seed is set; None: global RNG
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # under the raw distribution log_softmax(logits)
    rank: int  # 1 = most likely under the raw distribution; computed only when params.logprobs is set, else 0
    top_logprobs: list[tuple[int, float]]  # top params.logprobs (token, logprob), descending


@dataclass
class SamplingFault:
    """No token could be sampled for this row (no finite score left)."""

    reason: str


NO_FINITE_SCORE = "the model produced no finite next-token score for this sequence (NaN or -inf logits)"
_FLOAT_MAX = torch.finfo(torch.float32).max


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-sequence generator a SamplingRow wants: seeded when a seed is given, else None."""
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


# exp() of anything below this is a denormal (or zero) in fp32, which x86 CPUs compute about 20x
# slower: a [32, 49152] exp took 26 ms instead of 1.3 ms where the logits spread over more than 87
# (random-weight checkpoints do; SmolLM2's spread ~35). Flooring the shifted logits there before a
# sum of exps changes the sum by at most vocab * exp(-87) ~ 1e-33, far below fp32's resolution of
# a sum that is >= 1 (the peak's own term).
EXP_FLOOR = -87.0


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int, seed: int | None = None,
                 greedy_pick: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]] | None = None):
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        # (argmax, maximum, log-normalizer) of fp32 logits in one call (kernels/csrc/sampling.cpp), for
        # steps whose every row is greedy with nothing to apply; None: torch's reductions only.
        self.greedy_pick = greedy_pick
        # Unseeded rows draw from this sampler's own generator, never from torch's global one.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._work = torch.empty(0)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken | SamplingFault]:
        """logits [B, V] (one row per SamplingRow). Columns past vocab_size are never sampled.
        A row with no finite score gets a SamplingFault instead of a token."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
        logits = logits.float()[:, : self.vocab_size]
        picked = self._pick_greedy(logits, rows)
        if picked is not None:
            return picked
        logits, peak = finite_logits(logits)
        log_z = self._log_normalizer(logits, peak)  # before the scratch buffer is reused below
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        sampled_ok = torch.empty(len(rows), dtype=torch.bool, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            token_ids[greedy], sampled_ok[greedy] = self._greedy(logits, greedy, rows)
        if random:
            token_ids[random], sampled_ok[random] = self._random(logits, random, rows)
        tokens = self._with_logprobs(logits, log_z, token_ids, rows)
        return [token if ok else SamplingFault(NO_FINITE_SCORE) for token, ok in zip(tokens, sampled_ok.tolist())]

    def _pick_greedy(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken] | None:
        """The step through `greedy_pick` where it applies: every row greedy with no bias, penalty or
        ban to apply, fp32 CPU rows, every maximum finite (else None: the general path decides)."""
        if (self.greedy_pick is None or logits.device.type != "cpu" or logits.stride(1) != 1
                or not all(row.params.greedy and not self._needs_processing(row) for row in rows)):
            return None
        token_ids, peak, log_z = self.greedy_pick(logits, EXP_FLOOR)
        if not bool(torch.isfinite(peak).all()):
            return None
        return self._with_logprobs(logits, log_z, token_ids, rows)

    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """A copy of logits [B, V] after each row's logit_bias, penalties and min_tokens ban: what
        a greedy row takes the argmax of and what temperature then scales."""
        logits = logits.float()[:, : self.vocab_size]
        return self._processed(logits, list(range(len(rows))), rows).clone()

    # ---- scratch buffers -----------------------------------------------------------------------
    def _scratch(self, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        vocab = like.shape[1]
        if (self._work.device != like.device or self._work.dim() != 2 or self._work.shape[1] != vocab
                or self._work.shape[0] < num_rows):
            self._work = torch.empty(num_rows, vocab, dtype=torch.float32, device=like.device)
        return self._work[:num_rows]

    # ---- per-row logit processing ----------------------------------------------------------
    def _banned_ids(self, params: SamplingParams, num_output: int) -> list[int]:
        """Token ids that would stop the sequence before min_tokens; they are banned until then."""
        if num_output >= params.min_tokens:
            return []
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:  # with ignore_eos, eos does not stop, so it needs no ban
            banned |= self.eos_token_ids
        return sorted(t for t in banned if t < self.vocab_size)

    def picks_plainly(self, row: SamplingRow) -> bool:
        """A greedy row with no bias, penalty or ban to apply and no logprob ranks or alternatives
        asked for: `greedy_tokens` picks its token and logprob as this sampler would."""
        return row.params.greedy and row.params.logprobs is None and not self._needs_processing(row)

    def _needs_processing(self, row: SamplingRow) -> bool:
        p = row.params
        return bool(
            p.logit_bias
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or (p.min_tokens and len(row.output_token_ids) < p.min_tokens)
        )

    def _process_row(self, logits: torch.Tensor, row: SamplingRow) -> None:
        """Applies bias, penalties and the min_tokens ban in place to one row of logits [V]."""
        p = row.params
        device = logits.device
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < self.vocab_size]
            bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype, device=device)
            logits.index_add_(0, torch.tensor(ids, dtype=torch.long, device=device), bias)
        if p.repetition_penalty != 1.0:
            seen = _token_tensor(list(row.prompt_token_ids) + list(row.output_token_ids), device)
            apply_repetition_penalty(logits, torch.unique(seen), p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(row.output_token_ids):
            ids, counts = torch.unique(_token_tensor(row.output_token_ids, device), return_counts=True)
            apply_presence_frequency(logits, ids, counts, p.presence_penalty, p.frequency_penalty)
        banned = self._banned_ids(p, len(row.output_token_ids))
        if banned:
            logits[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")

    def _processed(self, logits: torch.Tensor, indices: list[int], rows: list[SamplingRow]) -> torch.Tensor:
        """logits[indices] copied into the scratch buffer, each row's bias/penalties/bans applied."""
        out = self._scratch(len(indices), logits)
        if len(indices) == logits.shape[0]:
            out.copy_(logits)
        else:
            index = torch.tensor(indices, dtype=torch.long, device=logits.device)
            torch.index_select(logits, 0, index, out=out)
        for j, i in enumerate(indices):
            if self._needs_processing(rows[i]):
                self._process_row(out[j], rows[i])
        return out

    # ---- greedy ----------------------------------------------------------------------------
    def _greedy(self, logits: torch.Tensor, indices: list[int],
                rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token per row, whether the row had a finite score to pick)."""
        if len(indices) == logits.shape[0] and not any(self._needs_processing(row) for row in rows):
            scores = logits
        else:
            scores = self._processed(logits, indices, rows)
        chosen = scores.argmax(dim=-1)  # argmax returns the first max
        return chosen, scores.gather(1, chosen.unsqueeze(1)).squeeze(1) > float("-inf")

    # ---- random ----------------------------------------------------------------------------
    def _random(self, logits: torch.Tensor, indices: list[int],
                rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token per row, whether the row had a finite score to pick)."""
        params = [rows[i].params for i in indices]
        device = logits.device
        probs = self._processed(logits, indices, rows)
        temperature = torch.tensor([p.temperature for p in params], dtype=probs.dtype, device=device)
        probs.div_(temperature.unsqueeze(1))
        _unnormalized_softmax_(probs)
        apply_min_p(probs, [p.min_p for p in params])
        apply_top_k(probs, [p.top_k for p in params])
        apply_top_p(probs, [p.top_p for p in params])
        uniforms = _uniforms([rows[i].generator for i in indices], self._generator, device)
        chosen = sample_inverse_cdf(probs, uniforms)
        return chosen, probs.gather(1, chosen.unsqueeze(1)).squeeze(1) > 0

    # ---- logprobs ----------------------------------------------------------------------------
    def _log_normalizer(self, logits: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
        """logsumexp over each row [B] given its maximum [B, 1], through the scratch buffer instead of a fresh [B, V]."""
        shifted = self._scratch(logits.shape[0], logits)
        torch.sub(logits, peak, out=shifted).clamp_(min=EXP_FLOOR).exp_()
        return shifted.sum(dim=-1).log_().add_(peak.squeeze(1))

    def _with_logprobs(self, logits: torch.Tensor, log_z: torch.Tensor, token_ids: torch.Tensor,
                       rows: list[SamplingRow]) -> list[SampledToken]:
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        logprobs = (chosen - log_z).tolist()
        ranks = [0] * len(rows)
        tops: dict[int, list[tuple[int, float]]] = {}
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if wanted:
            sub = logits if len(wanted) == len(rows) else logits[wanted]
            # Counted as float 0/1 in the scratch buffer: far cheaper than summing a bool tensor.
            above = torch.gt(sub, chosen[wanted].unsqueeze(1), out=self._scratch(len(wanted), sub))
            for i, r in zip(wanted, above.sum(dim=-1).tolist()):
                ranks[i] = int(r) + 1
            k = max(rows[i].params.logprobs for i in wanted)
            if k > 0:
                values, ids = sub.topk(min(k, sub.shape[1]), dim=-1)
                values = (values - log_z[wanted].unsqueeze(1)).tolist()
                ids = ids.tolist()
                for j, i in enumerate(wanted):
                    n = rows[i].params.logprobs
                    # A token that cannot be drawn (-inf: masked by a constraint) is no alternative.
                    tops[i] = [(t, v) for t, v in zip(ids[j][:n], values[j][:n]) if v != float("-inf")]
        return [
            SampledToken(token_id=t, logprob=logprobs[i], rank=ranks[i], top_logprobs=tops.get(i, []))
            for i, t in enumerate(token_ids.tolist())
        ]


# ---- building blocks (public so that they can be tested on their own) --------------------------
def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> None:
    """HF-style, in place on one row [V]: seen positive logits / penalty, seen negative ones * penalty."""
    values = logits[seen_ids]
    logits[seen_ids] = torch.where(values > 0, values / penalty, values * penalty)


def apply_presence_frequency(logits: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                             presence: float, frequency: float) -> None:
    """OpenAI-style, in place on one row [V]: logit -= presence * (count > 0) + frequency * count."""
    logits[ids] -= presence + frequency * counts.to(logits.dtype)


def apply_min_p(probs: torch.Tensor, min_p: list[float]) -> None:
    """In place on probs [R, V]: zero tokens whose prob < min_p * (max prob of the row)."""
    if not any(m > 0 for m in min_p):
        return
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)
    _zero_below(probs, probs.amax(dim=-1).mul_(scale))


def apply_top_k(probs: torch.Tensor, top_k: list[int]) -> None:
    """In place on probs [R, V]: keep each row's top_k most likely tokens (0: all; ties at the edge stay)."""
    vocab = probs.shape[1]
    picked = [j for j, k in enumerate(top_k) if 0 < k < vocab]
    if not picked:
        return
    sub = probs if len(picked) == probs.shape[0] else probs[picked]
    ks = torch.tensor([top_k[j] for j in picked], dtype=torch.long, device=probs.device)
    kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1)).squeeze(1)
    _zero_below(probs, _per_row(kth, picked, probs))


def apply_top_p(probs: torch.Tensor, top_p: list[float]) -> None:
    """In place on probs [R, V] (not necessarily normalized): keep the smallest set of most likely
    tokens whose mass reaches top_p of the row's total (ties at the edge stay); the most likely
    token always stays. No full sort: the nucleus edge is found among the top few tokens, or else
    from a histogram of the probabilities and an exact look at the one bin the edge falls in."""
    picked = [j for j, p in enumerate(top_p) if p < 1.0]
    if not picked:
        return
    sub = probs if len(picked) == probs.shape[0] else probs[picked]
    target = torch.tensor([top_p[j] for j in picked], dtype=sub.dtype, device=sub.device)
    target.mul_(_chunk_sums(sub).sum(dim=-1).to(sub.dtype))
    # Most rows of a language model: the nucleus lies within the top _TOP_P_FIRST_K tokens.
    k = min(_TOP_P_FIRST_K, sub.shape[1])
    values = sub.topk(k, dim=-1).values  # descending
    num_kept, cutoff = _nucleus_edge(values, torch.zeros_like(target), target)
    if k < sub.shape[1]:
        pending = (num_kept >= k).nonzero().squeeze(1)  # the edge lies beyond the top k
        if len(pending):
            cutoff[pending] = _top_p_cutoff_by_histogram(sub, target, pending)
    _zero_below(probs, _per_row(cutoff, picked, probs))


_TOP_P_FIRST_K = 64
# Histogram bins by float32 bit pattern: for p >= 0 the int32 view grows with p, so the top bits
# of (bits(max) - bits(p)) measure log2(max / p): 2**(23 - _BIN_SHIFT) bins per halving of p.
_BIN_SHIFT = 19  # 16 bins per factor of 2
_NUM_BINS = 64 * 16  # tokens more than 2**64 times less likely than the max share the last bin


def _nucleus_edge(values: torch.Tensor, mass_before_values: torch.Tensor,
                  target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, k] descending, preceded by mass_before_values [R] of larger tokens. A token stays
    while the mass before it is short of target. Returns (how many of values stay, the last one)."""
    mass_before = values.cumsum(dim=-1) - values + mass_before_values.unsqueeze(1)
    num_kept = (mass_before < target.unsqueeze(1)).sum(dim=-1)
    last_kept = values.gather(1, (num_kept.clamp(min=1) - 1).unsqueeze(1)).squeeze(1)
    return num_kept, last_kept


def _top_p_cutoff_by_histogram(probs: torch.Tensor, target: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The top-p cutoff of probs[rows] (>= 0 float32; targets target[rows]). Bins tokens by
    log2(max / p) (1/16 octave wide, read off the float bits), finds the bin where the cumulative
    mass reaches the target, and sorts only that bin's tokens. Works through _HISTOGRAM_ROWS rows
    at a time to keep temporaries small."""
    cutoffs = []
    for start in range(0, len(rows), _HISTOGRAM_ROWS):
        chunk = rows[start:start + _HISTOGRAM_ROWS]
        cutoffs.append(_histogram_cutoff(probs.index_select(0, chunk), target[chunk]))
    return torch.cat(cutoffs)


_HISTOGRAM_ROWS = 32


def _histogram_cutoff(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    bins = probs.view(torch.int32).to(torch.int64)
    torch.sub(bins.amax(dim=-1, keepdim=True), bins, out=bins)  # >= 0, grows as p falls
    bins.bitwise_right_shift_(_BIN_SHIFT).clamp_(max=_NUM_BINS - 1)
    mass = torch.zeros(probs.shape[0], _NUM_BINS, dtype=probs.dtype, device=probs.device)
    mass.scatter_add_(1, bins, probs)
    cumulative = mass.cumsum(dim=-1)
    edge_bin = (cumulative < target.unsqueeze(1)).sum(dim=-1).clamp_(max=_NUM_BINS - 1)
    previous = cumulative.gather(1, (edge_bin - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before_bin = torch.where(edge_bin > 0, previous, torch.zeros_like(target))
    members = bins == edge_bin.unsqueeze(1)
    del bins
    size = int(members.sum(dim=-1, dtype=torch.int32).max())
    values = torch.where(members, probs, 0.0).topk(size, dim=-1).values
    _, last_kept = _nucleus_edge(values, before_bin, target)
    return last_kept


_CDF_CHUNK = 256


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (non-negative, not necessarily normalized), uniforms [R] float64 in [0, 1).
    Returns per row the first token whose cumulative mass exceeds u * total, so a token of zero
    probability is never picked. Two levels in float64: chunk sums pick a chunk, then a cumsum
    inside that chunk picks the token; nothing of size [R, V] is allocated."""
    vocab = probs.shape[1]
    chunk = min(_CDF_CHUNK, vocab)
    sums = _chunk_sums(probs)
    value = uniforms.to(torch.float64).unsqueeze(1) * sums.sum(dim=-1, keepdim=True)
    chunk_index, residual = _invert(sums, value)
    offsets = torch.arange(chunk, device=probs.device)
    columns = chunk_index.unsqueeze(1) * chunk + offsets
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64)
    inside.masked_fill_(columns >= vocab, 0.0)
    # The same fraction of the chunk, measured against its float64 sum.
    chunk_sum = sums.gather(1, chunk_index.unsqueeze(1))
    position, _ = _invert(inside, residual / chunk_sum * inside.sum(dim=-1, keepdim=True))
    return chunk_index * chunk + position


def _chunk_sums(probs: torch.Tensor) -> torch.Tensor:
    """[R, ceil(V / _CDF_CHUNK)] float64 sums of consecutive chunks of each row. Summed in float32
    (a float64 sum would first copy the whole tensor) over many small chunks, so every row is
    reduced the same way whatever the batch around it."""
    num_rows, vocab = probs.shape
    chunk = min(_CDF_CHUNK, vocab)
    num_full = vocab // chunk
    sums = probs[:, : num_full * chunk].reshape(num_rows, num_full, chunk).sum(dim=-1)
    if num_full * chunk < vocab:
        sums = torch.cat([sums, probs[:, num_full * chunk:].sum(dim=-1, keepdim=True)], dim=1)
    return sums.to(torch.float64)


def _invert(weights: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [R, n] >= 0 float64, value [R, 1]. Returns per row the first index whose cumulative
    weight exceeds value (rounding past the end falls back to the last non-zero weight) and the
    value left inside that index, both [R] and [R, 1]."""
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    index = torch.searchsorted(cumulative, value.contiguous(), right=True)
    last_non_zero = torch.searchsorted(cumulative, total, right=False)
    index = torch.where(index < weights.shape[1], index, last_non_zero)
    before = torch.where(index > 0, cumulative.gather(1, (index - 1).clamp(min=0)), 0.0)
    return index.squeeze(1), value - before


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                    num_top: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """logits [n, V] at positions 0..n-1, target_ids [n] = the next prompt tokens.
    Returns per row (logprob of target, its rank (1 = best), top-num_top (token, logprob) descending)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = target_ids.to(device=logprobs.device, dtype=torch.long)
    target = logprobs.gather(1, target_ids.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > target.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    if num_top > 0:
        values, ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in range(logprobs.shape[0])]
    return list(zip(target.tolist(), ranks, tops))


# ---- helpers -------------------------------------------------------------------------------------
def greedy_tokens(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy picks of rows with nothing to apply, as `Sampler` makes them on its general path and
    with the same arithmetic, but without a host synchronisation, so a CUDA graph can hold it:
    (token [B], its logprob [B], whether the row had a finite score to pick [B])."""
    logits = logits.float()[:, :vocab_size]
    # finite_logits' replacement applied unconditionally: the identity where every score is finite or -inf
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    log_z = (logits - peak).clamp_(min=EXP_FLOOR).exp_().sum(dim=-1).log_().add_(peak.squeeze(1))
    chosen = logits.argmax(dim=-1)
    score = logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return chosen, score - log_z, score > float("-inf")


def finite_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with NaN as -inf (never sampled) and +inf as the largest float, each row's maximum
    [B, 1]); the same tensor when every entry is already finite or -inf. A row's maximum is NaN
    where the row holds a NaN and +inf where it holds a +inf, so the common case costs one pass."""
    peak = logits.amax(dim=-1, keepdim=True)
    if bool(torch.isfinite(peak).all()):
        return logits, peak
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))
    return logits, logits.amax(dim=-1, keepdim=True)


def _unnormalized_softmax_(x: torch.Tensor) -> None:
    """In place, row-wise exp(x - max): probabilities up to a per-row factor (the max becomes 1).
    Nothing downstream needs them normalized, so the row sum is never taken. x holds no NaN; a
    +inf (a huge logit over a small temperature) counts as the largest float, and a row that is
    all -inf becomes all zeros (nothing to sample) instead of NaN."""
    peak = x.amax(dim=-1, keepdim=True)
    if bool((peak == float("inf")).any()):
        x.clamp_(max=_FLOAT_MAX)
        peak = x.amax(dim=-1, keepdim=True)
    peak.masked_fill_(peak == float("-inf"), 0.0)
    x.sub_(peak).exp_()


def _zero_below(probs: torch.Tensor, threshold: torch.Tensor) -> None:
    """probs[r, v] = 0 where probs[r, v] < threshold[r] (float32 probs, threshold [R]).
    One fused in-place pass per row (F.threshold_ keeps x > t, so t is the float just below)."""
    below = torch.nextafter(threshold.to(probs.dtype), torch.tensor(float("-inf"), dtype=probs.dtype))
    for r, (t, edge) in enumerate(zip(threshold.tolist(), below.tolist())):
        if t > 0:
            F.threshold_(probs[r], edge, 0.0)


def _per_row(values: torch.Tensor, picked: list[int], probs: torch.Tensor) -> torch.Tensor:
    """A threshold per row of probs: values for the picked rows, 0 (drops nothing) elsewhere."""
    if len(picked) == probs.shape[0]:
        return values
    out = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    out[picked] = values
    return out


def _uniforms(generators: list[torch.Generator | None], shared: torch.Generator, device: torch.device) -> torch.Tensor:
    """One uniform per row in [0, 1): a seeded row draws its own from its generator, the others
    from the sampler's shared generator."""
    out = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [j for j, generator in enumerate(generators) if generator is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=shared)
    for j, generator in enumerate(generators):
        if generator is not None:
            out[j] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
    return out.to(device)


def _token_tensor(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(tokens), dtype=torch.long, device=device)
