"""Every script in ``examples/`` and every ``python`` block of the README and of
``docs/`` runs as written (each launches the mock engine when no address is
given)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
SNIPPETS = [
    (f"{doc.relative_to(ROOT)}[{i}]", block)
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S))
]

def _metrics_and_logging(out: str) -> None:
    lines = out.splitlines()
    assert sorted(line for line in lines if line.startswith("req-")) == [
        f"req-{i}: 8 tokens, finish_reason=length" for i in range(4)
    ]
    (late,) = [line for line in lines if line.startswith("too-long:")]
    assert "DeadlineExceeded(limit='total', seconds=0.3)" in late
    assert "5 requests, finishes {'length': 4}, aborts 1, deadlines exceeded {'total': 1}" in out
    assert 'zmqdispatch_requests_total{engine_index="0"} 5.0' in lines
    assert 'zmqdispatch_deadlines_exceeded_total{engine_index="0",limit="total"} 1.0' in lines


def _control_plane(out: str) -> None:
    for line in ("engine: vLLM 0.32.0+zmqdispatch.mock (known)", "sleeping: True", "fully awake: True",
                 "paused: True", "running request ended with: ABORT", "prefix cache reset: True",
                 "workers healthy: [None]"):
        assert line in out, out
    assert "pause_generation: " in out and "0.33" in out
    assert "add_lora: " in out and "LoRA is not enabled" in out
    served = next(x for x in out.splitlines() if x.startswith("served after resume:"))
    assert len(served.split(":", 1)[1].strip("[] ").split(",")) == 4


def _asyncio_server(out: str) -> None:
    lines = out.splitlines()
    assert lines[0] == "HTTP/1.1 200 OK"
    deltas = [json.loads(x) for x in lines[1:] if x.startswith("{")]
    assert sum(len(d.get("token_ids", ())) for d in deltas) == 6
    assert deltas[-1] == {"finish_reason": "length"}
    refused = 'HTTP/1.1 400 Bad Request {"error": "input_ids: expected a list of token ids", "field": "input_ids"}'
    assert refused in lines
    assert lines[-1] == "aborted after the client left: 1"


def _multimodal(out: str) -> None:
    first, second = out.splitlines()
    assert re.fullmatch(r"img-1: sent pixels, tokens \[(\d+, ){7}\d+\]", first), out
    # the second time the engine's receiver cache supplies the image: the same tokens
    assert second == first.replace("img-1: sent pixels", "img-2: sent a cache reference"), out


def _tokenspeed_multimodal(out: str) -> None:
    padded, tokens, refused = out.splitlines()
    ids = [int(x) for x in padded.removeprefix("img-1: input_ids [").rstrip("]").split(", ")]
    pad = ids[2]
    assert ids == [1, 4, pad, pad, pad, pad, 5, 6] and 1_000_000 <= pad < 2**31, out  # the image's pad value
    assert re.fullmatch(r"img-1: tokens \[(\d+, ){7}\d+\]", tokens), out
    assert refused == "vid-1: refused, field mm_inputs.items[0].modality", out


#: What each example must print (a regex over its stdout, or a check), beyond exiting 0.
EXPECTED = {
    "asyncio_generate.py": r"complete \[(\d+, ){7}\d+\]\ntokens per task: \[4, 4, 4, 4\]",
    "asyncio_server.py": _asyncio_server,
    "generate.py": r"complete \[(\d+, ){7}\d+\]",
    "parallel_samples.py": r"(?m)(^[0-2] \[(\d+, ){5}\d+\] length\n){3}",
    "many_streams.py": r"100 requests, 1600 tokens",
    "many_engines.py": r"request 'pinned' pinned to rank 1: 8 tokens\nrequests per engine: \{0: \d, 1: \d\}\n"
                       r"states: \[\(0, 'draining'\), \(1, 'up'\)\]",
    "tokenspeed.py": r"(?m)(^[01] \[(\d+, ){7}\d+\] length\n){2}",
    "sglang.py": r"engine: SGLang 0\.5\.21\+zmqdispatch\.mock\n"
                 r"(?:[01] \[(\d+, ){7}\d+\] length 2 candidates per token\n){2}"
                 r"named stop: \[(\d+, ){0,3}(?P<stop>\d+)\] stop matched_token_id (?P=stop)\n"
                 r"flush_cache: ''\nstart_profile: ''\nstop_profile: ''",
    "control_plane.py": _control_plane,
    "multimodal.py": _multimodal,
    "tokenspeed_multimodal.py": _tokenspeed_multimodal,
    "metrics_and_logging.py": _metrics_and_logging,
}

#: What each example must log on stderr (its logs never go to stdout).
EXPECTED_STDERR = {
    "metrics_and_logging.py": ("INFO zmqdispatch.client: engine 0 ready",
                               "WARNING zmqdispatch.client: engine 0: request 'too-long': not finished within 0.3 s"),
}


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_as_written(path: Path) -> None:
    p = run([sys.executable, str(path)], ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stdout.strip()
    expected = EXPECTED[path.name]
    if callable(expected):
        expected(p.stdout)
    else:
        assert re.search(expected, p.stdout), p.stdout
    for line in EXPECTED_STDERR.get(path.name, ()):
        assert line in p.stderr, p.stderr


def test_every_example_has_its_expectation() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in EXAMPLES)


#: What a snippet must print (its whitespace-separated words), beyond exiting 0.
SNIPPET_STDOUT = {
    "docs/control-plane.md[0]": ["vLLM", "0.32.0+zmqdispatch.mock", "True", "True", "True"],
}


#: What a snippet containing the key must print (a regex over its stdout).
SNIPPET_PRINTS = {
    '"serve-grpc"': r"(?m)\A([01] \[(\d+, ){7}\d+\] length\n){2}\Z",  # the README's gRPC client: n = 2 completes
    # the README's asyncio client: the finish reason by name on the last delta, not FinishReason's number
    "aio.connect(launch=MOCK)": r"\A(\[\d+(, \d+)*\] \n)+\[\d+(, \d+)*\] length\n\Z",
}


@pytest.mark.parametrize("name,snippet", SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_snippet_runs_as_written(name: str, snippet: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, f"{name}:\n{snippet}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr
    if name in SNIPPET_STDOUT:
        assert p.stdout.split() == SNIPPET_STDOUT[name]
    for key, pattern in SNIPPET_PRINTS.items():
        if key in snippet:
            assert re.search(pattern, p.stdout), p.stdout


def test_the_docs_have_their_snippets() -> None:
    names = [name for name, _ in SNIPPETS]
    assert "README.md[0]" in names
    assert sum(n.startswith("docs/operations.md") for n in names) == 4
    assert "docs/control-plane.md[0]" in names
