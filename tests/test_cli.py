"""The command line as a user meets it: every error is one line on stderr and exit code 2, found
before any model loads where it can be; `depthserve chat` understands /exit, /clear and
multi-line input; `serve` prints its start-up banner once logging is set up."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("uvicorn")

from depthserve.config import EngineArgs  # noqa: E402
from depthserve.engine.async_llm import AsyncLLM  # noqa: E402
from depthserve.engine.llm_engine import LLMEngine  # noqa: E402
from depthserve.server.app import build_app  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.live_server import free_port, live_server, metric_value, wait_for_log_lines, wait_idle  # noqa: E402


def _cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "depthserve", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("args, words", [
    (["serve", "--model", "/nonexistent"], "unknown model '/nonexistent'"),
    (["generate", "hi", "--model", "/nonexistent"], "unknown model '/nonexistent'"),
    (["serve", "--depth-preset", "deep={loops: 9}"], "not JSON"),
    (["serve", "--depth-preset", 'deep={"loop": 9}'], "unknown depth knob"),
    (["generate", "hi", "--depth", "{loops:2}"], "not JSON"),
    (["generate", "hi", "--depth", "[2]"], "JSON object"),
    (["chat", "--depth", "{loops:2}"], "not JSON"),
    (["serve", "--max-num-seqs", "many"], "invalid int value"),
    (["serve", "--port", "99999"], "--port must be between 1 and 65535, got 99999"),
    (["serve", "--max-model-len", "-5"], "max_model_len must be positive, got -5"),
    (["generate", "hi", "--max-model-len", "0"], "max_model_len must be positive, got 0"),
    (["serve", "--max-body-mb", "-1"], "--max-body-mb must be positive, got -1.0"),
    (["serve", "--max-waiting-requests", "-3"], "--max-waiting-requests must be 0 or more"),
    (["serve", "--body-timeout", "0"], "--body-timeout must be a positive number of seconds, got 0.0"),
    (["serve", "--num-threads", "0"], "num_threads must be positive, got 0"),
    (["serve", "--host", "999.1.1.1", "--port", "8131"], "--host '999.1.1.1' is not an address"),
], ids=["serve-model", "generate-model", "preset-json", "preset-knob", "generate-depth", "generate-depth-list",
        "chat-depth", "bad-int", "port-range", "max-model-len", "generate-max-model-len", "max-body",
        "max-waiting", "body-timeout", "threads", "bad-host"])
def test_cli_errors_are_one_line_and_exit_2_before_loading(args, words):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "engine ready" not in result.stderr and "Traceback" not in result.stderr


def test_serve_flags_set_the_connection_deadlines_and_default_to_the_servers():
    from depthserve.server.connections import ConnectionLimits
    from depthserve.tools.cli import build_parser, connection_limits

    assert connection_limits(build_parser().parse_args(["serve"])) == ConnectionLimits()
    flags = ["serve", "--header-timeout", "3", "--body-timeout", "7.5", "--timeout-keep-alive", "1"]
    assert connection_limits(build_parser().parse_args(flags)) == ConnectionLimits(
        header_timeout_s=3.0, body_timeout_s=7.5, keep_alive_s=1.0)


def test_serve_on_a_port_in_use_fails_before_loading(busy_port):
    result = _cli("serve", "--port", str(busy_port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: port {busy_port} on 127.0.0.1 is already in use (choose another with --port)"]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, smollm_tokenizer):
    path = make_tiny("llama", tmp_path_factory.mktemp("cli") / "llama", seed=3, tokenizer=smollm_tokenizer)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", load_progress=False,
                                        block_size=8, kv_cache_memory_gib=0.02)))
    with live_server(build_app(llm, served_model_name="tiny")) as base:
        yield base, llm


def test_chat_commands_and_multiline_input(tiny_server):
    """Two messages reach the model (one line, then three lines between \"\"\" marks); /clear, an
    unknown /command and /exit do not, and nothing after /exit is sent. Replies cut by --max-tokens
    say so."""
    base, llm = tiny_server
    before = metric_value(base, "depthserve_requests_total", outcome="success")
    script = 'hello\n/foo\n/clear\n"""\nline one\nline two\nline three\n"""\n/exit\nnot sent\n'
    result = _cli("chat", "--url", base, "--max-tokens", "3", "--temperature", "0", stdin=script)
    assert result.returncode == 0, result.stderr
    assert "(conversation cleared)" in result.stdout and "(unknown command /foo;" in result.stdout
    assert result.stdout.count("(cut at --max-tokens)") == 2, result.stdout
    wait_idle(llm)
    assert metric_value(base, "depthserve_requests_total", outcome="success") == before + 2


def test_chat_with_a_model_the_server_does_not_serve_fails_at_once(tiny_server):
    base, _ = tiny_server
    result = _cli("chat", "--url", base, "--model", "nosuch", stdin="hello\n")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {base} serves no model 'nosuch'; it serves ['tiny']"]


def test_chat_with_no_server_listening_says_so_without_a_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    for model in ([], ["--model", "nosuch"]):
        result = _cli("chat", "--url", url, *model, stdin="hello\n")
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach {url}: "), result.stderr


def test_serve_prints_its_banner(tmp_path, smollm_tokenizer):
    """The engine's start-up line (model, architecture, device, KV capacity, capped context, depth
    knobs) and the serving line with the URL reach the log before the server answers."""
    path = make_tiny("sgt", tmp_path / "sgt", seed=1, tokenizer=smollm_tokenizer)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "depthserve", "serve", "--model", str(path), "--port", str(port), "--device", "cpu",
         "--max-model-len", "100000", "--kv-cache-memory-gib", "0.02", "--depth-preset", 'deep={"loops": 2}'],
        stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "Uvicorn running" in line or "Application startup complete" in line:
                break
        log = "".join(lines)
    finally:
        process.terminate()
        process.wait(timeout=60)
    from depthserve.loading.quantization import cpu_features

    # --dtype auto: a checkpoint this small is served in fp32 on every CPU (SMALL_WEIGHTS_BYTES)
    assert "engine ready:" in log and f"(sgt) on cpu/float32 ({cpu_features()})" in log, log
    assert "quantization none: 0 linear weights quantized" in log, log
    assert "KV pages" in log and "(capped from 100000: the model's context)" in log and "depth knobs: loops 0.." in log
    assert "depth policy fixed, decode steps" in log, log
    assert f"at http://127.0.0.1:{port}" in log and f"{path}:deep" in log


def test_ctrl_c_in_chat_stops_the_reply_and_returns_to_the_prompt(tiny_server):
    """SIGINT while a reply streams: the reply stops ("(stopped)"), the request is aborted on the
    server (no page left in use), and the chat goes on to the next prompt."""
    base, llm = tiny_server
    # A reply long enough (900 of the 1024 positions) that it is still streaming when the signal lands.
    # SIGINT as a terminal delivers it: a suite run as a background job inherits SIGINT ignored (the
    # shell's rule for `&`), and Python then installs no KeyboardInterrupt handler in the child.
    process = subprocess.Popen([sys.executable, "-m", "depthserve", "chat", "--url", base, "--max-tokens", "900",
                                "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=0,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    output = []
    reader = threading.Thread(target=lambda: output.extend(iter(lambda: process.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        process.stdin.write("tell me everything\n")
        process.stdin.flush()
        deadline = time.monotonic() + 60
        while len("".join(output).partition("> ")[2]) < 5:  # the reply has started
            assert time.monotonic() < deadline, "".join(output)
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        process.stdin.write("/exit\n")
        process.stdin.flush()
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        process.kill()
    reader.join(timeout=10)
    assert "(stopped)" in "".join(output)
    wait_idle(llm)
    assert llm.engine.block_manager.num_used_pages == 0


def test_generate_prints_the_depth_report_of_a_depth_model(tmp_path, smollm_tokenizer):
    path = make_tiny("sgt", tmp_path / "sgt", seed=1, tokenizer=smollm_tokenizer)
    result = _cli("generate", "Hello", "--model", str(path), "--max-tokens", "3", "--depth", '{"loops": 2}')
    assert result.returncode == 0, result.stderr
    report = [line for line in result.stderr.splitlines() if line.startswith("depth (sgt): ")]
    assert len(report) == 1 and 'loops={"1":2,' in report[0] and "relative_compute=" in report[0], result.stderr


def test_help_lists_every_command_without_importing_torch():
    code = ("import sys; from depthserve.tools.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("False"), result.stdout
    for command in ("models", "generate", "serve", "chat", "make-tiny", "calibrate", "import-sgt", "graft-sgt"):
        assert command in result.stdout


def test_the_engine_logs_a_stats_line_while_busy(tiny_server, monkeypatch, caplog):
    import httpx

    from depthserve.engine import async_llm

    base, llm = tiny_server
    monkeypatch.setattr(async_llm, "STATS_INTERVAL_S", 0.0)
    with caplog.at_level("INFO", logger="depthserve"):
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        wait_idle(llm)
        access = wait_for_log_lines(caplog, "depthserve.server", lambda line: "POST /v1/completions 200 in" in line)
    lines = [r.getMessage() for r in caplog.records if r.name == "depthserve.async_llm"]
    assert any("requests; prompt" in line and "generation" in line and "KV cache" in line
               and "mean relative compute x1.00" in line for line in lines), lines
    assert any("POST /v1/completions 200 in" in line for line in access), access
    assert any(re.search(r"success: \d+ prompt \+ 4 generated tokens, first token at \d+ ms", line)
               for line in access), access
