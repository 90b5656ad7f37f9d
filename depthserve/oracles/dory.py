"""The references of a Dory checkpoint (docs/depth-semantics.md, "Public looped models: Dory").

At a fixed `loops`: transformers' DoryForCausalLM itself, in fp32, with `n_recurrent_loops` set to
the request's `loops`. With a schedule (one `loops` per token, section 6): `run_schedule`, a plain
float64 forward of the checkpoint's weights written from the contract (no cache, no paging), which
the tests first prove equal to transformers at constant schedules:

    x = embed(ids); prelude layers; p = N(x)
    pass t = 1..max(loops_n), over the tokens with loops_n >= t: x = recurrent layers over N(x) + p
    coda layers over every token's last pass; logits = (W_head N(x)) * logit_scale

What pass t of token n attends to at a recurrent layer (the window of a sliding layer counted in
positions, as everywhere):
- per_loop: the earlier tokens that ran pass t, at pass t, and itself;
- last_loop: the tokens of earlier forwards at their own last pass; the tokens of its own forward
  (itself included) at pass min(t, loops_m): the slot a token's last pass writes, read mid-forward.

With `recurrent_kv_cache_mode: "last_loop"` the result depends on how the tokens are split into
forwards, so both references feed the prompt in chunks of `prefill_chunk` tokens counted from its
first token, then every later token one at a time (transformers through its own cache), as the
engine does."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from depthserve.archs.dory.format import DoryConfig, read_config

L2_EPS = 1e-6


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, loops: int | None):
    from transformers import DoryForCausalLM

    kwargs = {} if loops is None else {"n_recurrent_loops": loops}
    return DoryForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _loops(depth: Any) -> int | None:
    if depth is None:
        return None
    value = depth.get("loops")  # a knob dict or DepthParams
    return None if value is None else int(value)


def forward_bounds(n: int, prompt_len: int | None, prefill_chunk: int | None) -> list[int]:
    """Where each forward of n tokens starts: the prompt in chunks of `prefill_chunk` from its first
    token, then one token per forward (None: one forward over everything)."""
    if prefill_chunk is None:
        return [0]
    prompt_len = n if prompt_len is None else prompt_len
    return list(range(0, prompt_len, prefill_chunk)) + list(range(prompt_len, n))


@torch.inference_mode()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, prompt_len: int | None = None,
            prefill_chunk: int | None = None, schedule: list | None = None,
            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits [n, vocab] of `token_ids` at the request's `loops` (default: the config's), by
    transformers; or with `schedule` (one knob setting per token) by `run_schedule` in `dtype`.

    `prompt_len` and `prefill_chunk` (last_loop mode): the first `prompt_len` tokens go in forwards
    of `prefill_chunk` tokens, the rest one token per forward. Unset: one forward over everything
    (per_loop mode gives the same logits however the tokens are split)."""
    if schedule is not None:
        if len(schedule) != len(token_ids):
            raise ValueError(f"a schedule needs one setting per token: {len(schedule)} for {len(token_ids)} tokens")
        weights = load_weights(str(model_dir), dtype)
        loops = [_setting_loops(weights.cfg, setting) for setting in schedule]
        return run_schedule(weights, token_ids, loops, forward_bounds(len(token_ids), prompt_len, prefill_chunk))
    model = hf_model(str(model_dir), _loops(depth))
    ids = torch.tensor([token_ids])
    if model.config.recurrent_kv_cache_mode != "last_loop" or prefill_chunk is None:
        return model(ids).logits[0].float()
    bounds = forward_bounds(len(token_ids), prompt_len, prefill_chunk)
    cache, logits = None, []
    for start, end in zip(bounds, bounds[1:] + [len(token_ids)]):
        out = model(ids[:, start:end], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0].float())
    return torch.cat(logits)


# ---- the schedule reference ------------------------------------------------------------------------
@dataclass(frozen=True)
class Weights:
    cfg: DoryConfig
    w: dict[str, torch.Tensor]  # transformers' parameter names, in the reference's dtype


@functools.lru_cache(maxsize=4)
def load_weights(model_dir: str, dtype: torch.dtype = torch.float64) -> Weights:
    """The checkpoint's tensors as transformers loads them (every spelling read by it), in `dtype`."""
    cfg = read_config(json.loads((Path(model_dir) / "config.json").read_text()))
    state = hf_model(model_dir, None).state_dict()
    return Weights(cfg, {name: tensor.detach().to(dtype) for name, tensor in state.items()})


def _setting_loops(cfg: DoryConfig, setting: Any) -> int:
    value = setting.get("loops", cfg.n_recurrent_loops)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= cfg.max_loops:
        raise ValueError(f"Dory loops must be an integer in 1..{cfg.max_loops}, got {value!r}")
    return value


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [n, heads, d] at `positions` (the half-split layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions.to(x.dtype)[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


# What a layer's attention reads, given the keys and values [n, kv heads, d] it just made for its
# queries: every key and value it sees and their positions.
KeySource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _own_keys(positions: torch.Tensor) -> KeySource:
    return lambda k, v: (k, v, positions)


def _layer(ref: Weights, i: int, x: torch.Tensor, positions: torch.Tensor, keys: KeySource) -> torch.Tensor:
    """Decoder layer i over rows x [n, hidden] at `positions` (the nGPT interpolations)."""
    cfg, w, p = ref.cfg, ref.w, f"model.layers.{i}."
    h = _norm(x)
    attention = _norm(_attention(ref, i, h, positions, keys))
    h = _norm(h + (w[p + "lambda_1"] * cfg.ngpt_alpha_init / cfg.initializer_range).abs() * (attention - h))
    gate = h @ w[p + "mlp.gate_proj.weight"].T * (w[p + "mlp.suv_gate"] * cfg.hidden_size**0.5)
    up = h @ w[p + "mlp.up_proj.weight"].T * (w[p + "mlp.suv_up"] * cfg.hidden_size**0.5)
    mlp = _norm(_norm(torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T)
    return h + (w[p + "lambda_2"] * cfg.ngpt_alpha_init / cfg.initializer_range).abs() * (mlp - h)


def _attention(ref: Weights, i: int, h: torch.Tensor, positions: torch.Tensor, keys: KeySource) -> torch.Tensor:
    cfg, w, p = ref.cfg, ref.w, f"model.layers.{i}.self_attn."
    n, d, theta = h.shape[0], cfg.head_dim, cfg.rope_thetas[cfg.layer_types[i]]
    q = _rotate(_norm((h @ w[p + "q_proj.weight"].T).view(n, cfg.num_heads, d)), positions, theta)
    k = _rotate(_norm((h @ w[p + "k_proj.weight"].T).view(n, cfg.num_kv_heads, d)), positions, theta)
    v = (h @ w[p + "v_proj.weight"].T).view(n, cfg.num_kv_heads, d)
    q = q * (w[p + "sqk"] * d**0.5 / cfg.initializer_range).view(cfg.num_heads, d).square()
    K, V, key_positions = keys(k, v)
    groups = cfg.num_heads // cfg.num_kv_heads
    K, V = K.repeat_interleave(groups, 1), V.repeat_interleave(groups, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, K) * d**-0.5
    visible = key_positions[None, :] <= positions[:, None]
    if (window := cfg.window(i)) is not None:
        visible &= key_positions[None, :] > positions[:, None] - window
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), V)
    out = out.reshape(n, -1) * torch.sigmoid(h @ w[p + "gate_proj.weight"].T
                                             * (w[p + "s_gate"] * cfg.hidden_size**0.25 / cfg.initializer_range).square())
    return _norm(out) @ w[p + "o_proj.weight"].T


def run_schedule(ref: Weights, token_ids: list[int], loops: list[int], bounds: list[int]) -> torch.Tensor:
    """Logits [n, vocab] with token n running `loops[n]` passes (module doc); `bounds`: where each
    forward starts (forward_bounds), which only the last_loop mode reads."""
    cfg, w = ref.cfg, ref.w
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    positions = torch.arange(len(token_ids))
    token_loops = torch.as_tensor(loops)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.n_input_layers):
        x = _layer(ref, i, x, positions, _own_keys(positions))
    if cfg.recurrent_kv_cache_mode == "last_loop":
        x = _last_loop_passes(ref, x, positions, token_loops, bounds)
    else:
        x = _per_loop_passes(ref, x, positions, token_loops)
    for i in cfg.output_layers:
        x = _layer(ref, i, x, positions, _own_keys(positions))
    logits = _norm(x) @ w["lm_head.weight"].T
    return (logits * (w["lm_head.logit_scale"] / cfg.initializer_range)).float()


def _per_loop_passes(ref: Weights, x: torch.Tensor, positions: torch.Tensor, loops: torch.Tensor) -> torch.Tensor:
    """Pass t over the tokens with loops >= t, attending over the same tokens (slot (t, l))."""
    prelude = _norm(x)
    for t in range(1, int(loops.max()) + 1):
        ran = (loops >= t).nonzero()[:, 0]
        xs, at = _norm(x[ran]) + prelude[ran], positions[ran]
        for i in ref.cfg.recurrent_layers:
            xs = _layer(ref, i, xs, at, _own_keys(at))
        x = x.index_copy(0, ran, xs)
    return x


def _last_loop_passes(ref: Weights, x: torch.Tensor, positions: torch.Tensor, loops: torch.Tensor,
                      bounds: list[int]) -> torch.Tensor:
    """Forward by forward: pass t of a token reads the earlier forwards' last-pass keys and its own
    forward's keys at pass min(t, loops_m) (module doc)."""
    cfg, n = ref.cfg, x.shape[0]
    shape = (n, cfg.num_kv_heads, cfg.head_dim)
    slots = {i: (x.new_zeros(shape), x.new_zeros(shape)) for i in cfg.recurrent_layers}  # the last pass's keys
    prelude, out = _norm(x), x.clone()
    for start, end in zip(bounds, bounds[1:] + [n]):
        own = torch.arange(start, end)
        for t in range(1, int(loops[start:end].max()) + 1):
            ran = own[loops[start:end] >= t]
            xs = _norm(out[ran]) + prelude[ran]
            for i in cfg.recurrent_layers:
                xs = _layer(ref, i, xs, positions[ran], _slot_writer(slots[i], ran, end))
            out = out.index_copy(0, ran, xs)
    return out


def _slot_writer(slot: tuple[torch.Tensor, torch.Tensor], ran: torch.Tensor, end: int) -> KeySource:
    """The rows `ran` write their keys into the layer's slot, then read positions 0..end-1 of it."""
    def keys(k: torch.Tensor, v: torch.Tensor):
        slot[0][ran], slot[1][ran] = k, v
        return slot[0][:end], slot[1][:end], torch.arange(end)
    return keys
