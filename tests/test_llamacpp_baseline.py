"""The llama.cpp baselines of the benchmarks (bench/throughput.py --llamacpp, bench/serving.py
--llama-server): their pure parts always; llama.cpp itself only where `make llamacpp` built it (CI
never builds it: those smoke tests skip and say why)."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import serving  # noqa: E402
import throughput  # noqa: E402

NOT_BUILT = "llama.cpp is not built here (make llamacpp builds it; CI does not)"


def test_throughput_llamacpp_options():
    ns = throughput.parse_args(["--llamacpp", "--threads", "2", "--no-hf"])
    assert ns.llamacpp and ns.threads == 2 and ns.llamacpp_gguf is None
    assert not throughput.parse_args([]).llamacpp
    assert throughput.llamacpp_gguf(throughput.parse_args(["--llamacpp-gguf", "/x/m.gguf"])) == Path("/x/m.gguf")


def test_llamacpp_batches_put_every_prompt_in_its_own_sequence_with_logits_at_its_end():
    entries = throughput.prefill_entries([[5, 6, 7], [8, 9]])
    assert entries == [(5, 0, 0, False), (6, 1, 0, False), (7, 2, 0, True), (8, 0, 1, False), (9, 1, 1, True)]
    assert throughput.batch_chunks(entries, 2) == [entries[:2], entries[2:4], entries[4:]]
    assert throughput.batch_chunks(entries, 8) == [entries]
    # a decode step: each sequence's newest token at the position after everything before it
    assert throughput.decode_entries([[1, 2], [3, 4]], [4, 3]) == [(2, 4, 0, True), (4, 3, 1, True)]


def test_llamacpp_takes_turns_with_the_engine_in_every_repeat_and_gets_its_own_columns():
    calls = []

    class Runner:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, new_tokens):
            calls.append((self.name, new_tokens))

    figures, _ = throughput.measure([Runner("engine"), Runner("llamacpp")], [[1, 2]], 4, 2, lambda: None)
    per_repeat = [("engine", 1), ("engine", 5), ("llamacpp", 1), ("llamacpp", 5)]
    assert calls == [("engine", 5), ("llamacpp", 5)] + 2 * per_repeat
    assert set(figures) == {"engine", "llamacpp"}

    engine = {"decode_tok_s": 300.0, "prefill_tok_s": 900.0}
    columns = throughput.baseline_columns("llamacpp", {"decode_tok_s": 200.0, "prefill_tok_s": 300.0}, engine, 400.0)
    assert columns == {"llamacpp_decode_tok_s": 200.0, "llamacpp_prefill_tok_s": 300.0,
                       "engine_best_decode_over_llamacpp": 2.0, "engine_prefill_over_llamacpp": 3.0}
    unmeasured = throughput.baseline_columns("llamacpp", {"decode_tok_s": None, "prefill_tok_s": 300.0}, engine, None)
    assert "engine_best_decode_over_llamacpp" not in unmeasured
    row = {"concurrency": 1, "engine_prefill_tok_s": 900.0, "engine_decode_tok_s": 300.0, **columns}
    assert "llamacpp: prefill    300.0 tok/s" in throughput._format_row(row)


def test_serving_llama_server_options_and_turns():
    ns = serving.parse_args(["--launch", "--llama-server", "--request-rate", "1,inf"])
    assert ns.llama_server and ns.llama_server_args == "-np 16 -c 16384"
    assert ns.llama_server_binary == serving.LLAMA_SERVER_BINARY
    with pytest.raises(SystemExit):  # it starts both servers itself
        serving.parse_args(["--llama-server"])
    assert serving.turns([1.0, math.inf], ("depthserve", "llama-server")) == [
        (1.0, "depthserve"), (1.0, "llama-server"), (math.inf, "depthserve"), (math.inf, "llama-server")]
    command = serving.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, "-np 16 -c 16384", 8123)
    assert command == ["/b/llama-server", "-m", "/m.gguf", "-t", "2", "--host", "127.0.0.1", "--port", "8123",
                       "-np", "16", "-c", "16384"]
    assert serving.llama_server_threads("--num-threads 3") == 3


def test_serving_warm_up_prompts_share_no_prefix_with_the_measured_ones():
    prompts = [[1, 2, 3], [4, 5, 6]]
    assert serving.warmup_prompts(prompts, 1) == [[3, 2, 1]]
    assert serving.warmup_prompts(prompts, 0) == []


def test_serving_runs_name_their_server():
    run = serving.run_record("llama-server", math.inf, None, {"completed": 1}, [])
    assert run == {"server": "llama-server", "request_rate": "inf", "prefix_cache_reset": None,
                   "summary": {"completed": 1}, "requests": []}
    assert serving.run_record("depthserve", 2.0, True, {}, [])["request_rate"] == 2.0
    ns = serving.parse_args(["--launch", "--llama-server", "--llama-server-binary", "/b/llama-server"])
    record = serving.llama_server_record(ns, Path("/m.gguf"), 2, "version: 1", {"id": "m"})
    assert record == {"command": "/b/llama-server -m /m.gguf -t 2 --host 127.0.0.1 --port PORT -np 16 -c 16384",
                      "version": "version: 1", "threads": 2, "gguf": "/m.gguf", "model": {"id": "m"}}


# ---- llama.cpp itself, where it was built ---------------------------------------------------------
def smollm_gguf() -> Path:
    from depthserve.errors import UnknownModelError
    from depthserve.loading.registry import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct").path
    except UnknownModelError as exc:
        pytest.skip(f"the SmolLM2 GGUF is not installed: {exc}")


def test_llamacpp_runner_generates_greedily_from_the_engines_token_ids(request):
    pytest.importorskip("llama_cpp", reason=NOT_BUILT)
    smollm_tokenizer = request.getfixturevalue("smollm_tokenizer")  # only once llama.cpp is known to be there
    runner = throughput.LlamaCppRunner(smollm_gguf(), threads=2, max_len=32)
    prompts = [smollm_tokenizer.encode(text, add_special_tokens=False)
               for text in ("The capital of France is the city of", "One, two, three, four,")]
    prompts = [p[:min(map(len, prompts))] for p in prompts]
    runner.generate(prompts, 4)
    first = runner.last_tokens
    assert [len(t) for t in first] == [4, 4]
    runner.generate(prompts, 4)  # the KV cache is emptied in between: the same greedy tokens again
    assert runner.last_tokens == first
    runner.generate(prompts[:1], 1)  # another concurrency: another context
    assert runner.last_tokens == [first[0][:1]]
    assert "Paris" in smollm_tokenizer.decode(first[0])
    assert runner.describe()["threads"] == 2
    runner.close_context()


def test_llama_server_streams_the_requested_tokens_with_usage():
    if not serving.LLAMA_SERVER_BINARY.exists():
        pytest.skip(f"no {serving.LLAMA_SERVER_BINARY}: {NOT_BUILT}")
    port = common.free_port()
    command = serving.llama_server_command(serving.LLAMA_SERVER_BINARY, smollm_gguf(), 2, "-np 2 -c 1024", port)
    with serving.launched(command, port, 120.0, "llama-server") as base_url:
        async def one() -> serving.RequestResult:
            async with serving.http_client(base_url, serving.parse_args([])) as client:
                model_id, _ = await serving.served_model(client, None)
                body = serving.completion_body(model_id, [504, 3575, 282, 4649, 314], 6, None)
                return await serving.send_streaming_request(client, body, time.perf_counter())

        result = asyncio.run(one())
    assert result.ok, result.error
    assert result.output_tokens == 6 and result.tpot_s is not None
