"""depthserve on Ray Serve (depthserve/deploy/ray_serve.py) on a local Ray cluster: two engine replicas
of SmolLM2 behind one ingress answer like one process, each response names its engine replica and
both serve, the hardening table's bad requests get the same statuses and bodies through the ingress,
a repeated chat prefix stays on one replica and hits its prefix cache, a client that goes away
aborts its request, a replica killed mid-stream ends its streams with an error event (never a hang
or a clean end) while streams on the other replica finish, Serve replaces it and later requests
succeed, and a request queued on a killed replica completes on the other. Skipped where Ray Serve is not
installed (`depthserve[ray]`, which `make test` installs). The ingress's retry and router logic
without a cluster: test_remote_engine.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra depthserve[ray]")
serve = pytest.importorskip("ray.serve")

from depthserve import LLM, SamplingParams  # noqa: E402
from depthserve.config import EngineArgs  # noqa: E402
from depthserve.deploy.ray_serve import (APP_NAME, ENGINE_DEPLOYMENT, REPLICA_HEADER, ReplicaSettings, Scaling,  # noqa: E402
                                         application, build, descendants, still_running)
from depthserve.errors import ConfigurationError  # noqa: E402
from depthserve.server.connections import ConnectionLimits  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.live_server import free_port  # noqa: E402
from tests.test_server import API_KEY, BAD_REQUESTS, MODEL  # noqa: E402

pytestmark = pytest.mark.slow
ENGINE = dict(model=MODEL, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.1, load_progress=False,
              num_threads=1)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of this machine's 2 CPUs, Serve's HTTP proxy on a free port, two replicas
    (one CPU and one torch thread each; the same engine settings as tests/test_server.py)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ReplicaSettings(EngineArgs(**ENGINE), api_key=API_KEY, depth_presets={"plain": {}})
    serve.run(application(settings, Scaling(replicas=2, health_check_period_s=1.0)), name=APP_NAME,
              route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _serve_configs() -> dict[str, dict]:
    """The repo's Serve configs: the config file, and the one inside the KubeRay RayService manifest."""
    import yaml

    service = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    return {"serve-config.yaml": yaml.safe_load((DEPLOY / "serve-config.yaml").read_text()),
            "kuberay-rayservice.yaml": yaml.safe_load(service["spec"]["serveConfigV2"])}


@pytest.mark.parametrize("name", ["serve-config.yaml", "kuberay-rayservice.yaml"])
def test_the_deployment_files_are_serve_configs_that_build(name):
    """Each file passes Ray Serve's own config schema, and its import path builds the application from
    its args (no cluster needed)."""
    from ray.serve.schema import ServeDeploySchema

    config = _serve_configs()[name]
    ServeDeploySchema.parse_obj(config)
    for app in config["applications"]:
        module, attribute = app["import_path"].split(":")
        built = getattr(importlib.import_module(module), attribute)(app["args"])
        assert isinstance(built, serve.Application)


def test_the_builder_refuses_unknown_args():
    with pytest.raises(ConfigurationError, match="frobnicate"):
        build({"model": MODEL, "frobnicate": 1})


@contextlib.contextmanager
def _serve_replicas(tmp_path: Path, *options: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`depthserve serve --replicas 1 [options]` of a tiny model on a local cluster of one CPU, in a
    session of its own (a terminal's Ctrl-C reaches its whole process group), until it answers
    /health; yields the process, its URL and its log. Killed with its processes at the end if still
    running."""
    tiny = make_tiny("llama", tmp_path / "tiny", seed=1)
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "depthserve", "serve", "--model", str(tiny), "--dtype", "float32",
             "--replicas", "1", "--ray-cpus", "1", "--port", str(port), "--api-key", API_KEY, *options],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _answers(f"{base}/health"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1.0)
        yield process, base, log
    finally:
        if process.poll() is None:
            leftovers = descendants(process.pid)
            process.kill()
            process.wait()
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _closed_after(sock: socket.socket, trickle: bytes, within: float) -> tuple[float, bytes]:
    """Send `trickle` a byte a second until the server closes the connection (within `within`
    seconds, else fail); when it closed and what it sent."""
    started, answer = time.monotonic(), b""
    sock.setblocking(False)
    for byte in itertools.cycle(trickle or b"\0"):
        assert time.monotonic() - started < within, answer
        if trickle:
            with contextlib.suppress(OSError):
                sock.send(bytes([byte]))
        ready, _, _ = select.select([sock], [], [], 1.0)
        if ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return time.monotonic() - started, answer
            answer += chunk
    raise AssertionError("unreachable")


def _socket(base: str, head: bytes) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head)
    return sock


def _stopped_cleanly(process: subprocess.Popen, log: Path, cluster: dict[int, str], seconds: float) -> None:
    started = time.monotonic()
    process.wait(timeout=60)
    took = time.monotonic() - started
    output = log.read_text()
    assert process.returncode == 0 and "Traceback" not in output and "Error" not in output, output[-3000:]
    assert took < seconds, took
    left = still_running(cluster)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left]


def test_serve_replicas_holds_the_connection_deadlines_and_stops_on_sigterm(tmp_path):
    """Through `serve --replicas` (its HTTP served with the one-process server's deadlines, not Serve's
    proxy, set by its flags): header bytes trickled, an idle kept-alive connection and a body
    trickled after a Content-Length of 100000 are closed on their deadlines (the body with a JSON
    408); a non-ASCII bearer token is a JSON 401 and two Authorization headers a JSON 400; SIGTERM
    then ends the server within 15 s (exit 0, no traceback) and every process of its Ray cluster
    with it. The deadlines are shorter than the defaults (test_cli.py checks the flags' defaults are
    ConnectionLimits'), so the test waits seconds, not the default 20 s of a body."""
    limits = ConnectionLimits(header_timeout_s=4.0, body_timeout_s=6.0, keep_alive_s=2.0)
    flags = ("--header-timeout", str(limits.header_timeout_s), "--body-timeout", str(limits.body_timeout_s),
             "--timeout-keep-alive", str(limits.keep_alive_s))
    with _serve_replicas(tmp_path, *flags) as (process, base, log):
        cluster = descendants(process.pid)
        assert any(Path(f"/proc/{pid}/comm").read_text().strip() == "raylet" for pid in cluster)
        checks = {
            "headers": (_socket(base, b"GET /health HTTP/1.1\r\nHost: x\r\n"), b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaa",
                        limits.header_timeout_s),
            "idle": (_socket(base, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"), b"", limits.keep_alive_s),
            "body": (_socket(base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n"),
                     b'{"prompt": "' + b"a" * 64, limits.body_timeout_s),
        }
        with concurrent.futures.ThreadPoolExecutor(len(checks)) as pool:
            closed = dict(zip(checks, pool.map(lambda check: _closed_after(check[0], check[1], check[2] + 5),
                                               checks.values())))
        for name, (sock, _, timeout) in checks.items():
            sock.close()
            assert timeout - 1 <= closed[name][0] <= timeout + 3, (name, closed[name])
        assert closed["idle"][1].startswith(b"HTTP/1.1 200 OK")
        head, _, body = closed["body"][1].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == 408

        for headers, status in (([("Authorization", b"Bearer \xe9")], 401),
                                ([("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer x")], 400)):
            response = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers,
                                  timeout=30)
            assert response.status_code == status and response.json()["error"]["code"] == status, response.text
        assert _complete(base, {"model": str(tmp_path / "tiny"), "prompt": "Hi", "max_tokens": 2}).status_code == 200
        process.send_signal(signal.SIGTERM)
        _stopped_cleanly(process, log, cluster, seconds=15)


def test_serve_replicas_stops_on_ctrl_c(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole process group): the server ends within 15 s, exit 0,
    no traceback, no process of its Ray cluster left."""
    with _serve_replicas(tmp_path) as (process, _, log):
        cluster = descendants(process.pid)
        os.killpg(process.pid, signal.SIGINT)
        _stopped_cleanly(process, log, cluster, seconds=15)


def _complete(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=120)


def test_two_replicas_answer_like_one_process_and_both_serve(cluster):
    """Seeded sampled completions sent concurrently, and a streamed chat: the same tokens as the
    offline engine gives each request alone; the replica header shows both replicas answered."""
    prompts = [f"Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl", "eel", "yak")]
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0.8, "seed": 100 + i} for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: _complete(cluster, body), bodies))
    offline = LLM(**{k: v for k, v in ENGINE.items() if k != "num_threads"})
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        expected = offline.generate([body["prompt"]], SamplingParams(temperature=0.8, seed=body["seed"], max_tokens=12))
        assert response.json()["choices"][0]["text"] == expected[0].text
    replicas = {r.headers[REPLICA_HEADER] for r in responses}
    # Serve's router may favour one replica under light load, and on a loaded machine (the other test
    # worker compiling) one replica answered every request for a while: ask until both answered
    deadline = time.monotonic() + 60
    while len(replicas) < 2 and time.monotonic() < deadline:
        replicas.add(_complete(cluster, {"prompt": "Hi", "max_tokens": 1}).headers[REPLICA_HEADER])
        time.sleep(0.2)
    assert len(replicas) == 2

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", json=chat, headers=AUTH, timeout=120) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    prompt = offline.apply_chat_template(chat["messages"])
    assert text == offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].text


@pytest.mark.parametrize("path, body, headers, status, err_type, words", BAD_REQUESTS)
def test_bad_requests_get_the_same_errors_through_the_ingress(cluster, path, body, headers, status, err_type,
                                                              words):
    response = httpx.post(f"{cluster}{path}", json=body, headers=AUTH if headers is None else headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == err_type and error["code"] == status and words.lower() in error["message"].lower()


def test_hostile_constraints_get_the_same_400_from_every_replica(cluster):
    """Issue 51's constraints that were a 500 or an empty 200 (tests/test_server_structured.py has
    them all): sent four times through the ingress, wherever routed, the same 400 naming the field."""
    endless = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                               "required": ["next"]}}, "$ref": "#/$defs/n"}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": endless}}},
              "response_format.json_schema.schema"),
             ({"structured_outputs": {"grammar": r"start: /[^\s\S]/"}}, "structured_outputs.grammar"),
             ({"structured_outputs": {"regex": "\\"}}, "structured_outputs.regex")]
    for fields, field in cases:
        answers = [_complete(cluster, {"prompt": "Go:", "max_tokens": 8, **fields}) for _ in range(4)]
        assert all(answer.status_code == 400 for answer in answers), [answer.text for answer in answers]
        error = answers[0].json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == field
        assert all(answer.json() == answers[0].json() for answer in answers)


def test_a_repeated_chat_prefix_stays_on_one_replica_and_hits_its_cache(cluster):
    """Chats sharing a long system prompt, one after another: all on the replica that took the first,
    every later one reusing its cached prompt blocks; after /reset_prefix_cache (every replica) the
    next one computes its prompt afresh."""
    system = ("You are a librarian in a small town. You answer questions about books, opening hours and "
              "the reading club, briefly and kindly, and you never invent titles. ") * 3

    def chat(question: str) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        return httpx.post(f"{cluster}/v1/chat/completions", json=body, headers=AUTH, timeout=120)

    questions = ["When do you open?", "Is there a reading club?", "Do you lend DVDs?", "Can I renew online?"]
    answers = [chat(q) for q in questions]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 1
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    prompt = answers[0].json()["usage"]["prompt_tokens"]
    assert all(c >= prompt // 2 for c in cached[1:]), (cached, prompt)  # the system prompt's blocks
    assert _metric(cluster, "depthserve_prefix_cache_hits_total") > 0  # the replicas' latest reports
    assert httpx.post(f"{cluster}/reset_prefix_cache", headers=AUTH, timeout=60).status_code == 200
    assert chat(questions[0]).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(cluster):
    """The ingress cancels the engine call when the client disconnects; the replica aborts the request
    (its running count, reported to the ingress's /metrics, returns to 0)."""
    body = {"model": MODEL, "prompt": "Tell me everything about rivers.", "max_tokens": 600, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, headers=AUTH, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 15
        while _metric(cluster, "depthserve_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _metric(cluster, "depthserve_requests_running") >= 1
    deadline = time.monotonic() + 20
    while _metric(cluster, "depthserve_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(cluster, "depthserve_requests_running") == 0


REPLICA_ACTOR = f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#"


def _running_replicas() -> int:
    states = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT].replica_states
    return states.get("RUNNING", 0)


def _replica_actors() -> list[str]:
    """The names of the live replica actors (Serve's own naming: SERVE_REPLICA::app#deployment#id)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(REPLICA_ACTOR)]


def _data_lines(lines) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


def test_a_killed_replica_ends_its_streams_with_an_error_event_and_serve_replaces_it(cluster):
    """Kill one engine replica's actor while it streams: its stream ends with an error event (no [DONE])
    within a bound, a stream on the other replica finishes, later requests succeed, and Serve brings
    the deployment back to two replicas."""
    def body(prompt: str, tokens: int) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True}

    started = time.monotonic()
    with httpx.Client(headers=AUTH, timeout=60) as client, \
            client.stream("POST", f"{cluster}/v1/completions", json=body("Count: one, two, three,", 400)) as doomed:
        victim = doomed.headers[REPLICA_HEADER]
        doomed_lines = doomed.iter_lines()
        next(line for line in doomed_lines if line.startswith("data: "))  # it is streaming
        with contextlib.ExitStack() as others:
            # the router sends a new prefix to the less busy replica: the one not streaming already
            bystander = None
            for attempt in range(6):
                stream = others.enter_context(client.stream(
                    "POST", f"{cluster}/v1/completions", json=body(f"List {attempt} colours:", 24)))
                if stream.headers[REPLICA_HEADER] != victim:
                    bystander = stream
                    break
            assert bystander is not None
            ray.kill(ray.get_actor(REPLICA_ACTOR + victim, namespace="serve"), no_restart=True)
            rest = _data_lines(doomed_lines)
            finished = _data_lines(bystander.iter_lines())
    assert time.monotonic() - started < 60
    assert rest and "data: [DONE]" not in rest, rest[-2:]
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == 503 and f"replica {victim}" in error["message"]
    assert finished[-1] == "data: [DONE]"
    assert _complete(cluster, {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    deadline = time.monotonic() + 120
    replaced = lambda: (_running_replicas() == 2 and len(_replica_actors()) == 2  # noqa: E731
                        and REPLICA_ACTOR + victim not in _replica_actors())
    while time.monotonic() < deadline and not replaced():
        time.sleep(1.0)
    assert replaced(), (serve.status(), _replica_actors())
    statuses = {_complete(cluster, {"prompt": "Hi", "max_tokens": 2}).status_code for _ in range(4)}
    assert statuses == {200}
    assert httpx.get(f"{cluster}/health", timeout=10).json() == {"status": "ok"}


def test_a_request_queued_on_a_replica_that_dies_is_retried_on_the_other(cluster):
    """Replicas that run one sequence at a time: a second chat with the first one's prefix is routed to
    the same replica and waits there (admitted, no output yet); killing that replica ends the first
    stream with an error event and the second request completes on the other replica. Replaces the
    module's application (as the autoscaling test after it does)."""
    serve.delete(APP_NAME)
    settings = ReplicaSettings(EngineArgs(**ENGINE, max_num_seqs=1), api_key=API_KEY)
    serve.run(application(settings, Scaling(replicas=2, health_check_period_s=1.0)), name=APP_NAME, route_prefix="/")
    prompt = "The history of the river, from its source in the mountains to the sea, told in detail:"
    first = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    queued: dict = {}

    def second() -> None:
        queued["response"] = _complete(cluster, {"prompt": prompt + " Part two.", "max_tokens": 8})

    with httpx.stream("POST", f"{cluster}/v1/completions", json=first, headers=AUTH, timeout=60) as stream:
        victim = stream.headers[REPLICA_HEADER]
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(3.0)  # admitted behind the running stream on the same replica
        assert "response" not in queued
        ray.kill(ray.get_actor(REPLICA_ACTOR + victim, namespace="serve"), no_restart=True)
        rest = _data_lines(lines)
    waiter.join(timeout=120)
    assert rest and '"error"' in rest[-1] and "data: [DONE]" not in rest
    response = queued["response"]
    assert response.status_code == 200, response.text
    assert response.headers[REPLICA_HEADER] == victim + "," + response.headers[REPLICA_HEADER].split(",")[-1]
    assert response.headers[REPLICA_HEADER].split(",")[-1] != victim


def test_depth_knobs_presets_and_reports_through_the_ingress_equal_one_process(cluster):
    """A depth model (demo-dreamer) on two replicas: a fixed depth, a preset and a per-token depth range
    give the text, the per-token depths and usage.depth that the one-process server gives. Replaces
    the module's application (as the tests after it do)."""
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.server.app import build_app
    from tests.live_server import live_server

    serve.delete(APP_NAME)
    demo = dict(model="demo-dreamer", dtype="float32", max_model_len=64, load_progress=False)
    presets = {"deep": {"depth": 6}}
    settings = ReplicaSettings(EngineArgs(**demo, num_threads=1), depth_presets=presets)
    serve.run(application(settings, Scaling(replicas=2)), name=APP_NAME, route_prefix="/")
    prompt = "k=3 c=7 p=k w=1 m=w d=p y=c t=y t?"
    bodies = [{"model": "demo-dreamer", "depth": {"depth": 2}}, {"model": "demo-dreamer:deep"},
              {"model": "demo-dreamer", "depth": {"depth": {"min": 1, "max": 6}}}]

    def answers(base: str) -> list[dict]:
        replies = [httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **body}) for body in bodies]
        assert all(r.status_code == 200 for r in replies), replies[0].text
        return [{"choices": [(c["text"], c.get("token_depths")) for c in r.json()["choices"]],
                 "depth": r.json()["usage"]["depth"]} for r in replies]

    through_ray = answers(cluster)
    local = AsyncLLM.from_engine_args(EngineArgs(**demo), depth_presets=presets)
    with live_server(build_app(local, depth_presets=presets)) as base:
        in_one_process = answers(base)
    assert through_ray == in_one_process
    assert through_ray[1]["depth"]["depth"] == 6 and through_ray[2]["choices"][0][1]  # per-token depths given


def _wait_for_replicas(count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _running_replicas() == count and len(_replica_actors()) == count:
            return True
        time.sleep(0.5)
    return False


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(cluster, tmp_path):
    """One replica of a tiny model that may scale to two (target 2 ongoing requests, short delays): eight
    clients streaming at once bring the second replica, which then answers; idle, it goes again. Runs
    last: it replaces the module's application (the cluster's two CPUs)."""
    serve.delete(APP_NAME)
    tiny = make_tiny("llama", tmp_path / "tiny", seed=1)
    settings = ReplicaSettings(EngineArgs(model=str(tiny), dtype="float32", num_threads=1, load_progress=False))
    scaling = Scaling(replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1.0,
                      downscale_delay_s=3.0, look_back_period_s=2.0, metrics_interval_s=0.5,
                      health_check_period_s=1.0)
    serve.run(application(settings, scaling), name=APP_NAME, route_prefix="/")
    assert _wait_for_replicas(1, 30)
    stop, answered_by, failures = threading.Event(), set(), []

    def client():
        while not stop.is_set():
            response = httpx.post(f"{cluster}/v1/completions", timeout=60, json={
                "model": str(tiny), "prompt": "Hello", "max_tokens": 48, "ignore_eos": True})
            if response.status_code != 200:
                failures.append(response.text)
            answered_by.add(response.headers.get(REPLICA_HEADER))

    clients = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for thread in clients:
        thread.start()
    try:
        assert _wait_for_replicas(2, 90), serve.status()
        deadline = time.monotonic() + 30
        while len(answered_by) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(answered_by) == 2
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
    assert not failures, failures[:3]
    assert _wait_for_replicas(1, 90), serve.status()
