"""Online serving benchmark: streaming completions over HTTP against `depthserve serve`.

    python bench/serving.py --launch --quick                          # start a server, a fast smoke run
    python bench/serving.py --launch --server-args "--num-threads 2" --request-rate 1,2,4,inf
    python bench/serving.py --base-url http://127.0.0.1:8000 --max-concurrency 8 --num-prompts 64
    python bench/serving.py --launch --model DIR --depth '{"loops": 2}' --goodput ttft:500 tpot:100
    python bench/serving.py --launch --model DIR --depth '{"depth": "auto"}' --depth-policy slo --tpot-slo-ms 300
    python bench/serving.py --launch --llama-server --server-args "--num-threads 2" --request-rate 1,2,4
    python bench/serving.py --launch --server-args "--replicas 2 --num-threads 1" --shared-prefixes 4
    python bench/serving.py --launch --server-args "--num-threads 2" --long-prompts 1 --long-prompt-tokens 8000 \
        --num-prompts 300 --input-len 16 --output-len 4 --request-rate 0.5 --arrival constant   # head-of-line blocking

Workload: `--num-prompts` prompts of exactly `--input-len` tokens, sent as token ids to
/v1/completions: the first tokens of the documents of the C4 sample (`--dataset`, tokenized by
the server's /tokenize) or uniformly random token ids (`--random-prompts`). Every request asks
for exactly `--output-len` tokens (greedy, `ignore_eos`), streamed back over SSE. With
`--shared-prefixes K`, every prompt's first `--shared-prefix-len` tokens are one of K prefixes, in
turn (as chats that share a system prompt); the summary then gives the share of prompt tokens the
server found in its prefix cache (usage.prompt_tokens_details.cached_tokens) and, behind Ray Serve,
the requests each replica served (the x-depthserve-replica header).

Long prompts beside short ones (`--long-prompts N`): at each rate, N prompts of
`--long-prompt-tokens` tokens (`--long-output-len` new tokens each) are sent at the start of the
run, and the short requests above arrive at the rate until the long ones have all finished (or the
`--num-prompts` short ones have been sent): so they cover the whole long prefill. Then the short
requests that run sent are sent again at the same rate, alone: the baseline of their TTFT. The long prompts are
windows of the data set's documents joined end to end, last document first (so none shares a
prefix with a short prompt), or random token ids with `--random-prompts`. Each run then reports the
short and the long requests apart (`summary`: the short ones, `long_summary`: the long ones), and
the result's `long_prompt_effect` gives, per rate, the short requests' p99 TTFT with the long
prompts over their p99 TTFT alone (docs/server.md, "Scheduling").

Arrivals: for each rate R of `--request-rate` (requests/s; 'inf' sends everything at once),
inter-arrival gaps are exponential (`--arrival poisson`, the default) or exactly 1/R
(`--arrival constant`). `--max-concurrency C` caps the requests in flight (with rate inf:
a fixed-concurrency run). One warm-up request runs before the measurements, and the server's
prefix cache is emptied (POST /reset_prefix_cache) before each rate: every rate sends the same
prompts, and without the reset the later rates would find them cached.

Per request (times from the moment the request is sent):
    TTFT  time to the first streamed chunk that carries text
    ITL   gaps between successive text-carrying chunks (one chunk may hold more than one token
          when the detokenizer holds text back, as in other servers' benchmarks)
    E2EL  end-to-end latency, until the stream's [DONE]
    TPOT  (E2EL - TTFT) / (output tokens - 1), output tokens from the stream's usage chunk
Summary per rate: mean, std, median and `--percentiles` of each; request throughput and
output / total token throughput over the run's wall time (first send to last completion);
goodput = requests/s that met every SLO of `--goodput`. Result: bench/results/serving-<label>.json
with the settings, machine and library versions, the summaries and every request's raw figures.

`--llama-server` (with `--launch`) adds llama.cpp's server as the baseline (build it with
`make llamacpp`): at each rate, `depthserve serve` and then `llama-server -t T -np 16 -c 16384` on
the same GGUF file (T: the server's --num-threads, else torch's default thread count) each run the
same requests, one server at a time, each started afresh for its turn, so neither has a prompt cache
from an earlier rate (nor from the warm-up, whose prompt is a reversed one of the workload's).
Every run in the result names its server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SLO_METRICS = ("ttft", "tpot", "e2el")
DEPTHSERVE, LLAMA_SERVER = "depthserve", "llama-server"
LLAMA_SERVER_BINARY = Path(__file__).resolve().parent / "llamacpp" / "build" / "server" / "bin" / "llama-server"


# ---- settings -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    server.add_argument("--launch", action="store_true", help="start `depthserve serve` on a free loopback port, stop it at the end")
    server.add_argument("--model", default="smollm2-135m-instruct", help="the model to launch (with --launch)")
    server.add_argument("--server-args", default="", help="extra `depthserve serve` arguments (with --launch), one string")
    server.add_argument("--server-start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    server.add_argument("--served-model", default=None, help="model id in requests (default: the server's first)")
    server.add_argument("--api-key", default=None)
    server.add_argument("--depth-policy", default=None, choices=["fixed", "slo"],
                        help="the launched server's depth policy (with --launch; slo needs --tpot-slo-ms)")
    server.add_argument("--tpot-slo-ms", type=float, default=None, help="the slo depth policy's TPOT target")
    server.add_argument("--llama-server", action="store_true",
                        help="also run llama.cpp's llama-server on the same GGUF, taking turns with depthserve at "
                             "each rate, both started afresh for each turn (needs --launch; build: make llamacpp)")
    server.add_argument("--llama-server-binary", type=Path, default=LLAMA_SERVER_BINARY)
    server.add_argument("--llama-server-args", default="-np 16 -c 16384",
                        help="llama-server arguments besides the model, threads, host and port")
    server.add_argument("--llama-server-gguf", type=Path, default=None,
                        help="the GGUF file llama-server loads (default: the file behind --model)")
    load = p.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=64, help="requests per request rate")
    load.add_argument("--input-len", type=int, default=128)
    load.add_argument("--output-len", type=int, default=64)
    load.add_argument("--dataset", type=Path, default=common.C4_SAMPLE, help="JSON lines with a 'text' field")
    load.add_argument("--random-prompts", action="store_true", help="random token ids instead of --dataset")
    load.add_argument("--shared-prefixes", type=int, default=0,
                      help="K > 0: every prompt starts with one of K shared prefixes (prompt i with prefix i mod K), "
                           "as chats that share a system prompt")
    load.add_argument("--shared-prefix-len", type=int, default=64, help="tokens of each shared prefix")
    load.add_argument("--long-prompts", type=int, default=0,
                      help="N > 0: each rate runs the short requests alone, then with N long prompts sent first")
    load.add_argument("--long-prompt-tokens", type=int, default=8000, help="tokens of each long prompt")
    load.add_argument("--long-output-len", type=int, default=16, help="tokens each long prompt generates")
    load.add_argument("--request-rate", default="inf", help="requests/s, comma-separated to sweep, e.g. 1,2,4,inf")
    load.add_argument("--arrival", default="poisson", choices=["poisson", "constant"])
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--depth", default=None, help='depth knobs as JSON, sent as the request\'s "depth", e.g. \'{"loops": 2}\'')
    load.add_argument("--warmup-requests", type=int, default=1)
    load.add_argument("--seed", type=int, default=0)
    report = p.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000 (milliseconds)")
    report.add_argument("--percentiles", default="50,90,99")
    report.add_argument("--label", default=None, help="result name: serving-<label>.json (default: <model>-<device>)")
    report.add_argument("--no-progress", action="store_true")
    report.add_argument("--quick", action="store_true", help="8 prompts, input 64, output 16, rates 2 and inf")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.num_prompts, ns.input_len, ns.output_len, ns.request_rate = 8, 64, 16, "2,inf"
    ns.rates = common.parse_number_list(ns.request_rate)
    ns.slos_ms = parse_slos(ns.goodput) if ns.goodput else {}
    ns.depth_knobs = json.loads(ns.depth) if ns.depth else None
    if ns.depth_knobs is not None and not isinstance(ns.depth_knobs, dict):
        p.error("--depth must be a JSON object")
    if any(r <= 0 for r in ns.rates):
        p.error("--request-rate values must be positive (or inf)")
    if ns.long_prompts < 0 or ns.long_prompt_tokens < 1 or ns.long_output_len < 1:
        p.error("--long-prompts must be >= 0, --long-prompt-tokens and --long-output-len positive")
    if ns.long_prompts and ns.llama_server:
        p.error("--long-prompts runs against depthserve only")
    if ns.llama_server and not ns.launch:
        p.error("--llama-server needs --launch: the benchmark starts both servers itself, afresh for each rate")
    return ns


def parse_slos(items: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:100'] -> {'ttft': 500.0, 'tpot': 100.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise SystemExit(f"--goodput takes METRIC:MS with METRIC one of {SLO_METRICS}, got {item!r}")
        slos[name] = float(value)
    return slos


# ---- the server -----------------------------------------------------------------------------------
def depthserve_command(model: str, server_args: str, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("depthserve")
    return [str(exe) if exe.exists() else "depthserve", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *shlex.split(server_args)]


def llama_server_command(binary: Path, gguf: Path, threads: int, server_args: str, port: int | str) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(server_args)]


@contextlib.contextmanager
def launched_server(model: str, server_args: str, timeout: float) -> Iterator[str]:
    """`depthserve serve` on a free loopback port; yields its base URL; stops it on exit."""
    port = common.free_port()
    with launched(depthserve_command(model, server_args, port), port, timeout, DEPTHSERVE) as base_url:
        yield base_url


@contextlib.contextmanager
def launched(command: list[str], port: int, timeout: float, name: str) -> Iterator[str]:
    """A server started by `command`, listening on the loopback `port`; yields its base URL once its
    /health answers 200; stops it on exit (its log is kept if anything failed)."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-bench-", suffix=".log", delete=False)
    print(f"launching: {shlex.join(command)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base_url, proc, timeout, Path(log.name))
        yield base_url
    except BaseException:
        print(f"the server's log is kept: {log.name}", file=sys.stderr)
        raise
    else:
        Path(log.name).unlink(missing_ok=True)
    finally:
        common.stop_process(proc)
        log.close()


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} during start-up:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"the server did not become healthy within {timeout:.0f}s (log: {log})")


def server_arg(server_args: str, name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in a server argument string, else None."""
    args = shlex.split(server_args)
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


# ---- prompts --------------------------------------------------------------------------------------
async def dataset_prompts(client: httpx.AsyncClient, path: Path, count: int, length: int) -> list[list[int]]:
    """Prompts of `length` tokens from the documents of `path`, tokenized by the server itself."""
    documents = []
    for text in common.read_jsonl_texts(path):
        reply = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        reply.raise_for_status()
        documents.append(reply.json()["tokens"])
    windows = common.token_windows(documents, length, count)
    distinct = len({tuple(w) for w in windows})
    if distinct < count:
        print(f"note: {path.name} holds {distinct} distinct {length}-token prompts; {count - distinct} requests "
              "repeat one (prefix caching makes those cheaper)", flush=True)
    return windows


async def probe_vocab_size(client: httpx.AsyncClient) -> int:
    """The server's vocabulary size, by bisection on which token ids /detokenize accepts."""
    async def accepted(token_id: int) -> bool:
        return (await client.post("/detokenize", json={"tokens": [token_id]})).status_code == 200

    low, high = 0, 1 << 22  # ids < low are accepted; id high is not
    if not await accepted(low):
        raise SystemExit("the server's /detokenize rejects token id 0; pass --dataset prompts instead")
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if await accepted(mid) else (low, mid)
    return low + 1


# ---- one request ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    sent_at_s: float = 0.0  # since the start of the run
    ttft_s: float | None = None
    e2el_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    mean_depth: float | None = None  # a depth range: the mean level its tokens ran at (usage.depth)
    relative_compute: float | None = None  # a depth model: usage.depth.relative_compute
    token_depths: list[int] = field(default_factory=list)  # a depth range: each output token's level
    text: str = ""  # the completion's text
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    replica: str | None = None  # the x-depthserve-replica header (Ray Serve replicas)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def completion_body(model: str, prompt: list[int], output_len: int, depth: dict | None) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if depth is not None:
        body["depth"] = depth
    return body


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON payloads of an SSE stream, until [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_streaming_request(client: httpx.AsyncClient, body: dict, run_start: float) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    result.sent_at_s = start - run_start
    last_chunk = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            result.replica = response.headers.get("x-depthserve-replica")
            async for event in sse_events(response):
                now = time.perf_counter()
                for choice in event.get("choices", []):
                    result.token_depths += choice.get("token_depths") or []
                    result.text += choice.get("text") or ""
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                    depth = event["usage"].get("depth") or {}
                    result.mean_depth = depth.get("mean_depth")
                    result.relative_compute = depth.get("relative_compute")
                if not any(choice.get("text") for choice in event.get("choices", [])):
                    continue
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last_chunk)
                last_chunk = now
        result.e2el_s = time.perf_counter() - start
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "the stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- one run at one request rate ----------------------------------------------------------------
def arrival_offsets(count: int, rate: float, kind: str, seed: int) -> list[float]:
    """Send times (seconds from the start) of `count` requests at `rate` requests/s."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate
    return offsets


async def run_at_rate(client: httpx.AsyncClient, bodies: list[dict], rate: float, ns: argparse.Namespace,
                      first: list[dict] | None = None) -> tuple[list[RequestResult], float]:
    """All requests at one rate; returns their results (in prompt order) and the run's wall seconds.
    `first`: requests sent at the start, whose results come first; a request of `bodies` whose send
    time comes after every one of them has finished is not sent (its result is left out)."""
    from tqdm.auto import tqdm

    first = first or []
    offsets = arrival_offsets(len(bodies), rate, ns.arrival, ns.seed)
    limit = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    bar = tqdm(total=len(first) + len(bodies), desc=f"rate {rate:g} req/s", disable=ns.no_progress, leave=False)
    run_start = time.perf_counter()

    async def one(body: dict, offset: float, after: list[asyncio.Task]) -> RequestResult | None:
        await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
        if after and all(task.done() for task in after):
            return None
        async with limit or contextlib.nullcontext():
            result = await send_streaming_request(client, body, run_start)
        bar.update(1)
        return result

    leading = [asyncio.ensure_future(one(body, 0.0, [])) for body in first]
    results = await asyncio.gather(*leading, *(one(b, o, leading) for b, o in zip(bodies, offsets)))
    duration = time.perf_counter() - run_start
    bar.close()
    return [result for result in results if result is not None], duration


def summarize_run(results: list[RequestResult], duration: float, ns: argparse.Namespace) -> dict[str, Any]:
    percentiles = common.parse_number_list(ns.percentiles)
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)

    def ms(values) -> dict[str, float | None]:
        return {k: (None if v is None else 1000 * v) for k, v in common.summarize(values, percentiles).items()}

    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": ms(r.ttft_s for r in done),
        "tpot_ms": ms(r.tpot_s for r in done if r.tpot_s is not None),
        "itl_ms": ms(gap for r in done for gap in r.itl_s),
        "e2el_ms": ms(r.e2el_s for r in done),
    }
    depths = [r.mean_depth for r in done if r.mean_depth is not None]
    if depths:  # requests with a depth range: how deep the server ran them
        summary["mean_depth"] = sum(depths) / len(depths)
    cached = [r for r in done if r.cached_tokens is not None]
    if cached:  # a server that reports prefix-cache hits
        summary["cached_prompt_tokens"] = sum(r.cached_tokens for r in cached)
        summary["cached_prompt_token_fraction"] = summary["cached_prompt_tokens"] / max(1, sum(r.prompt_tokens for r in cached))
    replicas = Counter(r.replica for r in done if r.replica is not None)
    if replicas:
        summary["requests_per_replica"] = dict(replicas)
    computes = [r.relative_compute for r in done if r.relative_compute is not None]
    if computes:
        summary["mean_relative_compute"] = sum(computes) / len(computes)
    if ns.slos_ms:
        good = [r for r in done if meets_slos(r, ns.slos_ms)]
        summary["goodput_slos_ms"] = ns.slos_ms
        summary["good_requests"] = len(good)
        summary["goodput"] = len(good) / duration
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    for name, limit_ms in slos_ms.items():
        if measured[name] is None:
            if name == "tpot":
                continue  # one output token: no TPOT, so that SLO cannot fail
            return False
        if 1000 * measured[name] > limit_ms:
            return False
    return True


# ---- the whole benchmark ------------------------------------------------------------------------
def http_client(base_url: str, ns: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None), limits=limits)


async def served_model(client: httpx.AsyncClient, requested: str | None) -> tuple[str, dict]:
    """The model id the requests name (`requested`, else the server's first), and its /v1/models entry."""
    models = (await client.get("/v1/models")).raise_for_status().json()["data"]
    model_id = requested or models[0]["id"]
    return model_id, next((m for m in models if m["id"] == model_id), models[0])


async def workload_prompts(client: httpx.AsyncClient, ns: argparse.Namespace) -> list[list[int]]:
    if ns.random_prompts:
        vocab = await probe_vocab_size(client)
        prompts = common.random_prompts(ns.num_prompts + ns.shared_prefixes, ns.input_len, vocab, ns.seed)
    else:
        prompts = await dataset_prompts(client, ns.dataset, ns.num_prompts + ns.shared_prefixes, ns.input_len)
    return with_shared_prefixes(prompts, ns.shared_prefixes, ns.shared_prefix_len)


def with_shared_prefixes(prompts: list[list[int]], count: int, length: int) -> list[list[int]]:
    """The prompts after the first `count`, each with its first `length` tokens replaced by the first
    `length` tokens of one of the first `count` prompts, in turn (unchanged for count 0)."""
    if count == 0:
        return prompts
    prefixes, rest = [p[:length] for p in prompts[:count]], prompts[count:]
    return [prefixes[i % count] + prompt[length:] for i, prompt in enumerate(rest)]


def warmup_prompts(prompts: list[list[int]], count: int) -> list[list[int]]:
    """Warm-up prompts that share no prefix with the measured ones (the first ones reversed), so a
    server whose prompt cache cannot be emptied (llama-server) finds nothing of them cached."""
    return [list(reversed(prompt)) for prompt in prompts[:count]]


async def warm_up(client: httpx.AsyncClient, model_id: str, prompts: list[list[int]], ns: argparse.Namespace) -> None:
    for prompt in warmup_prompts(prompts, ns.warmup_requests):
        warm = await send_streaming_request(client, completion_body(model_id, prompt, ns.output_len, ns.depth_knobs),
                                            time.perf_counter())
        if not warm.ok:
            raise SystemExit(f"the warm-up request failed: {warm.error}")


async def measure_rate(client: httpx.AsyncClient, bodies: list[dict], rate: float, ns: argparse.Namespace,
                       server: str, long_bodies: list[dict] | None = None) -> dict[str, Any]:
    """One run of every request at `rate`, its prefix cache emptied first where the server can;
    `long_bodies` (long prompts) are sent first and summarized apart."""
    cold = await reset_prefix_cache(client) if server == DEPTHSERVE else None
    long_bodies = long_bodies or []
    results, duration = await run_at_rate(client, bodies, rate, ns, first=long_bodies)
    long_results, results = results[:len(long_bodies)], results[len(long_bodies):]
    summary = summarize_run(results, duration, ns)
    label = f"{server} + {len(long_bodies)} long" if long_bodies else server
    print(f"{label:>12} " + format_summary(rate, summary), flush=True)
    record = run_record(server, rate, cold, summary, [r.as_dict() for r in results])
    if long_bodies:
        record["long_summary"] = summarize_run(long_results, duration, ns)
        record["long_requests"] = [r.as_dict() for r in long_results]
        long_ttft = record["long_summary"]["ttft_ms"].get("median")
        print(f"{'':>12} long prompts: {record['long_summary']['completed']} of {len(long_bodies)} completed, "
              f"TTFT median {'-' if long_ttft is None else f'{long_ttft:.0f}'} ms", flush=True)
    record["long_prompts"] = len(long_bodies)
    return record


def long_prompt_effect(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: the short requests' p99 TTFT with the long prompts over their p99 TTFT alone."""
    effects = []
    for alone in (run for run in runs if not run["long_prompts"]):
        for mixed in (run for run in runs if run["long_prompts"] and run["request_rate"] == alone["request_rate"]):
            before, after = alone["summary"]["ttft_ms"].get("p99"), mixed["summary"]["ttft_ms"].get("p99")
            effects.append({
                "request_rate": alone["request_rate"], "long_prompts": mixed["long_prompts"],
                "short_p99_ttft_ms_alone": before, "short_p99_ttft_ms_with_long": after,
                "short_p99_ttft_ratio": after / before if before and after is not None else None,
                "long_completed": mixed["long_summary"]["completed"],
                "long_e2el_s": [r["e2el_s"] for r in mixed["long_requests"]],
            })
    return effects


def run_record(server: str, rate: float, prefix_cache_reset: bool | None, summary: dict[str, Any],
               requests: list[dict[str, Any]]) -> dict[str, Any]:
    """One run as the result keeps it: `prefix_cache_reset` is None where the server was started
    afresh for the run instead (llama-server)."""
    return {"server": server, "request_rate": rate if rate != float("inf") else "inf",
            "prefix_cache_reset": prefix_cache_reset, "summary": summary, "requests": requests}


async def benchmark(base_url: str, ns: argparse.Namespace) -> dict[str, Any]:
    """Every rate against one running depthserve server, its prefix cache emptied before each."""
    async with http_client(base_url, ns) as client:
        model_id, model = await served_model(client, ns.served_model)
        prompts = await workload_prompts(client, ns)
        bodies = [completion_body(model_id, p, ns.output_len, ns.depth_knobs) for p in prompts]
        long_bodies = [completion_body(model_id, p, ns.long_output_len, ns.depth_knobs)
                       for p in await long_prompts(client, ns)]
        await warm_up(client, model_id, prompts, ns)
        runs = []
        for rate in ns.rates:
            if not long_bodies:
                runs.append(await measure_rate(client, bodies, rate, ns, DEPTHSERVE))
                continue
            mixed = await measure_rate(client, bodies, rate, ns, DEPTHSERVE, long_bodies)
            # the baseline of their TTFT: the short requests the mixed run sent, alone, at the same rate
            runs.append(await measure_rate(client, bodies[:len(mixed["requests"])], rate, ns, DEPTHSERVE))
            runs.append(mixed)
    return {"model_id": model_id, "server_model": model, "runs": runs}


async def long_prompts(client: httpx.AsyncClient, ns: argparse.Namespace) -> list[list[int]]:
    """`--long-prompts` prompts of `--long-prompt-tokens` tokens (none without the option)."""
    count, length = ns.long_prompts, ns.long_prompt_tokens
    if count == 0:
        return []
    if ns.random_prompts:
        return common.random_prompts(count, length, await probe_vocab_size(client), ns.seed + 1)
    joined: list[int] = []
    for text in reversed(common.read_jsonl_texts(ns.dataset)):
        reply = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        joined += reply.raise_for_status().json()["tokens"]
        if len(joined) >= count * length:
            break
    if not joined:
        raise SystemExit(f"{ns.dataset} holds no text for the long prompts")
    joined = (joined * -(-count * length // len(joined)))[:count * length]  # repeated if the documents run out
    return [joined[i * length:(i + 1) * length] for i in range(count)]


def turns(rates: list[float], servers: tuple[str, ...]) -> list[tuple[float, str]]:
    """(rate, server) in the order they run: every server in turn at each rate, depthserve first
    (it tokenizes the prompts that both are sent)."""
    return [(rate, server) for rate in rates for server in servers]


async def fresh_server_run(base_url: str, ns: argparse.Namespace, server: str, rate: float,
                           prompts: list[list[int]] | None) -> tuple[list[list[int]], str, dict, dict[str, Any]]:
    """One rate against a server just started: warm-up, then the run. Returns the prompts (made
    here on the first turn), the model id and entry, and the run."""
    async with http_client(base_url, ns) as client:
        model_id, model = await served_model(client, ns.served_model if server == DEPTHSERVE else None)
        prompts = prompts if prompts is not None else await workload_prompts(client, ns)
        await warm_up(client, model_id, prompts, ns)
        bodies = [completion_body(model_id, p, ns.output_len, ns.depth_knobs) for p in prompts]
        return prompts, model_id, model, await measure_rate(client, bodies, rate, ns, server)


def benchmark_against_llama_server(ns: argparse.Namespace, gguf: Path, threads: int) -> dict[str, Any]:
    """depthserve and llama-server taking turns at each rate, each started afresh for its turn."""
    prompts, runs, models = None, [], {}
    for rate, server in turns(ns.rates, (DEPTHSERVE, LLAMA_SERVER)):
        port = common.free_port()
        command = (depthserve_command(ns.model, ns.server_args, port) if server == DEPTHSERVE else
                   llama_server_command(ns.llama_server_binary, gguf, threads, ns.llama_server_args, port))
        with launched(command, port, ns.server_start_timeout, server) as base_url:
            prompts, model_id, model, run = asyncio.run(fresh_server_run(base_url, ns, server, rate, prompts))
        models[server] = (model_id, model)
        runs.append(run)
    model_id, model = models[DEPTHSERVE]
    return {"model_id": model_id, "server_model": model, "runs": runs, "llama_server_model": models[LLAMA_SERVER][1]}


def llama_server_gguf(ns: argparse.Namespace) -> Path:
    if ns.llama_server_gguf is not None:
        return ns.llama_server_gguf
    from depthserve.loading.registry import resolve_model

    source = resolve_model(ns.model)
    if source.format != "gguf":
        raise SystemExit(f"--llama-server needs a GGUF model; {ns.model} is a {source.format} checkpoint "
                         "(pass --llama-server-gguf FILE)")
    return source.path


def llama_server_threads(server_args: str) -> int:
    """llama-server's -t: depthserve's --num-threads, else the thread count torch (so depthserve) picks."""
    threads = server_arg(server_args, "--num-threads")
    if threads:
        return int(threads)
    import torch

    return torch.get_num_threads()


def llama_server_record(ns: argparse.Namespace, gguf: Path, threads: int, version: str, model: dict) -> dict[str, Any]:
    """What the result keeps about the llama-server baseline (its command with the port left out)."""
    command = llama_server_command(ns.llama_server_binary, gguf, threads, ns.llama_server_args, "PORT")
    return {"command": shlex.join(command), "version": version, "threads": threads, "gguf": str(gguf), "model": model}


def llama_server_version(binary: Path) -> str:
    if not binary.exists():
        raise SystemExit(f"no llama-server at {binary}: build it with `make llamacpp` (or bench/llamacpp/build.sh "
                         "server), or pass --llama-server-binary")
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip()


async def reset_prefix_cache(client: httpx.AsyncClient) -> bool:
    """Empty the server's prefix cache, so a rate does not reuse the prompt blocks of the one before."""
    reply = await client.post("/reset_prefix_cache")
    if reply.status_code == 404:
        print("note: the server has no /reset_prefix_cache; each rate after the first may hit its prefix cache",
              flush=True)
        return False
    reply.raise_for_status()
    return True


def format_summary(rate: float, s: dict[str, Any]) -> str:
    def value(metric: str, stat: str) -> str:
        v = s[metric].get(stat)
        return "-" if v is None else f"{v:.1f}"

    text = (f"rate {rate:>5g} req/s: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f}s | "
            f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s | "
            f"TTFT ms median {value('ttft_ms', 'median')} p99 {value('ttft_ms', 'p99')} | "
            f"TPOT ms median {value('tpot_ms', 'median')} p99 {value('tpot_ms', 'p99')} | "
            f"E2EL ms median {value('e2el_ms', 'median')}")
    if "goodput" in s:
        text += f" | goodput {s['goodput']:.2f} req/s"
    if "mean_depth" in s:
        text += f" | mean depth {s['mean_depth']:.2f}"
    if "cached_prompt_token_fraction" in s:
        text += f" | prompt tokens cached {100 * s['cached_prompt_token_fraction']:.0f}%"
    if "requests_per_replica" in s:
        text += f" | per replica {sorted(s['requests_per_replica'].values(), reverse=True)}"
    return text


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if not ns.random_prompts and not ns.dataset.exists():
        print(f"skipping the serving benchmark: the prompt data set {ns.dataset} is absent "
              "(pass --dataset PATH, or --random-prompts for random token ids)")
        return 0
    if ns.launch:
        if ns.depth_policy is not None:
            ns.server_args += f" --depth-policy {ns.depth_policy}"
        if ns.tpot_slo_ms is not None:
            ns.server_args += f" --tpot-slo-ms {ns.tpot_slo_ms:g}"
        if ns.llama_server:
            gguf, llama_threads = llama_server_gguf(ns), llama_server_threads(ns.server_args)
            version = llama_server_version(ns.llama_server_binary)
            outcome = benchmark_against_llama_server(ns, gguf, llama_threads)
        else:
            with launched_server(ns.model, ns.server_args, ns.server_start_timeout) as base_url:
                outcome = asyncio.run(benchmark(base_url, ns))
        device = common.resolve_device(server_arg(ns.server_args, "--device") or "auto")
        threads = server_arg(ns.server_args, "--num-threads")
    else:
        outcome = asyncio.run(benchmark(ns.base_url, ns))
        device, threads = common.resolve_device("auto"), None
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()
                if k not in ("rates", "slos_ms", "depth_knobs")}
    settings["dataset"] = None if ns.random_prompts else str(ns.dataset)
    payload = {
        "benchmark": "serving",
        "settings": settings,
        "server": {"base_url": "launched" if ns.launch else ns.base_url, "model_id": outcome["model_id"],
                   "model": outcome["server_model"], "device": device},
        # With a remote --base-url this describes the client's machine, not the server's.
        "environment": {**common.environment(device, int(threads) if threads else None),
                        "describes": "the server's machine" if ns.launch else "the client's machine"},
        "runs": outcome["runs"],
    }
    if ns.long_prompts:
        payload["long_prompt_effect"] = long_prompt_effect(outcome["runs"])
    if ns.llama_server:
        payload["llama_server"] = llama_server_record(ns, gguf, llama_threads, version, outcome["llama_server_model"])
    label = ns.label or f"{common.slug(Path(outcome['model_id']).name)}-{common.device_slug(device)}"
    label += "-vs-llama-server" if ns.llama_server and not ns.label else ""
    label += "-quick" if ns.quick and not ns.label else ""
    print(f"wrote {common.write_result(f'serving-{label}', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
