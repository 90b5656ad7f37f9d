"""A seventh architecture, defined entirely in this file and registered with one call, is served by
the engine like the built-in ones: mixed per-request depths in one batch, chunked prefill,
forced preemption and prefix-cache hits, every logprob equal to the toy's own full-sequence
reference; and over HTTP, its knob (a name no built-in architecture has) in /v1/models, the API
schema and requests. Nothing outside this file knows about it.

The toy ("mid-loop"): a Llama whose middle layer is applied `middle_passes` times (knob
`middle_passes` in 1..3), each pass with its own KV cache slot: pass k of a token attends to pass
k of the earlier tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.archs import Architecture, BuildOptions, register
from depthserve.archs.llama.format import LlamaConfig, dense_slots, layer_weight_flops
from depthserve.archs.llama.model import LlamaForCausalLM
from depthserve.oracles.llama import full_layer, knob_values, load, run_layers
from depthserve.lab.tiny.llama import base_config, llama_weights, model_shapes
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthPlan, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError, write_checkpoint
from depthserve.lab.make_tiny import synthetic_streams
from tests.depth_helpers import cache_layout, check_logprobs, tiny_llm

NAME = "mid-loop"
KNOB = "middle_passes"  # a knob name no built-in architecture has


# ---- format --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToySpec:
    middle: int
    max_loops: int
    architecture: str = NAME


def read_spec(section: dict | None, hf_config: dict) -> ToySpec:
    body = (section or {}).get("mid_loop")
    if not isinstance(body, dict) or not 0 <= body.get("middle", -1) < hf_config["num_hidden_layers"]:
        raise CheckpointFormatError("depth.mid_loop.middle must be a layer index")
    return ToySpec(body["middle"], int(body.get("max_loops", 3)))


def pass_slot(k: int) -> str:
    return f"middle.pass{k}"


@dataclass(frozen=True, kw_only=True)
class ToyPlan(DepthPlan):
    loops: int
    columns: dict[str, slice]


# ---- model ---------------------------------------------------------------------------------------
class ToyForCausalLM(LlamaForCausalLM):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: ToySpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec

    def depth_knobs(self) -> dict[str, KnobSpec]:
        return {KNOB: KnobSpec(KNOB, "passes of the middle layer", 1, self.spec.max_loops, 1)}

    def plan(self, depth: DepthParams) -> ToyPlan:
        loops = depth.get(KNOB, 1)
        extra = tuple(SlotSpec(pass_slot(k), SlotKind.DENSE, self.config.num_kv_heads) for k in range(2, loops + 1))
        layout = CacheLayout(dense_slots(self.config) + extra, base_slots=self.config.num_layers)
        per_layer = layer_weight_flops(self.config)
        return ToyPlan(depth=depth, layout=layout, loops=loops, columns=layout.slot_columns(),
                       flops_per_token=(self.config.num_layers + loops - 1) * per_layer,
                       plain_flops_per_token=self.config.num_layers * per_layer)

    def report(self, seq) -> DepthReport:
        tokens = seq.num_computed_tokens
        return DepthReport(architecture=NAME, tokens=tokens, flops=tokens * seq.plan.flops_per_token,
                           plain_flops=tokens * seq.plan.plain_flops_per_token, settings={KNOB: seq.plan.loops})

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        step, base = meta.batch, self._base_plan.layout
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pool, meta, base.columns(i))
            if i != self.spec.middle:
                continue
            for k in range(2, self.spec.max_loops + 1):  # pass k for the rows of requests that run it
                items = [item for item in step.items if item.plan.loops >= k]
                if not items:
                    break
                sub = step.slot_meta(items, [item.plan.columns[pass_slot(k)] for item in items])
                rows = step.rows(items)
                if rows is None:
                    x = layer(x, cos, sin, pool, sub, slice(None))
                else:
                    xs = layer(x.index_select(0, rows), cos.index_select(0, rows), sin.index_select(0, rows),
                               pool, sub, slice(None))
                    x = x.index_copy(0, rows, xs)
        return self.norm(x)


def build(hf_config: dict, spec: ToySpec, options: BuildOptions) -> ToyForCausalLM:
    return ToyForCausalLM(LlamaConfig.from_hf(hf_config), spec, options.max_len)


# ---- reference -----------------------------------------------------------------------------------
@torch.no_grad()
def reference_forward(model_dir, token_ids, depth=None, *, return_decisions=False, force=None, dtype=torch.float64):
    ref = load(model_dir, dtype, read_spec)
    loops = knob_values(depth).get(KNOB) or 1

    def layer_fn(ref, layer, x, mask):
        for _ in range(loops if layer == ref.spec.middle else 1):
            x = full_layer(ref, layer, x, mask)
        return x

    logits = run_layers(ref, torch.as_tensor(list(token_ids), dtype=torch.long)[None], layer_fn)[0]
    return (logits, {}) if return_decisions else logits


# ---- tiny (this module is the architecture's TinyCheckpoints) ----------------------------------------
CLI_FLAGS = ()


def make_tiny(out: Path, seed: int = 0, like=None, num_kv_heads=None, tokenizer=None) -> Path:
    cfg = base_config(tokenizer, model_shapes(like, num_kv_heads), tied=False)
    cfg["depth"] = {"format_version": FORMAT_VERSION, "architecture": NAME, "mid_loop": {"middle": 1, "max_loops": 3}}
    return write_checkpoint(Path(out), cfg, llama_weights(cfg, torch.Generator().manual_seed(seed)), tokenizer)


# ---- the test ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy(tmp_path_factory, smollm_tokenizer):
    register(Architecture(name=NAME, read_spec=read_spec, build=build, reference_forward=reference_forward,
                          tiny=__name__, knobs=(KnobInfo(KNOB, "passes of the middle layer"),)))
    from depthserve.lab.make_tiny import make_tiny as make_any

    return make_any(NAME, tmp_path_factory.mktemp("toy") / NAME, seed=4, tokenizer=smollm_tokenizer)


def test_a_registered_toy_architecture_is_served_equal_to_its_reference(toy):
    from depthserve import reference

    stream = synthetic_streams(49152, 1, 300, seed=8)[0].tolist()
    prompts = [stream[i * 11: i * 11 + n] for i, n in enumerate((9, 30, 17, 41, 5, 26, 33, 12))]
    prompts[5] = prompts[3][:26]  # a cached prefix for request 5 (same depth as request 3)
    depths = [DepthParams({KNOB: [1, 2, 3, 3, 2, 3, 1, 2][i]}) for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    probe = tiny_llm(toy, max_model_len=64).engine
    need = [probe.block_manager.pages_for(cache_layout(probe.model, d), len(p) + 12) for p, d in zip(prompts, depths)]
    pages = max(need) + 4
    assert sum(need) > 3 * pages
    llm = tiny_llm(toy, pages=pages, max_model_len=64, max_num_batched_tokens=24)
    outputs = llm.generate(prompts, params, depths)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    stats: dict = {}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]
        logprobs = torch.log_softmax(reference.forward(toy, tokens, depth), dim=-1)
        check_logprobs(logprobs, len(prompt), out.outputs[0], stats, tol=1e-4, near_tie=1e-3)
        assert out.depth.architecture == NAME and out.depth.settings == {KNOB: depth[KNOB]}
        assert out.depth.relative_compute == pytest.approx((4 + depth[KNOB] - 1) / 4)
    assert engine.block_manager.num_used_pages == 0
    # A three-pass request holds two more dense slots than a one-pass one.
    assert cache_layout(engine.model, DepthParams({KNOB: 3})).row_width == \
        cache_layout(engine.model, DepthParams({KNOB: 1})).row_width + 2 * engine.model.config.num_kv_heads


def test_the_toy_knob_is_served_over_http(toy):
    import httpx

    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server, wait_idle

    engine_args = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=64, block_size=8,
                       kv_cache_memory_gib=0.01)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(toy), **engine_args)))
    app = build_app(llm, served_model_name=NAME, depth_presets={"deep": {KNOB: 3}})
    offline = LLM(str(toy), **engine_args)
    prompt = synthetic_streams(49152, 1, 20, seed=9)[0].tolist()
    with live_server(app) as base:
        cards = {card["id"]: card for card in httpx.get(f"{base}/v1/models").json()["data"]}
        assert cards[NAME]["depth_knobs"][KNOB]["maximum"] == 3 and cards[f"{NAME}:deep"]["depth_preset"] == {KNOB: 3}
        schema = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]["DepthRequest"]
        assert KNOB in schema["properties"] and NAME in schema["properties"][KNOB]["description"]
        for passes in (1, 2):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
                    "depth": {KNOB: passes}}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            expected = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                                        DepthParams({KNOB: passes}))[0]
            assert response.json()["choices"][0]["text"] == expected.text
            assert response.json()["usage"]["depth"][KNOB] == passes
        for value, words in ((4, "must lie in 1..3"), ("2", "must be an integer"), ({"min": 1, "max": 2}, "one value")):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "depth": {KNOB: value}}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and KNOB in error["message"] and words in error["message"]
        wait_idle(llm)
    assert llm.engine.block_manager.num_used_pages == 0
