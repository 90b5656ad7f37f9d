"""ITT: token-routed thinking steps (docs/depth-semantics.md section 2; paper 001, Eq. 4-7, Algorithm 1).

For an ITT layer with full layer function f (attention + MLP, both residuals):

    y = f(x) * phi_0                                   dense pass, the layer's base cache slot
    for t = 1..T with rho_t > 0:
        s = sigmoid(r_t . y + b_t)                     fp32
        selected iff s >= tau_t(rho_t)                 causal threshold from the calibration table
        selected: y <- y + alpha_t * s * f_t(y) * phi_t
        skipped:  y <- y + y * phi_t                   (skip rule "paper"; "identity": unchanged)

f_t is the same layer attending over the step-t routed cache slot, which holds only the tokens
selected at step t, at their true positions. An eager step runs it on the selected rows only
(gather -> layer -> scatter); the static decode step on every row, keeping it where selected
(layers/rows.py: one loop, either way).
"""

from __future__ import annotations

import numpy as np
import torch

from depthserve.archs.base import BuildOptions, RequestState, StaticDecodeSpec
from depthserve.archs.itt.format import ITTPlan, ITTRecord, ITTSpec, knobs, pop_itt_weights, routed_slot_name
from depthserve.archs.itt.format import plan as itt_plan
from depthserve.archs.itt.format import report as itt_report
from depthserve.archs.llama.format import LlamaConfig
from depthserve.archs.llama.model import LlamaDecoderLayer, LlamaForCausalLM
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.kernels import itt as itt_ops
from depthserve.layers.rows import StepRows, step_rows


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

    def forward(self, x, cos, sin, pool, meta, columns, rows: StepRows,
                decisions: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Appends each step's (selected, scores) [step rows] to `decisions` (selected: 1, 0, or -1
        where the row's request has the step off; scores 0 there)."""
        f = super().forward
        y = f(x, cos, sin, pool, meta, columns) * self.step_encoding[0].to(x.dtype)  # y = f(x) ⊙ phi_0
        T = self.spec.steps
        off = (torch.full_like(y[:, 0], -1, dtype=torch.int32), torch.zeros_like(y[:, 0], dtype=torch.float32))
        for t in range(1, T + 1):
            setting = self.position * T + t - 1  # the row's threshold tau_t; +inf: the step is off for it
            if t > rows.cap(T) or not rows.any_below(setting, float("inf")):
                decisions.append(off)  # rho_t = 0 for every request: no update for any token
                continue
            scores, selected, on = itt_ops.itt_select(y, self.router_weight[t - 1], self.router_bias[t - 1],
                                                      rows.setting_tensor(setting))
            level = rows.where(selected)
            out = y.new_zeros((0, y.shape[1]))
            if not level.empty:  # f_t on the selected rows, attending over the step-t routed slot
                sub_meta, sub_columns = level.attend(routed_slot_name(self.index, t))
                out = f(level.take(y), level.take(cos), level.take(sin), pool, sub_meta, sub_columns)
            y = itt_ops.itt_blend(y.float(), level.spread(out, 0.0).float(), selected, on & ~selected, scores,
                                  self.step_encoding[t], self.spec.alphas[t - 1], self.spec.skip_rule).to(y.dtype)
            decisions.append((torch.where(on, selected.to(torch.int32), -1), torch.where(on, scores, 0.0)))
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
        """The Llama stack with each ITT layer's thinking steps; the routing decisions of every row:
        selected [ITT layers, T], then the fp32 scores' bits [ITT layers, T]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        rows = step_rows(meta)
        layout = self._base_plan.layout
        decisions: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            extra = (rows, decisions) if isinstance(layer, ITTDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, layout.columns(i), *extra)
        n = x.shape[0]
        selected = torch.stack([d[0] for d in decisions], 1).reshape(n, -1)
        scores = torch.stack([d[1] for d in decisions], 1).reshape(n, -1).contiguous().view(torch.int32)
        rows.emit(torch.cat([selected, scores], dim=1))
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
        return static

    def row_settings(self, plan: ITTPlan, level: int | None) -> np.ndarray:
        """The thresholds [ITT layers, T] (+inf where the step is off for the request's tokens)."""
        return plan.step_thresholds(level).astype(np.float32).reshape(-1)

    def static_level(self, plan: ITTPlan) -> int:
        """The last thinking step the request has on (ratio > 0); later steps are off for it."""
        return max((t + 1 for t, ratio in enumerate(plan.ratios) if ratio > 0), default=0)

    def record_decisions(self, record: ITTRecord, start: int, decisions: np.ndarray) -> dict[str, int]:
        L, T = len(self.spec.layers), self.spec.steps
        n = len(decisions)
        selected = decisions[:, : L * T].reshape(n, L, T)
        if (selected >= 0).any():  # nothing to record when every step is off (the record's default)
            record.write(start, selected.astype(np.int8),
                         np.ascontiguousarray(decisions[:, L * T:]).view(np.float32).reshape(n, L, T))
        return {routed_slot_name(layer, t): int((selected[:, i, t - 1] == 1).sum())
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

    def report(self, request: RequestState) -> DepthReport:
        return itt_report(self.config, self.spec, request.plan, request.record, request.num_computed_tokens,
                          request.num_prompt_tokens, request.num_output_tokens, request.levels)

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
