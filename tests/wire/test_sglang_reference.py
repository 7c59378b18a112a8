"""Cross-check against SGLang 0.5.21's own structs and the SGLang plugin's decoder.

``scripts/sglang_reference.py`` (run under this interpreter, in a subprocess) loads
SGLang's ``SamplingParams`` and the class statements of its ``io_struct`` request
structs from the pinned wheel, and the plugin's ``zmq_msgpack`` over them
(``smg-grpc-servicer`` 0.14.1). These tests:

- regenerate the golden vectors and require ``tests/wire/vectors/sglang_0.5.21.json``
  unchanged (the later releases' layouts in it come from their sources:
  ``vectors --layouts-from 0.5.22=DIR --layouts-from 0.5.23=DIR`` rewrites them);
- send requests built here (random, seeded) through the plugin's own
  ``decode_request_frames`` and validation (``normalize`` + ``verify``, the ``n`` and
  empty-prompt refusals), and require SGLang's decoded fields to be ours, derived.

Skipped unless ``ZMQD_SGLANG_PATH`` names the unzipped wheels
(``eval "$(scripts/install_sglang_reference.sh)"``; ``scripts/test --real-engine`` does
it and sets ``ZMQD_REQUIRE_SGLANG_REFERENCE=1``, which turns a missing setup into a failure).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
from typing import Any

import attrs
import pytest

from zmqdispatch.wire import sglang as sg

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sglang_reference.py"
VECTORS = ROOT / "tests" / "wire" / "vectors" / "sglang_0.5.21.json"
_MISSING = not os.environ.get("ZMQD_SGLANG_PATH")
_WHY = 'SGLang reference check needs ZMQD_SGLANG_PATH (eval "$(scripts/install_sglang_reference.sh)")'
if _MISSING and os.environ.get("ZMQD_REQUIRE_SGLANG_REFERENCE") == "1":
    raise RuntimeError(f"ZMQD_REQUIRE_SGLANG_REFERENCE=1 but {_WHY}")
pytestmark = pytest.mark.skipif(_MISSING, reason=_WHY)


def run(*args: str, stdin: str | None = None) -> Any:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_vectors_regenerate_unchanged() -> None:
    stored = json.loads(VECTORS.read_text())
    fresh = run("vectors")
    assert fresh["cases"] == stored["cases"]
    assert fresh["layouts"]["0.5.21"] == stored["layouts"]["0.5.21"]


def random_request(rng: random.Random, i: int) -> sg.TokenizedGenerateReqInput:
    sp = sg.SGLangSamplingParams(
        max_new_tokens=rng.choice([None, 0, 1, 64]),
        stop_token_ids=rng.choice([None, (), tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 5)))]),
        temperature=rng.choice([0.0, 1e-7, 0.5, 1.0, 1.7]),
        top_p=rng.choice([0.1, 0.95, 1.0]),
        top_k=rng.choice([-1, 1, 20]),
        min_p=rng.choice([0.0, 0.2]),
        frequency_penalty=rng.choice([0.0, -1.5, 2.0]),
        presence_penalty=rng.choice([0.0, 1.0]),
        repetition_penalty=rng.choice([1.0, 0.5, 2.0]),
        min_new_tokens=0,
        n=rng.choice([1, 1, 1, 2]),
        json_schema=rng.choice([None, "", "{}"]),
        ignore_eos=rng.random() < 0.5,
        skip_special_tokens=rng.random() < 0.5,
        no_stop_trim=rng.random() < 0.5,
        stream_interval=rng.choice([None, 1, 8]),
        logit_bias=rng.choice([None, {"3": 1.5, "99": -100.0}]),
        sampling_seed=rng.choice([None, 0, 2**62]),
    )
    return sg.TokenizedGenerateReqInput(
        rid=f"r-{i}-{rng.randrange(10**6)}", input_ids=tuple(rng.randrange(2**31) for _ in range(rng.randrange(0, 6))),
        sampling_params=sp, return_logprob=rng.random() < 0.5, top_logprobs_num=rng.choice([0, 5]),
        stream=rng.random() < 0.5, require_reasoning=rng.random() < 0.2, priority=rng.choice([None, 3]),
    )


def expected_error(req: sg.TokenizedGenerateReqInput) -> bool:
    sp = req.sampling_params.derive()
    return sp.n != 1 or not req.input_ids or (sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens)


def test_plugin_decodes_our_requests_to_our_fields() -> None:
    rng = random.Random(22)
    reqs = [random_request(rng, i) for i in range(80)]
    elements = [rng.choice([sg.REQUEST_MIN_ELEMENTS, 34, sg.REQUEST_ELEMENTS]) for _ in reqs]
    reqs = [r if e == sg.REQUEST_ELEMENTS else attrs.evolve(r, require_reasoning=r.require_reasoning and e > 33,
                                                            priority=None) for r, e in zip(reqs, elements)]
    payloads = [sg.encode_add(r, elements=e)[0].hex() for r, e in zip(reqs, elements)]
    out = run("decode", stdin=json.dumps({"add": payloads, "vocab_size": 100_000}))
    for req, got in zip(reqs, out["add"]):
        assert isinstance(got, list) and len(got) == 1, got
        view = got[0]
        assert view["type"] == "TokenizedGenerateReqInput"
        for name in sg.REQUEST_LAYOUT:
            if name == "sampling_params":
                continue
            ours = getattr(req, name)
            assert view[name] == (list(ours) if isinstance(ours, tuple) else ours), name
        sp = req.sampling_params.derive()
        for name in sg.SAMPLING_LAYOUT:
            ours = getattr(sp, name)
            if name == "stop_token_ids" and ours is not None:
                ours = sorted(ours)
            assert view["sampling_params"][name] == (list(ours) if isinstance(ours, tuple) else ours), name
        assert (view["validation_error"] is not None) == expected_error(req), (req, view["validation_error"])


def test_plugin_decodes_abort_and_control() -> None:
    out = run("decode", stdin=json.dumps({
        "abort": [sg.encode_abort(["a", "b-1"]).hex()],
        "control": [sg.encode_control(3, "flush_cache", [2.5]).hex(), sg.encode_control(4, "stop_profile").hex(),
                    sg.encode_control(5, "start_profile", [{"output_dir": "/tmp/x", "num_steps": 3}]).hex(),
                    sg.encode_control(6, "no_such_method").hex()],
    }))
    assert [v["rid"] for v in out["abort"][0]] == ["a", "b-1"]
    flush, stop, start, unknown = out["control"]
    assert flush[0]["type"] == "FlushCacheReqInput" and flush[0]["rid"] == "smg-control-3"
    assert flush[0]["timeout_s"] == 2.5
    assert stop[0]["type"] == "ProfileReq" and stop[0]["req_type"] == "STOP_PROFILE"
    assert start[0]["req_type"] == "START_PROFILE" and start[0]["output_dir"] == "/tmp/x" and start[0]["num_steps"] == 3
    assert "unknown control method" in unknown["error"]
