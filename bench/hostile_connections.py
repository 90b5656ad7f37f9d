"""Hostile connections against `depthserve serve` (docs/server.md, "Robustness"): how long a client
that sends nothing useful holds a connection, and how soon the server answers others again.

    python bench/hostile_connections.py                    # one process, a tiny Llama
    python bench/hostile_connections.py --replicas 1       # through `serve --replicas 1`

Two phases against one launched server, then its stop:

    slow-bodies  `--slow` connections send headers with Content-Length: 100000, then one body byte
                 every `--trickle-s` seconds: when each is closed, and with what status
    flood        `--flood` connections (past the server's 1,000) send headers declaring a 4 MB body
                 and nothing more; /health is asked 20 times at once (503 expected: over the
                 limit), then until it answers 200: when, and when every flood connection is closed
    stop         SIGTERM: seconds until the server exits, its exit code, and how many of the
                 processes it started (a Ray cluster under --replicas) are still running then

Every phase is bounded by `--phase-limit-s`. Result: bench/results/hostile-connections-*.json.
"""

from __future__ import annotations

import argparse
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving import depthserve_command, wait_until_healthy  # noqa: E402

from depthserve.deploy.ray_serve import descendants, still_running  # noqa: E402
from depthserve.server.connections import ConnectionLimits  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=None, help="serve through `serve --replicas N` (Ray Serve)")
    p.add_argument("--slow", type=int, default=300, help="slow-body connections")
    p.add_argument("--trickle-s", type=float, default=5.0, help="seconds between a slow body's bytes")
    p.add_argument("--flood", type=int, default=1100, help="connections declaring a body they never send")
    p.add_argument("--phase-limit-s", type=float, default=60.0, help="the longest a phase runs")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="result name (default: hostile-connections-<mode>)")
    return p.parse_args(argv)


def open_connections(port: int, count: int, head: bytes) -> dict[socket.socket, float]:
    """`count` connections that have sent `head`, each with the time it was sent."""
    opened = {}
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(head)
        sock.setblocking(False)
        opened[sock] = time.monotonic()
    return opened


def watch_until_closed(opened: dict[socket.socket, float], limit_s: float, trickle_s: float | None
                       ) -> tuple[list[float], dict[str, int]]:
    """Read every connection until the server closes it (sending one byte to each every `trickle_s`
    seconds, if given); the seconds each stayed open after its head, and the statuses answered."""
    selector = selectors.DefaultSelector()
    for sock in opened:
        selector.register(sock, selectors.EVENT_READ, b"")
    held, statuses = [], {}
    answers: dict[socket.socket, bytes] = {}
    started = time.monotonic()
    next_trickle = started + (trickle_s or limit_s)
    while selector.get_map() and time.monotonic() - started < limit_s:
        for key, _ in selector.select(timeout=0.2):
            sock = key.fileobj
            try:
                chunk = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                answers[sock] = answers.get(sock, b"") + chunk
                continue
            held.append(time.monotonic() - opened[sock])
            status = answers.get(sock, b"").split(b" ", 2)[1].decode() if answers.get(sock) else "none"
            statuses[status] = statuses.get(status, 0) + 1
            selector.unregister(sock)
            sock.close()
        if trickle_s and time.monotonic() >= next_trickle:
            for key in list(selector.get_map().values()):
                try:
                    key.fileobj.send(b"a")
                except OSError:
                    pass
            next_trickle += trickle_s
    still_open = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    statuses["still open at the limit"] = still_open
    return held, statuses


def slow_bodies(port: int, args: argparse.Namespace) -> dict:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{")
    held, statuses = watch_until_closed(open_connections(port, args.slow, head), args.phase_limit_s, args.trickle_s)
    return {"connections": args.slow, "trickle_s": args.trickle_s, "held_s": common.summarize(held, (50, 100)),
            "statuses": statuses}


def flood(base: str, port: int, args: argparse.Namespace) -> dict:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4000000\r\n\r\n")
    started = time.monotonic()
    opened = open_connections(port, args.flood, head)
    probes = [_health(base) for _ in range(20)]
    first_ok = None
    while first_ok is None and time.monotonic() - started < args.phase_limit_s:
        if _health(base) == 200:
            first_ok = time.monotonic() - started
        else:
            time.sleep(0.5)
    held, statuses = watch_until_closed(opened, args.phase_limit_s - (time.monotonic() - started), None)
    return {"connections": args.flood, "health_statuses_while_flooded": {str(s): probes.count(s) for s in set(probes)},
            "health_200_again_after_s": first_ok, "held_s": common.summarize(held, (50, 100)), "statuses": statuses}


def _health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def stop(proc: subprocess.Popen, started: dict[int, str]) -> dict:
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return {"signal": "SIGTERM", "exit_after_s": round(time.monotonic() - sent, 2), "exit_code": proc.returncode,
            "processes_started": len(started), "processes_left": len(still_running(started))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from depthserve.lab.make_tiny import make_tiny

    model = make_tiny("llama", Path(tempfile.mkdtemp(prefix="hostile-")) / "tiny", seed=1)
    port = common.free_port()
    extra = f"--dtype float32 --replicas {args.replicas} --ray-cpus 1" if args.replicas else "--dtype float32"
    log = tempfile.NamedTemporaryFile("w+", prefix="hostile-connections-", suffix=".log", delete=False)
    proc = subprocess.Popen(depthserve_command(str(model), extra, port), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, args.start_timeout_s, Path(log.name))
        started = descendants(proc.pid)
        result = {"mode": f"serve --replicas {args.replicas}" if args.replicas else "serve (one process)",
                  "limits": ConnectionLimits().__dict__, "slow_bodies": slow_bodies(port, args),
                  "flood": flood(base, port, args), "stop": stop(proc, started),
                  "environment": common.environment("cpu", None)}
    finally:
        if proc.poll() is None:
            proc.kill()
    name = args.out or ("hostile-connections-" + (f"ray-{args.replicas}" if args.replicas else "one-process"))
    print(f"wrote {common.write_result(name, result)} (server log: {log.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
