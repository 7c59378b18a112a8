"""The scripts in examples/ run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_metrics_and_logging_example_runs_against_the_mock_engine():
    pytest.importorskip("prometheus_client")
    p = subprocess.run([sys.executable, str(EXAMPLES / "metrics_and_logging.py")], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert sorted(line for line in out if line.startswith("req-")) == [
        f"req-{i}: 8 tokens, finish_reason=length" for i in range(4)
    ]
    (late,) = [line for line in out if line.startswith("too-long:")]
    assert "DeadlineExceeded(limit='total', seconds=0.3)" in late
    assert "5 requests, finishes {'length': 4}, aborts 1, deadlines exceeded {'total': 1}" in p.stdout
    assert 'zmqdispatch_requests_total{engine_index="0"} 5.0' in out
    assert 'zmqdispatch_deadlines_exceeded_total{engine_index="0",limit="total"} 1.0' in out
    # logs on stderr only: lifecycle at INFO, the deadline miss at WARNING
    assert "INFO zmqdispatch.client: engine 0 ready" in p.stderr
    assert "WARNING zmqdispatch.client: engine 0: request 'too-long': not finished within 0.3 s" in p.stderr
    assert "zmqdispatch" not in "".join(line for line in out if line.startswith("20"))
