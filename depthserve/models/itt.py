"""ITT: token-routed thinking steps (depth-semantics.md section 2; paper 001, Eq. 4-7, Algorithm 1).

For an ITT layer with full layer function f (attention + MLP, both residuals):

    y = f(x) * phi_0                                   dense pass, the layer's base cache slot
    for t = 1..T with rho_t > 0:
        s = sigmoid(r_t . y + b_t)                     fp32
        selected iff s >= tau_t(rho_t)                 causal threshold from the calibration table
        selected: y <- y + alpha_t * s * f_t(y) * phi_t
        skipped:  y <- y + y * phi_t                   (skip rule "paper"; "identity": unchanged)

f_t is the same layer attending over the step-t routed cache slot, which holds only the tokens
selected at step t, at their true positions. It runs on the selected rows only: gather ->
layer -> scatter, never a masked dense pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from depthserve.depth import DepthParams, KnobSpec
from depthserve.engine.cache_spec import CacheLayout, SlotKind, SlotSpec
from depthserve.kernels import ops
from depthserve.layers.batch import BatchItem, StepBatch
from depthserve.loading.checkpoint import ITTSpec, pop_itt_weights, threshold
from depthserve.models.flops import attention_flops, layer_weight_flops, plain_flops
from depthserve.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


def routed_slot_name(layer: int, step: int) -> str:
    return f"itt{layer}.step{step}"


@dataclass(frozen=True)
class ITTPlan:
    """One request's ratios and thresholds, fixed for its lifetime."""

    ratios: tuple[float, ...]  # rho_1..rho_T after thinking_steps
    thresholds: np.ndarray  # [ITT layers, T] tau of (layer, step) (+inf: step off)
    layout: CacheLayout


class ITTRecord:
    """Per-position routing decisions of one sequence: 1 selected, 0 skipped, -1 off / unknown."""

    def __init__(self, num_layers: int, steps: int):
        self.selected = np.full((64, num_layers, steps), -1, dtype=np.int8)
        self.scores = np.zeros((64, num_layers, steps), dtype=np.float32)

    def write(self, start: int, selected: np.ndarray, scores: np.ndarray) -> None:
        """Decisions [n, layers, steps] for positions start..start+n."""
        end = start + len(selected)
        if end > len(self.selected):
            grow = max(end, 2 * len(self.selected))
            self.selected = np.concatenate([self.selected, np.full((grow - len(self.selected),) + self.selected.shape[1:],
                                                                   -1, np.int8)])
            self.scores = np.concatenate([self.scores, np.zeros((grow - len(self.scores),) + self.scores.shape[1:],
                                                                np.float32)])
        self.selected[start:end] = selected
        self.scores[start:end] = scores


class StepRouting:
    """One step's routing: every packed row's thresholds, gathered once from the requests' plans,
    and the decisions, filled pass by pass by the ITT layers and copied into each sequence's
    ITTRecord once at the end of the step."""

    def __init__(self, step: StepBatch, num_layers: int, steps: int):
        plans = [item.plan for item in step.items]
        self.step_on = [any(plan.ratios[t] > 0 for plan in plans) for t in range(steps)]
        per_item = np.stack([plan.thresholds for plan in plans]).transpose(1, 2, 0)  # [layers, T, items]
        rows = np.repeat(per_item, [item.num_tokens for item in step.items], axis=2)
        self.thresholds = torch.from_numpy(np.ascontiguousarray(rows)).to(step.device)  # [layers, T, rows]
        self.num_layers, self.steps = num_layers, steps
        self.selected = np.full((step.num_rows, num_layers, steps), -1, dtype=np.int8)
        self.scores = np.zeros((step.num_rows, num_layers, steps), dtype=np.float32)

    def record(self, position: int, t: int, slot_of_row: torch.Tensor, scores: torch.Tensor) -> None:
        """slot_of_row from itt_route: >= 0 selected, -1 skipped, -2 step off for the row's request."""
        slots = slot_of_row.cpu().numpy()
        on = slots > -2
        self.selected[:, position, t - 1] = np.where(on, slots >= 0, -1)
        self.scores[:, position, t - 1] = np.where(on, scores.cpu().numpy(), 0.0)

    def commit(self, items: list[BatchItem]) -> None:
        for item in items:
            if not any(r > 0 for r in item.plan.ratios):
                continue  # every step off: nothing routed, nothing to record
            record = item.seq.state.get("itt_record")
            if record is None:
                record = item.seq.state["itt_record"] = ITTRecord(self.num_layers, self.steps)
            rows = slice(item.row, item.row + item.num_tokens)
            record.write(item.start, self.selected[rows], self.scores[rows])


class ITTDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: LlamaConfig, index: int, spec: ITTSpec, position: int):
        super().__init__(cfg, index)
        self.spec = spec
        self.position = position  # index among the ITT layers
        T, d = spec.steps, cfg.hidden_size
        # Router scores and the update run in fp32 whatever the model dtype (kept fp32 by the model).
        self.register_buffer("router_weight", torch.zeros(T, d), persistent=False)  # r_1..r_T
        self.router_bias: list[float] = [0.0] * T  # b_1..b_T
        self.register_buffer("step_encoding", torch.zeros(T + 1, d), persistent=False)  # phi_0..phi_T
        self.quantiles: np.ndarray | None = None  # [T, 101] calibration table

    def forward(self, x, cos, sin, pool, meta, columns, routing: StepRouting) -> torch.Tensor:
        f = super().forward
        y = f(x, cos, sin, pool, meta, columns) * self.step_encoding[0].to(x.dtype)  # y = f(x) ⊙ phi_0
        step = meta.batch
        for t in range(1, self.spec.steps + 1):
            if not routing.step_on[t - 1]:
                continue  # rho_t = 0 for every request: no update for any token
            scores, slot_of_row, selected = ops.itt_route(y, self.router_weight[t - 1], self.router_bias[t - 1],
                                                          routing.thresholds[self.position, t - 1])
            name = routed_slot_name(self.index, t)
            sub_meta = step.routed_meta(name, selected.cpu().numpy())
            if len(selected):
                # f_t on the selected rows only, attending over the step-t routed slot.
                out = f(y.index_select(0, selected), cos.index_select(0, selected), sin.index_select(0, selected),
                        pool, sub_meta, slice(None))
            else:
                out = y.new_zeros((0, y.shape[1]))
            routing.record(self.position, t, slot_of_row, scores)
            ops.itt_update(y, out, slot_of_row, scores, self.step_encoding[t], self.spec.alphas[t - 1],
                           self.spec.skip_rule)
        return y


class ITTForCausalLM(LlamaForCausalLM):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: ITTSpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        for position, layer in enumerate(spec.layers):
            self.layers[layer] = ITTDecoderLayer(cfg, layer, spec, position)
        self.checkpoint_path = "this checkpoint"
        self._fp32: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        routing = StepRouting(meta.batch, len(self.spec.layers), self.spec.steps)
        for i, layer in enumerate(self.layers):
            extra = (routing,) if isinstance(layer, ITTDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, self._layout.columns(i), *extra)
        routing.commit(meta.batch.items)
        return self.norm(x)

    def itt_layers(self) -> list[ITTDecoderLayer]:
        return [self.layers[layer] for layer in self.spec.layers]

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        T = self.spec.steps
        return {
            "selection_ratios": KnobSpec(
                "selection_ratios",
                f"fraction of tokens routed to each of the {T} extra steps (trained: {list(self.spec.trained_ratios)})",
                0.0, 1.0, list(self.spec.trained_ratios), kind="ratio_list", length=T,
            ),
            "thinking_steps": KnobSpec(
                "thinking_steps",
                f"number of extra steps enabled; the checkpoint has parameters for {T}, no more",
                0, T, T,
            ),
        }

    def plan_depth(self, depth: DepthParams) -> ITTPlan:
        depth = depth.normalized(self.depth_knobs())
        ratios = list(depth.selection_ratios if depth.selection_ratios is not None else self.spec.trained_ratios)
        if depth.thinking_steps is not None:
            ratios = [r if t < depth.thinking_steps else 0.0 for t, r in enumerate(ratios)]
        thresholds = np.array([[threshold(layer.quantiles[t], ratios[t]) for t in range(self.spec.steps)]
                               for layer in self.itt_layers()], dtype=np.float32)
        kv = self.config.num_kv_heads
        dense = tuple(SlotSpec(f"layer{i}", SlotKind.DENSE, kv) for i in range(self.config.num_layers))
        routed = tuple(SlotSpec(routed_slot_name(layer, t), SlotKind.ROUTED, kv)
                       for layer in self.spec.layers for t in range(1, self.spec.steps + 1) if ratios[t - 1] > 0)
        return ITTPlan(tuple(ratios), thresholds, CacheLayout(dense, routed))

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        return self.plan_depth(depth).layout

    def depth_report(self, seq) -> dict:
        plan: ITTPlan = seq.state["depth_plan"]
        record: ITTRecord | None = seq.state.get("itt_record")
        tokens = seq.num_computed_tokens
        prompt = min(seq.num_prompt_tokens, tokens)
        cfg = self.config
        T = self.spec.steps
        selected, prompt_frac, decode_frac = {}, {}, {}
        extra = 0.0
        for position, layer in enumerate(self.spec.layers):
            for t in range(1, T + 1):
                if plan.ratios[t - 1] <= 0:
                    continue  # step off: no routing, no update, nothing to report
                key = f"{layer}:{t}"
                flags = record.selected[:tokens, position, t - 1] == 1 if record is not None else np.zeros(tokens, bool)
                n = int(flags.sum())
                selected[key] = n
                prompt_frac[key] = float(flags[:prompt].mean()) if prompt else None
                decode_frac[key] = float(flags[prompt:].mean()) if tokens > prompt else None
                # f_t on n tokens (the j-th selected attends to j keys) plus the router on every token.
                extra += n * layer_weight_flops(cfg) + attention_flops(cfg.num_heads, cfg.head_dim, n * (n + 1) / 2)
                extra += tokens * 2 * cfg.hidden_size
        base = plain_flops(cfg, tokens, len(seq.output_token_ids))
        return {
            "architecture": "itt",
            "selection_ratios": list(plan.ratios),
            "tokens": tokens,
            "selected_tokens": selected,  # "layer:step" -> tokens selected (enabled steps only)
            "prompt_selected_fraction": prompt_frac,
            "decode_selected_fraction": decode_frac,
            "flops": base + extra,  # this request's FLOPs (depthserve/models/flops.py)
            "plain_flops": base,  # the plain model's FLOPs on the same tokens
            "relative_compute": (base + extra) / base if base else 1.0,
        }

    def routing_record(self, seq) -> dict[tuple[int, int], np.ndarray] | None:
        """(layer, step) -> per-position decisions (1 / 0 / -1 off) over the computed tokens."""
        record: ITTRecord | None = seq.state.get("itt_record")
        plan: ITTPlan = seq.state["depth_plan"]
        out = {}
        for position, layer in enumerate(self.spec.layers):
            for t in range(1, self.spec.steps + 1):
                if plan.ratios[t - 1] > 0 and record is not None:
                    out[(layer, t)] = record.selected[: seq.num_computed_tokens, position, t - 1].copy()
        return out

    # ---- weights -----------------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        extras = pop_itt_weights(self.spec, weights, self.checkpoint_path, require_calibration=True)
        super().load_hf_state_dict(weights)
        for layer in self.itt_layers():
            entry = extras[layer.index]
            self._fp32[layer.index] = (entry["router_w"].float().clone(), entry["phi"].float().clone())
            layer.router_bias = [float(b) for b in entry["router_b"].float()]
            layer.quantiles = entry["quantiles"].double().numpy()
        self.finish_load(torch.device("cpu"))

    def finish_load(self, device: torch.device) -> None:
        """Router weights and step encodings stay fp32 whatever dtype the model was cast to."""
        for layer in self.itt_layers():
            router, phi = self._fp32[layer.index]
            layer.router_weight = router.to(device)
            layer.step_encoding = phi.to(device)
