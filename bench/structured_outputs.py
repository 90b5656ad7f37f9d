"""Structured outputs on one model: grammar compile time, the validity of outputs over generated JSON
schemas, and decode throughput with a JSON-schema constraint on every request against none.

    python bench/structured_outputs.py --threads 2 --out structured-outputs-cpu-xeon-2core
    python bench/structured_outputs.py --quick          # a smoke run

Method.
1. Compile: `--schemas` JSON schemas drawn by bench/json_schemas.py (seed 0, duplicates dropped),
   each compiled once by the engine's grammar backend (none is in its cache): the time per compile,
   p50/p90/p99/max. For each, an instance drawn by hypothesis-jsonschema, written as the grammar writes JSON, must
   be accepted token by token (the constraint admits what the schema admits).
2. Validity: each schema as a chat request ("reply with JSON matching this schema"), greedy, at most
   `--validity-max-tokens` tokens, 32 at a time: every output that finishes with "stop" is checked
   with jsonschema; the counts of stop / length / valid are reported.
3. Throughput: `--batch-sizes` prompts of `--input-len` random ids, greedy, EOS ignored, generated
   with 1 and `--output-len + 1` tokens; decode tokens/s = concurrency x output_len / (t(output_len + 1)
   - t(1)), the median of `--repeats` (bench/throughput.py's method). Unconstrained and constrained
   take turns in each repeat. The constraint (THROUGHPUT_SCHEMA: a list of at least 40 records of a
   name, a bounded integer and an enum) cannot complete within the output, so both generate the
   same number of tokens. The engine's time filling masks and masking logits is reported per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from json_schemas import as_generated_json, draw_instance, draw_schemas  # noqa: E402

THROUGHPUT_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "score": {"type": "integer", "minimum": 0,
                                                                                "maximum": 100},
                       "level": {"enum": ["low", "mid", "high"]}},
        "required": ["name", "score", "level"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--schemas", type=int, default=300)
    p.add_argument("--validity-max-tokens", type=int, default=200)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="24 schemas, output 16, 2 repeats")
    p.add_argument("--out", default=None, help="result name under bench/results")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.schemas, ns.output_len, ns.repeats = 24, 16, 2
    return ns


def compile_times(llm, schemas: list[dict]) -> dict:
    from depthserve.structured import JsonSchemaConstraint

    backend = llm.engine.structured.backend
    times, accepted, problems = [], 0, []
    for i, schema in enumerate(schemas):
        start = time.perf_counter()
        compiled = backend.compile(JsonSchemaConstraint(schema))
        times.append(1000 * (time.perf_counter() - start))
        matcher = compiled.new_matcher()
        text = as_generated_json(draw_instance(schema, seed=i), schema)
        ok = all(matcher.accept_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False))
        if ok and matcher.eos_allowed():
            accepted += 1
        else:
            problems.append({"schema": schema, "instance": text, "error": matcher.error})
    return {"compile_ms": common.summarize(times, (50, 90, 99)) | {"max": max(times)},
            "instances_accepted": accepted, "instances": len(schemas), "rejected_instances": problems[:5]}


def validity(llm, schemas: list[dict], max_tokens: int) -> dict:
    import jsonschema

    from depthserve import SamplingParams
    from depthserve.structured import StructuredOutputsParams

    counts = {"requests": len(schemas), "stop": 0, "length": 0, "valid": 0, "invalid": 0}
    invalid = []
    for start in range(0, len(schemas), 32):
        batch = schemas[start:start + 32]
        prompts = [llm.apply_chat_template([{"role": "user", "content": "Reply with a JSON object that matches this "
                                             f"schema: {json.dumps(schema)}"}]) for schema in batch]
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=s))
                  for s in batch]
        for schema, out in zip(batch, llm.generate(prompts, params)):
            counts[out.finish_reason] = counts.get(out.finish_reason, 0) + 1
            if out.finish_reason != "stop":
                continue
            try:
                jsonschema.validate(json.loads(out.text), schema)
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                counts["invalid"] += 1
                invalid.append({"schema": schema, "text": out.text, "error": str(exc)[:300]})
    return counts | {"invalid_examples": invalid[:5]}


@contextlib.contextmanager
def constraint_time(llm):
    """Seconds the engine spends filling masks (`start_step`) and masking logits (`apply`) inside the
    block, by wrapping the two methods of this engine's objects."""
    from depthserve.engine.structured_output import StepMasks

    seconds = {"fill": 0.0, "apply": 0.0}
    structured, original_start, original_apply = llm.engine.structured, None, StepMasks.apply

    def timed(part, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
        return call

    original_start = structured.start_step
    structured.start_step = timed("fill", original_start)
    StepMasks.apply = timed("apply", original_apply)
    try:
        yield seconds
    finally:
        structured.start_step = original_start
        StepMasks.apply = original_apply


def throughput(llm, ns: argparse.Namespace) -> list[dict]:
    from depthserve import SamplingParams
    from depthserve.structured import StructuredOutputsParams

    constraint = StructuredOutputsParams(json=THROUGHPUT_SCHEMA)
    rows = []
    for concurrency in common.parse_number_list(ns.batch_sizes):
        concurrency = int(concurrency)
        prompts = common.random_prompts(concurrency, ns.input_len, llm.engine.vocab_size, seed=concurrency)
        times: dict[str, dict[int, list[float]]] = {"plain": {}, "constrained": {}}

        def run(kind: str, new_tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                    structured_outputs=constraint if kind == "constrained" else None)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            assert all(len(o.token_ids) == new_tokens for o in outs), "a constrained output ended early"
            return elapsed

        for kind in times:  # warm-up
            run(kind, 2)
        spent = {"fill": [], "apply": []}
        for _ in range(ns.repeats):
            for kind in times:
                for new_tokens in (1, ns.output_len + 1):
                    with constraint_time(llm) as seconds:
                        times[kind].setdefault(new_tokens, []).append(run(kind, new_tokens))
                    if kind == "constrained" and new_tokens > 1:
                        for part in spent:
                            spent[part].append(seconds[part])
        row = {"concurrency": concurrency}
        # The engine's own time on the constraint in a constrained generation, per generated token
        # step: filling the masks, masking the logits (accepting tokens is ~0.5 us a row: left out).
        for part, values in spent.items():
            row[f"{part}_ms_per_step"] = 1000 * statistics.median(values) / (ns.output_len + 1)
        for kind, by_length in times.items():
            decode_s = statistics.median(by_length[ns.output_len + 1]) - statistics.median(by_length[1])
            row[f"decode_tok_s_{kind}"] = concurrency * ns.output_len / decode_s
        row["constrained_over_plain"] = row["decode_tok_s_constrained"] / row["decode_tok_s_plain"]
        print(f"concurrency {concurrency:3d}: decode {row['decode_tok_s_plain']:.1f} tok/s plain, "
              f"{row['decode_tok_s_constrained']:.1f} constrained ({row['constrained_over_plain']:.3f}); "
              f"mask fill {row['fill_ms_per_step']:.2f} ms, masking {row['apply_ms_per_step']:.2f} ms a step", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from depthserve import LLM

    llm = LLM(ns.model, device=ns.device, dtype=ns.dtype, quantization=ns.quantization, num_threads=ns.threads,
              max_num_seqs=32, enable_prefix_caching=False, max_model_len=2048, load_progress=False)
    unique = {json.dumps(s, sort_keys=True): s for s in draw_schemas(ns.schemas, seed=0)}
    schemas = list(unique.values())
    compiled = compile_times(llm, schemas)
    print(f"compile: {compiled['compile_ms']}, instances accepted {compiled['instances_accepted']}/{len(schemas)}",
          flush=True)
    valid = validity(llm, schemas, ns.validity_max_tokens)
    print(f"validity: {({k: v for k, v in valid.items() if k != 'invalid_examples'})}", flush=True)
    rows = throughput(llm, ns)
    payload = {
        "benchmark": "structured_outputs", "model": ns.model,
        "engine": {"dtype": str(llm.engine.dtype), "quantization": llm.engine.quantization.summary()},
        "settings": {k: v for k, v in vars(ns).items() if k != "out"},
        "environment": common.environment(str(llm.engine.device), ns.threads),
        "schemas": len(schemas), "compile": compiled, "validity": valid, "throughput": rows,
        "throughput_schema": THROUGHPUT_SCHEMA,
    }
    name = ns.out or f"structured-outputs-{common.device_slug(str(llm.engine.device))}"
    print("wrote", common.write_result(name, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
