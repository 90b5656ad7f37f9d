"""Turns a batch of next-token logits into sampled tokens (plus their logprobs).

Per row, in this order:
  logit_bias -> repetition penalty (prompt + output) -> presence/frequency penalties (output)
  -> min_tokens ban of stop tokens -> greedy argmax, or: temperature -> min_p -> top_k -> top_p -> sample.

Sampling inverts the row's cumulative distribution (float64 cumsum, so tail tokens keep their
mass) at one uniform number per row. A seeded row draws that number only from its own generator,
exactly one per step, so its tokens depend on nothing but its seed, its logits and its history,
never on the batch around it. Unseeded rows use the global torch RNG.

Logprobs (`SampledToken.logprob`, `rank`, `top_logprobs`) always describe the raw model
distribution log_softmax(logits), before any penalty, bias or temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    rank: int  # 1 = most likely under the raw distribution; only computed when params.logprobs is set, else 0
    top_logprobs: list[tuple[int, float]]  # top params.logprobs (token, logprob), descending


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-sequence generator a SamplingRow wants: seeded when a seed is given, else None."""
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int):
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.shape[1] > self.vocab_size:  # padded vocabulary columns are never sampled
            logits = logits[:, : self.vocab_size]
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            token_ids[greedy] = self._greedy(logits, greedy, rows)
        if random:
            token_ids[random] = self._random(logits, random, rows)
        return self._with_logprobs(logits, token_ids, rows)

    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """A copy of logits [B, V] after each row's logit_bias, penalties and min_tokens ban: what
        a greedy row takes the argmax of and what temperature then scales."""
        return self._processed(logits.float()[:, : self.vocab_size], list(range(len(rows))), rows)

    # ---- per-row logit processing ----------------------------------------------------------
    def _banned_ids(self, params: SamplingParams, num_output: int) -> list[int]:
        """Token ids that would stop the sequence before min_tokens; they are banned until then."""
        if num_output >= params.min_tokens:
            return []
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:  # with ignore_eos, eos does not stop, so it needs no ban
            banned |= self.eos_token_ids
        return sorted(t for t in banned if t < self.vocab_size)

    def _needs_processing(self, row: SamplingRow) -> bool:
        p = row.params
        return bool(
            p.logit_bias
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or self._banned_ids(p, len(row.output_token_ids))
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
        """A fresh copy of logits[indices] with each row's bias/penalties/bans applied."""
        out = logits.clone() if len(indices) == logits.shape[0] else logits[indices]
        for j, i in enumerate(indices):
            if self._needs_processing(rows[i]):
                self._process_row(out[j], rows[i])
        return out

    # ---- greedy ----------------------------------------------------------------------------
    def _greedy(self, logits: torch.Tensor, indices: list[int], rows: list[SamplingRow]) -> torch.Tensor:
        if not any(self._needs_processing(rows[i]) for i in indices):
            if len(indices) == logits.shape[0]:
                return logits.argmax(dim=-1)
            return logits[indices].argmax(dim=-1)
        return self._processed(logits, indices, rows).argmax(dim=-1)  # argmax returns the first max

    # ---- random ----------------------------------------------------------------------------
    def _random(self, logits: torch.Tensor, indices: list[int], rows: list[SamplingRow]) -> torch.Tensor:
        params = [rows[i].params for i in indices]
        device = logits.device
        probs = self._processed(logits, indices, rows)
        temperature = torch.tensor([p.temperature for p in params], dtype=probs.dtype, device=device)
        probs.div_(temperature.unsqueeze(1))
        _unnormalized_softmax_(probs)
        apply_min_p(probs, [p.min_p for p in params])
        apply_top_k(probs, [p.top_k for p in params])
        apply_top_p(probs, [p.top_p for p in params])
        uniforms = _uniforms([rows[i].generator for i in indices], device)
        return sample_inverse_cdf(probs, uniforms)

    # ---- logprobs ----------------------------------------------------------------------------
    def _with_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                       rows: list[SamplingRow]) -> list[SampledToken]:
        log_z = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        logprobs = (chosen - log_z).tolist()
        ranks = [0] * len(rows)
        tops: dict[int, list[tuple[int, float]]] = {}
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if wanted:
            sub = _rows(logits, wanted)
            sub_chosen = chosen[wanted].unsqueeze(1)
            for i, r in zip(wanted, (torch.gt(sub, sub_chosen).sum(dim=-1, dtype=torch.int32) + 1).tolist()):
                ranks[i] = r
            k = max(rows[i].params.logprobs for i in wanted)
            if k > 0:
                values, ids = sub.topk(min(k, sub.shape[1]), dim=-1)
                values = (values - log_z[wanted].unsqueeze(1)).tolist()
                ids = ids.tolist()
                for j, i in enumerate(wanted):
                    n = rows[i].params.logprobs
                    tops[i] = list(zip(ids[j][:n], values[j][:n]))
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
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    threshold = probs.amax(dim=-1, keepdim=True) * scale
    probs.masked_fill_(probs < threshold, 0.0)


def apply_top_k(probs: torch.Tensor, top_k: list[int]) -> None:
    """In place on probs [R, V]: keep each row's top_k most likely tokens (0: all; ties at the edge stay)."""
    vocab = probs.shape[1]
    picked = [j for j, k in enumerate(top_k) if 0 < k < vocab]
    if not picked:
        return
    sub = _rows(probs, picked)
    ks = torch.tensor([top_k[j] for j in picked], dtype=torch.long, device=probs.device)
    kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    sub.masked_fill_(sub < kth, 0.0)
    _write_rows(probs, picked, sub)


def apply_top_p(probs: torch.Tensor, top_p: list[float]) -> None:
    """In place on probs [R, V] (not necessarily normalized): keep the smallest set of most likely
    tokens whose mass reaches top_p of the row's total (ties at the edge stay); the most likely
    token always stays. Looks at a growing top-k window instead of sorting the whole vocabulary."""
    picked = [j for j, p in enumerate(top_p) if p < 1.0]
    if not picked:
        return
    sub = _rows(probs, picked)
    vocab = sub.shape[1]
    target = torch.tensor([top_p[j] for j in picked], dtype=sub.dtype, device=sub.device)
    target.mul_(sub.sum(dim=-1))
    cutoff = torch.zeros(len(picked), dtype=sub.dtype, device=sub.device)
    pending = torch.arange(len(picked), device=sub.device)
    k = min(64, vocab)
    while len(pending):
        values = sub[pending].topk(k, dim=-1).values  # descending
        cumulative = values.cumsum(dim=-1)
        # Token j stays while the mass of the tokens before it is still short of the target.
        num_kept = ((cumulative - values) < target[pending].unsqueeze(1)).sum(dim=-1)
        done = (num_kept < k) | (cumulative[:, -1] >= target[pending]) | (k == vocab)
        last_kept = values.gather(1, (num_kept.clamp(min=1) - 1).unsqueeze(1)).squeeze(1)
        cutoff[pending[done]] = last_kept[done]
        pending = pending[~done]
        k = min(k * 8, vocab)
    sub.masked_fill_(sub < cutoff.unsqueeze(1), 0.0)
    _write_rows(probs, picked, sub)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (non-negative, not necessarily normalized), uniforms [R] float64 in [0, 1).
    Returns per row the first token whose float64 cumulative mass exceeds u * total, so a token
    of zero probability is never picked. Consumes probs."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    del probs
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    # u * total can round up to total: then take the last token of non-zero probability.
    last = torch.searchsorted(cdf, total.contiguous(), right=False)
    return torch.where(picked < cdf.shape[1], picked, last).squeeze(1)


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
def _unnormalized_softmax_(x: torch.Tensor) -> None:
    """In place, row-wise exp(x - max): probabilities up to a per-row factor (the max becomes 1).
    Nothing downstream needs them normalized, so the row sum is never taken."""
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform per row in [0, 1): a seeded row draws its own from its generator, the others
    from the global RNG."""
    out = torch.rand(len(generators), dtype=torch.float64)
    for j, generator in enumerate(generators):
        if generator is not None:
            out[j] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
    return out.to(device)


def _token_tensor(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(tokens), dtype=torch.long, device=device)


def _rows(x: torch.Tensor, picked: list[int]) -> torch.Tensor:
    """x itself when every row is picked, else a copy of the picked rows."""
    return x if len(picked) == x.shape[0] else x[picked]


def _write_rows(x: torch.Tensor, picked: list[int], sub: torch.Tensor) -> None:
    if sub is not x:
        x[picked] = sub
