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

import numpy as np
import torch

from depthserve.archs.base import BuildOptions, StaticDecodeSpec
from depthserve.archs.itt.format import ITTPlan, ITTRecord, ITTSpec, knobs, pop_itt_weights, routed_slot_name
from depthserve.archs.itt.format import plan as itt_plan
from depthserve.archs.itt.format import report as itt_report
from depthserve.archs.llama.format import LlamaConfig
from depthserve.archs.llama.model import LlamaDecoderLayer, LlamaForCausalLM
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.kernels.itt import itt_blend, itt_select
from depthserve.layers.attention import decode_slot_meta
from depthserve.layers.batch import BatchItem, StepBatch


class StepRouting:
    """One step's routing: every packed row's thresholds, gathered once from the requests' plans,
    and the decisions, filled pass by pass by the ITT layers and copied into each sequence's
    ITTRecord once at the end of the step."""

    def __init__(self, step: StepBatch, num_layers: int, steps: int):
        plans = [item.plan for item in step.items]
        self.step_on = [any(plan.ratios[t] > 0 for plan in plans) for t in range(steps)]
        # [layers, T, items]; a range's level turns the steps past it off for the item's tokens
        per_item = np.stack([item.plan.step_thresholds(item.level) for item in step.items]).transpose(1, 2, 0)
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
            rows = slice(item.row, item.row + item.num_tokens)
            item.record.write(item.start, self.selected[rows], self.scores[rows])


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
        # Static decode (ITTForCausalLM.static_decode_spec): step t's routed slot columns and index.
        self.static_columns: list[slice] = []
        self.static_routed: list[int] = []

    def forward(self, x, cos, sin, pool, meta, columns, routing: StepRouting | list) -> torch.Tensor:
        if meta.static is not None:
            return self.static_forward(x, cos, sin, pool, meta, columns, routing)
        f = super().forward
        y = f(x, cos, sin, pool, meta, columns) * self.step_encoding[0].to(x.dtype)  # y = f(x) ⊙ phi_0
        step = meta.batch
        for t in range(1, self.spec.steps + 1):
            if not routing.step_on[t - 1]:
                continue  # rho_t = 0 for every request: no update for any token
            scores, slot_of_row, selected = meta.kernels.itt_route(y, self.router_weight[t - 1], self.router_bias[t - 1],
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
            meta.kernels.itt_update(y, out, slot_of_row, scores, self.step_encoding[t], self.spec.alphas[t - 1],
                           self.spec.skip_rule)
        return y

    def static_forward(self, x, cos, sin, pool, meta, columns, decisions: list) -> torch.Tensor:
        """The same for a decode step at static shapes: f_t runs on every row over the step-t routed
        slot and a row keeps it where it is selected (the update applied densely, as itt_update
        does); only selected rows store their key. Appends (selected, scores) [rows, T] to
        `decisions` (selected: 1, 0, -1 where the row's request has the step off)."""
        f = super().forward
        y = f(x, cos, sin, pool, meta, columns) * self.step_encoding[0].to(x.dtype)
        settings, T = meta.static.settings, self.spec.steps
        selections, all_scores = [], []
        cap = T if meta.static.level_cap is None else meta.static.level_cap
        for t in range(1, T + 1):
            if t > cap:  # the step is off for every row
                selections.append(torch.full_like(y[:, 0], -1, dtype=torch.int32))
                all_scores.append(torch.zeros_like(y[:, 0], dtype=torch.float32))
                continue
            thresholds = settings[:, self.position * T + t - 1]  # +inf: the step is off for the row
            routed = meta.static.routed_lens[:, self.static_routed[t - 1]]
            scores, selected, on = itt_select(y, self.router_weight[t - 1], self.router_bias[t - 1], thresholds)
            sub = decode_slot_meta(meta, self.static_columns[t - 1], stores=selected, context_lens=routed + 1)
            out = f(y, cos, sin, pool, sub, slice(None)).float()
            y = itt_blend(y.float(), out, selected, on & ~selected, scores, self.step_encoding[t],
                          self.spec.alphas[t - 1], self.spec.skip_rule).to(y.dtype)
            selections.append(torch.where(on, selected.to(torch.int32), -1))
            all_scores.append(torch.where(on, scores, 0.0))
        decisions.append((torch.stack(selections, 1), torch.stack(all_scores, 1)))
        return y


class ITTForCausalLM(LlamaForCausalLM):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: ITTSpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        for position, layer in enumerate(spec.layers):
            self.layers[layer] = ITTDecoderLayer(cfg, layer, spec, position)
        self._fp32: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        if meta.static is not None:
            return self.static_forward(input_ids, positions, pool, meta)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        routing = StepRouting(meta.batch, len(self.spec.layers), self.spec.steps)
        layout = self._base_plan.layout
        for i, layer in enumerate(self.layers):
            extra = (routing,) if isinstance(layer, ITTDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, layout.columns(i), *extra)
        routing.commit(meta.batch.items)
        return self.norm(x)

    def static_forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        """A decode step at static shapes; the routing decisions go to meta.static.decisions:
        selected [layers, T], then the fp32 scores' bits [layers, T]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        layout = self._base_plan.layout
        decisions: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            extra = (decisions,) if isinstance(layer, ITTDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, layout.columns(i), *extra)
        n = x.shape[0]
        selected = torch.stack([d[0] for d in decisions], 1).reshape(n, -1)
        scores = torch.stack([d[1] for d in decisions], 1).reshape(n, -1).contiguous().view(torch.int32)
        meta.static.decisions.copy_(torch.cat([selected, scores], dim=1))
        return self.norm(x)

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold every step's routed slot; a row's settings are its thresholds [layers, T] (+inf
        where its request has the step off)."""
        cfg, spec = self.config, self.spec
        routed = tuple(SlotSpec(routed_slot_name(layer, t), SlotKind.ROUTED, cfg.num_kv_heads)
                       for layer in spec.layers for t in range(1, spec.steps + 1))
        static = StaticDecodeSpec(CacheLayout(self._base_plan.layout.slots, routed),
                                  settings=len(spec.layers) * spec.steps, decisions=2 * len(spec.layers) * spec.steps,
                                  levels=tuple(range(spec.steps + 1)))
        columns = static.columns()
        order = {slot.name: i for i, slot in enumerate(routed)}
        for layer in self.itt_layers():
            names = [routed_slot_name(layer.index, t) for t in range(1, spec.steps + 1)]
            layer.static_columns = [columns[name] for name in names]
            layer.static_routed = [order[name] for name in names]
        return static

    def static_settings(self, plan: ITTPlan) -> np.ndarray:
        ratios = np.array(plan.ratios, dtype=np.float32)
        return np.where(ratios > 0, plan.thresholds, np.float32(np.inf)).astype(np.float32).reshape(-1)

    def static_level(self, plan: ITTPlan) -> int:
        """The last thinking step the request has on (ratio > 0); later steps are off for it."""
        return max((t + 1 for t, ratio in enumerate(plan.ratios) if ratio > 0), default=0)

    def after_static_step(self, record: ITTRecord, position: int, decisions: np.ndarray) -> dict[str, int]:
        L, T = len(self.spec.layers), self.spec.steps
        selected = decisions[: L * T].reshape(L, T)
        if (selected >= 0).any():  # as the eager step: nothing to record when every step is off
            record.write(position, selected[None].astype(np.int8), decisions[L * T :].view(np.float32).reshape(1, L, T))
        return {routed_slot_name(layer, t): int(selected[i, t - 1] == 1)
                for i, layer in enumerate(self.spec.layers) for t in range(1, T + 1)}

    def itt_layers(self) -> list[ITTDecoderLayer]:
        return [self.layers[layer] for layer in self.spec.layers]

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.spec)

    def plan(self, depth: DepthParams) -> ITTPlan:
        return itt_plan(self.config, self.spec, depth, [layer.quantiles for layer in self.itt_layers()])

    def new_record(self, plan: ITTPlan) -> ITTRecord:
        return ITTRecord(len(self.spec.layers), self.spec.steps)

    def report(self, seq) -> DepthReport:
        return itt_report(self.config, self.spec, seq.plan, seq.depth_record, seq.num_computed_tokens,
                      seq.num_prompt_tokens, len(seq.output_token_ids), seq.levels)

    # ---- weights -----------------------------------------------------------------------------------
    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        extras = pop_itt_weights(self.spec, weights, source, require_calibration=True)
        for layer in self.itt_layers():
            entry = extras[layer.index]
            self._fp32[layer.index] = (entry["router_w"].float().clone(), entry["phi"].float().clone())
            layer.router_bias = [float(b) for b in entry["router_b"].float()]
            layer.quantiles = entry["quantiles"].double().numpy()
        return set()

    def finish_load(self, device: torch.device) -> None:
        """Router weights and step encodings stay fp32 whatever dtype the model was cast to."""
        super().finish_load(device)
        for layer in self.itt_layers():
            router, phi = self._fp32[layer.index]
            layer.router_weight = router.to(device)
            layer.step_encoding = phi.to(device)


def build(hf_config: dict, spec: ITTSpec, options: BuildOptions) -> ITTForCausalLM:
    return ITTForCausalLM(LlamaConfig.from_hf(hf_config), spec, options.max_len)
