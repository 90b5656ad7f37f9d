"""Soak test: mixed, partly hostile traffic against `depthserve serve` for a fixed time.

    python bench/soak.py                      # 10 minutes on a tiny ITT model (built, then launched)
    python bench/soak.py --duration 30 --out /tmp/soak.json        # the short run of `make test`
    python bench/soak.py --base-url http://127.0.0.1:8000 --duration 120   # a running server

Workers (`--concurrency`, each one request at a time, every request with a client timeout) pick
a kind of request at random until `--duration` seconds have passed or `--max-requests` were sent:

    complete     non-streamed completion, random sampling settings and depth knobs (from /v1/models)
    stream       streamed completion, read to [DONE]
    chat         streamed chat completion
    disconnect   streamed completion the client drops after one to three chunks
    timeout      non-streamed completion the client gives up on after 50 ms
    bad          a known-bad body: lone surrogates, NaN, bad types, bad depth knobs, oversized
                 bodies, broken JSON, too many prompts, max_tokens past the context, unknown paths
    fuzz         a body drawn by hypothesis-jsonschema from the request schemas the server's
                 /openapi.json publishes (the schemathesis approach: valid and invalid alike)

A monitor polls /health twice a second. At the end the run waits for the server to go idle and
reads /metrics. Result (JSON): requests by kind and status, latency percentiles (p50, p99) of
answered requests, 5xx answers, health failures and engine restarts (health turning from ok to
not ok, or the server process exiting), and the KV pages still in use (must be 0). The exit code
is 1 when any of 5xx, restarts or leftover pages is not zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving import launched_server  # noqa: E402

KINDS = {"complete": 3, "stream": 3, "chat": 2, "disconnect": 1, "timeout": 1, "bad": 2, "fuzz": 2}
REQUEST_TIMEOUT = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: build and launch a tiny model)")
    p.add_argument("--arch", default="itt", choices=["itt", "sgt"], help="the tiny model to launch")
    p.add_argument("--server-args", default="--max-num-seqs 8 --max-waiting-requests 16 --max-model-len 512",
                   help="extra `depthserve serve` arguments for the launched server")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="result file (default: bench/results/soak-<machine>.json)")
    return p.parse_args(argv)


# ---- the server -------------------------------------------------------------------------------------
@contextlib.contextmanager
def tiny_server(arch: str, server_args: str) -> Iterator[str]:
    from depthserve.lab.make_tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="depthserve-soak-") as root:
        path = make_tiny(arch, Path(root) / arch, seed=0)
        with launched_server(str(path), f"--served-model-name tiny-{arch} {server_args}", timeout=600) as base:
            yield base


# ---- request kinds ------------------------------------------------------------------------------------
class Traffic:
    def __init__(self, base: str, model: str, knobs: dict[str, dict], request_schemas: dict[str, dict], seed: int):
        self.base = base
        self.model = model
        self.knobs = knobs
        self.rng = random.Random(seed)
        self.fuzz_bodies = FuzzBodies(request_schemas, seed)
        self.server_errors: list[dict[str, Any]] = []  # the first few 5xx: what was sent, what came back
        self.slowest: list[tuple[float, str, Any]] = []  # (seconds, kind, body) of the slowest answers

    def record_server_error(self, kind: str, path: str, body: Any, status: int, answer: str) -> None:
        if len(self.server_errors) < 10:
            sent = body.decode("utf-8", "replace")[:2000] if isinstance(body, bytes) else body
            self.server_errors.append({"kind": kind, "path": path, "status": status, "sent": sent,
                                       "answer": answer[:2000]})

    def depth(self) -> dict[str, Any]:
        """Random valid settings of a random subset of the model's knobs (their published ranges)."""
        depth: dict[str, Any] = {}
        for name, spec in self.knobs.items():
            if self.rng.random() < 0.5:
                continue
            low, high = spec["minimum"], spec["maximum"]
            if spec["kind"] == "ratio_list":
                depth[name] = [round(self.rng.uniform(low, high), 3) for _ in range(spec["length"])]
            else:
                depth[name] = self.rng.randint(int(low), int(high))
        return depth

    def sampling(self) -> dict[str, Any]:
        rng = self.rng
        fields: dict[str, Any] = {"max_tokens": rng.randint(1, 32), "temperature": rng.choice([0.0, 0.7, 1.0])}
        if rng.random() < 0.3:
            fields["seed"] = rng.randrange(1 << 32)
        if rng.random() < 0.2:
            fields.update(top_p=0.9, top_k=50, repetition_penalty=1.1)
        if rng.random() < 0.2:
            fields["logprobs"] = 2
        return fields

    def completion(self, stream: bool) -> dict:
        words = " ".join(self.rng.choice(["depth", "serve", "token", "cache", "page", "loop"])
                         for _ in range(self.rng.randint(1, 60)))
        return {"model": self.model, "prompt": words, "stream": stream, "depth": self.depth(), **self.sampling()}

    def chat(self) -> dict:
        body = self.completion(stream=True)
        body.pop("logprobs", None)
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        return body

    def bad(self) -> tuple[str, str, Any]:
        """(method, path, body): a dict is sent as JSON, bytes as they are."""
        model = json.dumps(self.model)
        choices = [
            ("POST", "/v1/completions", f'{{"model": {model}, "prompt": "a\\ud800b"}}'.encode()),
            ("POST", "/v1/chat/completions",
             f'{{"model": {model}, "messages": [{{"role": "user", "content": "\\udfff"}}]}}'.encode()),
            ("POST", "/v1/completions", f'{{"model": {model}, "prompt": "x", "temperature": NaN}}'.encode()),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "repetition_penalty": 1e-40}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": "many"}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 10**12}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "top_k": -5}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "depth": {"warp": 9}}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "depth": {"thinking_steps": 99}}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": ["x"] * 500}),
            ("POST", "/v1/completions", {"model": self.model, "prompt": [1, -4]}),
            ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
            ("POST", "/v1/completions", b'{"model": '),
            ("POST", "/v1/completions", b"\xff\xfe"),
            ("POST", "/v1/completions", b"x" * (5 << 20)),
            ("POST", "/tokenize", b'{"prompt": "\\ud834"}'),
            ("GET", "/v1/completions", None),
            ("DELETE", "/nowhere", None),
        ]
        return self.rng.choice(choices)


class FuzzBodies:
    """Request bodies drawn by hypothesis-jsonschema from the server's own request schemas.

    A small first batch is drawn before the traffic starts (200 took 14 s: most of a short run's
    start-up); a background thread keeps drawing more in batches of 200 (drawing in the traffic's
    event loop would stall every worker for seconds). `next` cycles through what has been drawn so far."""

    FIRST = 25
    BATCH = 200
    MOST = 5000

    def __init__(self, request_schemas: dict[str, dict], seed: int):
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
        from hypothesis_jsonschema import from_schema

        self._pool: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self._served = 0
        paths = sorted(request_schemas)
        strategy = st.sampled_from(paths).flatmap(
            lambda path: st.tuples(st.just(path), from_schema(request_schemas[path])))

        def collector(examples: int):
            @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
            @given(strategy)
            def collect(example):
                with self._lock:
                    self._pool.append(example)
            return collect

        self._collect = collector(self.BATCH)
        self._seed = seed
        self._draw_batch(collector(self.FIRST))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_drawing, daemon=True)
        self._thread.start()

    def _draw_batch(self, collect=None) -> None:
        from hypothesis import seed as hypothesis_seed

        hypothesis_seed(self._seed)(collect or self._collect)()
        self._seed += 1

    def _keep_drawing(self) -> None:
        while not self._stop.is_set() and len(self._pool) < self.MOST:
            self._draw_batch()

    def stop(self) -> int:
        """Stop drawing; returns how many distinct bodies were drawn."""
        self._stop.set()
        return len(self._pool)

    def next(self) -> tuple[str, dict]:
        with self._lock:
            body = self._pool[self._served % len(self._pool)]
            self._served += 1
        return body


# ---- one request ----------------------------------------------------------------------------------------
async def send(http: httpx.AsyncClient, traffic: Traffic, kind: str) -> tuple[int | str, float]:
    """(status, or a client-side outcome: 'disconnected', 'timeout', 'error: ...'; seconds)."""
    start = time.perf_counter()
    base = traffic.base
    method, path, body, answer = "POST", "/v1/completions", None, ""
    try:
        if kind in ("stream", "chat", "disconnect"):
            path, body = (("/v1/chat/completions", traffic.chat()) if kind == "chat"
                          else (path, traffic.completion(stream=True)))
            status, answer = await _stream(http, f"{base}{path}", body,
                                           traffic.rng.randint(1, 3) if kind == "disconnect" else None)
        else:
            timeout: float | None = None
            if kind == "complete":
                body = traffic.completion(stream=False)
            elif kind == "timeout":
                body, timeout = {**traffic.completion(stream=False), "max_tokens": 32}, 0.05
            elif kind == "bad":
                method, path, body = traffic.bad()
            else:
                path, body = traffic.fuzz_bodies.next()
            options = {"json": body} if isinstance(body, dict) else {"content": body}
            response = await http.request(method, f"{base}{path}", **options, timeout=timeout or REQUEST_TIMEOUT,
                                          headers={"Content-Type": "application/json"})
            status, answer = response.status_code, response.text
    except httpx.TimeoutException:
        return "timeout", time.perf_counter() - start
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if isinstance(status, int) and status >= 500:
        traffic.record_server_error(kind, path, body, status, answer)
    if isinstance(status, int):
        traffic.slowest = sorted([*traffic.slowest, (seconds, kind, body if isinstance(body, dict) else None)],
                                 key=lambda item: -item[0])[:5]
    return status, seconds


async def _stream(http: httpx.AsyncClient, url: str, body: dict, drop_after: int | None) -> tuple[int | str, str]:
    """(status, or 'disconnected' when the client drops the stream; the error answer, if any)."""
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode("utf-8", "replace")
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line.startswith('data: {"error"'):
                return int(json.loads(line[6:])["error"]["code"]), line
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return "disconnected", ""
    return 200, ""


# ---- the run ------------------------------------------------------------------------------------------
class HealthMonitor:
    def __init__(self, base: str):
        self.base = base
        self.checks = 0
        self.failures = 0
        self.restarts = 0
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HealthMonitor":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        healthy = True
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.5):
                start = time.perf_counter()
                try:
                    ok = http.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.slowest = max(self.slowest, time.perf_counter() - start)
                self.checks += 1
                self.failures += not ok
                self.restarts += healthy and not ok
                healthy = ok


def request_schemas(openapi: dict) -> dict[str, dict]:
    """The JSON body schema of every POST route, with its $refs inlined (hypothesis-jsonschema
    resolves only local definitions)."""
    components = openapi.get("components", {}).get("schemas", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(components[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    schemas = {}
    for path, operations in openapi["paths"].items():
        body = operations.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body and path != "/reset_prefix_cache":
            schemas[path] = inline(body["schema"])
    return schemas


async def traffic_loop(traffic: Traffic, args: argparse.Namespace) -> list[tuple[str, int | str, float]]:
    deadline = time.monotonic() + args.duration
    results: list[tuple[str, int | str, float]] = []
    kinds, weights = list(KINDS), list(KINDS.values())

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and len(results) < args.max_requests:
            kind = traffic.rng.choices(kinds, weights)[0]
            status, seconds = await send(http, traffic, kind)
            results.append((kind, status, seconds))

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        await asyncio.gather(*[worker(http) for _ in range(args.concurrency)])
    return results


def wait_idle(base: str, timeout: float = 60.0) -> dict[str, float]:
    """The server's engine gauges once nothing is running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = metric_values(base)
        if gauges.get("depthserve_requests_running", 0) == 0 and gauges.get("depthserve_requests_waiting", 0) == 0:
            return gauges
        if time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def metric_values(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def server_outcomes(base: str) -> dict[str, float]:
    """The server's own count of finished requests by outcome (depthserve_requests_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "depthserve_requests_total"}


def summary(results: list[tuple[str, int | str, float]]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    grouped: dict[str, list[tuple[int | str, float]]] = defaultdict(list)
    for kind, status, seconds in results:
        grouped[kind].append((status, seconds))
    for kind, items in sorted(grouped.items()):
        answered = sorted(seconds for status, seconds in items if isinstance(status, int))
        by_kind[kind] = {"count": len(items), "by_status": dict(Counter(str(s) for s, _ in items)),
                         "latency_ms": _percentiles(answered)}
    answered = sorted(seconds for _, status, seconds in results if isinstance(status, int))
    return {"total": len(results), "by_status": dict(Counter(str(s) for _, s, _ in results)),
            "latency_ms": _percentiles(answered), "by_kind": by_kind}


def _percentiles(sorted_seconds: list[float]) -> dict[str, float | None]:
    if not sorted_seconds:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": 1000 * common.percentile(sorted_seconds, 50), "p99": 1000 * common.percentile(sorted_seconds, 99),
            "max": 1000 * sorted_seconds[-1]}


def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    model = models[0]["id"]
    schemas = request_schemas(httpx.get(f"{base}/openapi.json", timeout=30).json())
    drawing = time.monotonic()
    traffic = Traffic(base, model, models[0]["depth_knobs"], schemas, args.seed)
    print(f"first {len(traffic.fuzz_bodies._pool)} fuzz bodies drawn in {time.monotonic() - drawing:.1f} s", flush=True)
    started = time.monotonic()
    with HealthMonitor(base) as health:
        results = asyncio.run(traffic_loop(traffic, args))
        fuzz_bodies_drawn = traffic.fuzz_bodies.stop()
        gauges = wait_idle(base)
    requests = summary(results)
    five_xx = sum(count for status, count in requests["by_status"].items() if status.startswith("5"))
    return {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "model": model,
                     "depth_knobs": sorted(models[0]["depth_knobs"])},
        "environment": common.environment("cpu", None),
        "wall_s": round(time.monotonic() - started, 1),
        "requests": requests,
        "five_xx": five_xx,
        "five_xx_examples": traffic.server_errors,
        "slowest_answers": [{"seconds": round(t, 2), "kind": kind, "sent": body} for t, kind, body in traffic.slowest],
        "health": {"checks": health.checks, "failures": health.failures, "slowest_ms": 1000 * health.slowest},
        "engine_restarts": health.restarts,
        "kv_pages_in_use_at_end": gauges.get("depthserve_kv_pages_used"),
        "fuzz_bodies_drawn": fuzz_bodies_drawn,
        "server_requests_total": server_outcomes(base),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        result = run(args, args.base_url)
    else:
        with tiny_server(args.arch, args.server_args) as base:
            result = run(args, base)
    out = args.out or common.RESULTS_DIR / f"soak-{common.device_slug('cpu')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    requests = result["requests"]
    print(f"{requests['total']} requests in {result['wall_s']} s: {requests['by_status']}")
    print(f"p99 latency {requests['latency_ms']['p99']:.0f} ms; 5xx {result['five_xx']}; engine restarts "
          f"{result['engine_restarts']}; KV pages in use at the end {result['kv_pages_in_use_at_end']}; wrote {out}")
    clean = result["five_xx"] == 0 and result["engine_restarts"] == 0 and result["kv_pages_in_use_at_end"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
