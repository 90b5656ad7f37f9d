"""The 15-second version of bench/soak.py: mixed, partly hostile traffic (streams, disconnects,
client timeouts, known-bad and schema-fuzzed bodies, ITT depth knobs) against a launched server.
No 5xx, no engine restart, no KV page left in use; every kind of request was sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


@pytest.mark.slow
def test_fifteen_seconds_of_mixed_traffic_leave_the_server_clean(tmp_path):
    pytest.importorskip("hypothesis_jsonschema")
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SOAK), "--duration", "15", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert out.is_file(), run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["five_xx"] == 0, result["five_xx_examples"]
    assert result["engine_restarts"] == 0 and result["health"]["failures"] == 0
    assert result["kv_pages_in_use_at_end"] == 0
    by_kind = result["requests"]["by_kind"]
    assert set(by_kind) == {"complete", "stream", "chat", "disconnect", "timeout", "bad", "fuzz"}
    assert by_kind["complete"]["by_status"].get("200", 0) > 0 and by_kind["chat"]["by_status"].get("200", 0) > 0
    assert all(status.startswith("4") for status in by_kind["bad"]["by_status"])
    assert run.returncode == 0, run.stdout + run.stderr
