"""The decode anchor: a minimal Llama decoder with a static KV cache, compiled, as gpt-fast writes it.

bench/throughput.py --anchor times it beside the engine: the speed a plain PyTorch model of the
same shape and weights reaches when nothing is paged, batched continuously or depth-aware, so
that the engine's gap to it is what those features cost. The model is written plainly: one fused
qkv and one fused gate/up projection per layer, K/V in preallocated buffers [layers, batch, KV
heads, max_len, head dim] written at the step's positions, attention through SDPA over the whole
buffer with a causal mask, greedy argmax on the device. On CUDA the one-token step runs through
`torch.compile(mode="reduce-overhead", fullgraph=True)` (inductor plus CUDA graphs); prefill runs
eagerly (the anchor is for decode). Weights come from transformers' model of the checkpoint.

The anchor is for GPUs: on CPU its compiled step is slower than its own eager one (SmolLM2-135M,
fp32, 2 cores, 32 sequences, 2026-11-25: 375 against 167 ms a step), so it anchors nothing there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AnchorLayer(nn.Module):
    """One decoder layer's weights as buffers (shared with transformers' model, not copied: buffers
    are static inputs to the compiled step, which CUDA graphs never copy)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.register_buffer("norm1", layer.input_layernorm.weight.detach())
        self.register_buffer("qkv", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach())
        self.register_buffer("o", attn.o_proj.weight.detach())
        self.register_buffer("norm2", layer.post_attention_layernorm.weight.detach())
        self.register_buffer("gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())
        self.register_buffer("down", mlp.down_proj.weight.detach())


class AnchorLlama(nn.Module):
    """A Llama decoder (SmolLM2's layout: RMSNorm, rotary, GQA, SwiGLU, tied or separate LM head)
    over a static KV cache for `max_batch` sequences of `max_len` positions."""

    def __init__(self, hf_model: nn.Module, max_batch: int, max_len: int):
        super().__init__()
        config, body = hf_model.config, hf_model.model
        weight = body.embed_tokens.weight
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.register_buffer("embed", weight.detach())
        self.register_buffer("lm_head", hf_model.lm_head.weight.detach())
        self.register_buffer("norm", body.norm.weight.detach())
        self.layers = nn.ModuleList(AnchorLayer(layer) for layer in body.layers)
        shape = (len(self.layers), max_batch, self.kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        positions = torch.arange(max_len, device=weight.device)
        cos, sin = body.rotary_emb(weight[:1], positions[None])  # transformers' own tables: [1, max_len, head_dim]
        self.register_buffer("cos", cos[0].to(weight.dtype))
        self.register_buffer("sin", sin[0].to(weight.dtype))
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool, device=weight.device).tril())
        self.register_buffer("positions", positions)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * weight

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [batch, len(pos), vocab] of tokens `ids` [batch, len(pos)] at positions `pos`."""
        batch, length = ids.shape
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = self.causal[pos][None, None]  # [1, 1, len, max_len]: keys up to each query
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.norm1)
            q, k, v = F.linear(h, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rotate(q.view(batch, length, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = self._rotate(k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            keys, values = self.k_cache[i, :batch], self.v_cache[i, :batch]
            keys.index_copy_(2, pos, k)
            values.index_copy_(2, pos, v)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(attended.transpose(1, 2).reshape(batch, length, q_size), layer.o)
            gate, up = F.linear(self._rms(x, layer.norm2), layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(self._rms(x, self.norm), self.lm_head)


class AnchorGenerator:
    """Greedy generation with the anchor: eager prefill, then one compiled step per token."""

    def __init__(self, hf_model: nn.Module, max_batch: int, max_len: int, compile_decode: bool):
        self.model = AnchorLlama(hf_model, max_batch, max_len)
        self.cuda = self.model.embed.is_cuda
        step = self.model.forward
        if compile_decode:
            step = torch.compile(step, mode="reduce-overhead" if self.cuda else None, fullgraph=True)
        self.step = step

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        """[batch, new_tokens] greedy token ids."""
        ids = torch.tensor(prompts, device=self.model.embed.device)
        length = ids.shape[1]
        token = self.model(ids, self.model.positions[:length])[:, -1].argmax(-1)
        out = [token]
        for i in range(new_tokens - 1):
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are consumed
            # A fresh position tensor each step, as gpt-fast passes it: a view into a buffer at a moving
            # offset would look like a static input whose address changes to the CUDA-graph trees.
            position = self.model.positions[length + i : length + i + 1].clone()
            logits = self.step(token[:, None], position)
            token = logits[:, -1].argmax(-1)
            out.append(token)
        return torch.stack(out, dim=1)
