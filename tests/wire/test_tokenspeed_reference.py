"""Cross-check against TokenSpeed 0.1.1's own wire code: its encoder -> our decoder and back.

TokenSpeed needs CUDA to serve, but its pure wire modules (``runtime/engine/zmq_wire.py``,
``io_struct.py``, ``runtime/sampling/sampling_params.py``) import on a CPU machine when
``torch`` and the heavy third-party imports are stubbed. These tests start one helper
process under a separate interpreter that has the TokenSpeed wheel on its path, and talk
to it with JSON lines (bytes as hex). They are skipped unless both variables are set:

- ``ZMQD_TOKENSPEED_PYTHON``: a Python (3.10+) with ``msgspec``, ``msgpack``, ``numpy``
  and ``pyzmq`` installed;
- ``ZMQD_TOKENSPEED_PATH``: the directory holding the unzipped ``tokenspeed==0.1.1``
  wheel (``os.pathsep``-separated entries are prepended to ``PYTHONPATH``).

Setup: ``eval "$(scripts/install_tokenspeed_reference.sh)"`` (what ``scripts/test
--real-engine`` and CI do, with ``ZMQD_REQUIRE_TOKENSPEED_REFERENCE=1`` turning a
missing setup into a failure), or by hand (nothing touches the project venv)::

    pip download --no-deps tokenspeed==0.1.1 -d /tmp/ts-dl
    mkdir -p /tmp/ts && unzip -oq /tmp/ts-dl/tokenspeed-0.1.1-py3-none-any.whl -d /tmp/ts
    python3 -m venv /tmp/venv-tss
    /tmp/venv-tss/bin/pip install numpy msgspec msgpack pyzmq
    export ZMQD_TOKENSPEED_PYTHON=/tmp/venv-tss/bin/python ZMQD_TOKENSPEED_PATH=/tmp/ts

The helper's import stub (below, ``_HELPER``) replaces ``torch`` with two real classes
(``Tensor``, ``dtype``: msgspec resolves struct annotations with them) and turns every
other missing third-party module into a permissive stub; only the pure wire code paths
are meaningful under it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.protocol import checks_tokenspeed
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm_handshake as handshake

from .test_tokenspeed_roundtrip import batches, msgpack_values, requests, sampling_params

ENV_PYTHON = "ZMQD_TOKENSPEED_PYTHON"
ENV_PATH = "ZMQD_TOKENSPEED_PATH"

ENV_REQUIRE = "ZMQD_REQUIRE_TOKENSPEED_REFERENCE"
_MISSING = not (os.environ.get(ENV_PYTHON) and os.environ.get(ENV_PATH))
_WHY = (
    f"TokenSpeed reference check needs {ENV_PYTHON} and {ENV_PATH} "
    "(eval \"$(scripts/install_tokenspeed_reference.sh)\"; scripts/test --real-engine does it)"
)
if _MISSING and os.environ.get(ENV_REQUIRE) == "1":
    raise RuntimeError(f"{ENV_REQUIRE}=1 but {_WHY}")

#: Skip, with the reason, when TokenSpeed's wheel is absent (CI requires it).
requires_tokenspeed = pytest.mark.skipif(_MISSING, reason=_WHY)
pytestmark = requires_tokenspeed

SETTINGS = settings(deadline=None, max_examples=60, database=None, suppress_health_check=[HealthCheck.too_slow])

#: The helper's first part, shared with ``test_tokenspeed_mm_reference.py``: the import stub
#: for third-party modules that are not installed (torch is stubbed after it, here).
IMPORT_STUBS = textwrap.dedent(
    r'''
    import importlib.abc, importlib.machinery, json, sys, types

    _out = sys.stdout
    sys.stdout = sys.stderr  # keep the protocol channel clean of import-time prints

    class _Anything:
        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _Anything()
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()
        def __mro_entries__(self, bases):
            return (object,)
        def __iter__(self):
            return iter(())
        def __bool__(self):
            return False
        def __or__(self, other):
            return self
        __ror__ = __or__
        def __getitem__(self, key):
            return self

    class _StubModule(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

    _REAL = {"tokenspeed", "msgspec", "msgpack", "numpy", "zmq", "org"}

    class _Fallback(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Last on sys.meta_path: stubs third-party modules that are not installed."""
        def find_spec(self, name, path, target=None):
            root = name.split(".")[0]
            if root in _REAL or root in sys.stdlib_module_names:
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        def create_module(self, spec):
            module = _StubModule(spec.name)
            module.__path__ = []
            return module
        def exec_module(self, module):
            pass

    sys.meta_path.append(_Fallback())
    '''
)

_HELPER = IMPORT_STUBS + textwrap.dedent(
    r'''
    torch = _StubModule("torch")
    torch.__path__ = []
    class Tensor: pass
    class dtype:
        def __init__(self, name): self.name = name
    torch.Tensor, torch.dtype = Tensor, dtype
    for _n in ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int8", "uint8", "bool"):
        setattr(torch, _n, dtype(_n))
    sys.modules["torch"] = torch

    import msgspec
    from tokenspeed.version import __version__
    from tokenspeed.runtime.engine import zmq_wire, zmq_msgpack
    from tokenspeed.runtime.engine.io_struct import (
        BatchTokenIDOutSlim, MsgpackDecoder, MsgpackEncoder, SessionParams, TokenizedGenerateReqInput)
    from tokenspeed.runtime.sampling.sampling_params import SamplingParams

    ENC = MsgpackEncoder()
    DEC_ADD = MsgpackDecoder(TokenizedGenerateReqInput)
    DEC_OUT = MsgpackDecoder(BatchTokenIDOutSlim)

    def plain(v):
        if isinstance(v, (set, frozenset)):
            return sorted(v)
        if isinstance(v, msgspec.Struct):
            return [plain(getattr(v, f)) for f in v.__struct_fields__]
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, memoryview):
            return v.hex()
        return v

    def struct_view(o):
        return {f: plain(getattr(o, f)) for f in o.__struct_fields__}

    def req_view(o):
        view = struct_view(o)
        view["sampling_params"] = struct_view(o.sampling_params)
        return view

    def build_req(view):
        sp = SamplingParams()
        for key, value in view["sampling_params"].items():  # raw values: no __post_init__
            if key == "stop_token_ids" and value is not None:
                value = set(value)
            setattr(sp, key, value)
        kwargs = dict(view, sampling_params=sp)
        if view.get("session_params") is not None:
            session = dict(zip(("id", "rid", "offset", "replace"), view["session_params"]))
            kwargs["session_params"] = SessionParams(**session)
        return TokenizedGenerateReqInput(**kwargs)

    def frames(hexes):
        return [bytes.fromhex(h) for h in hexes]

    def hexes(fs):
        return [bytes(f).hex() for f in fs]

    def attempt(fn):
        try:
            return fn(), None
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def admission(req, vocab_size, enable_output_logprobs, supports_prompt_logprobs):
        sock = zmq_msgpack.MsgpackRecvSocket(
            None, vocab_size, enable_output_logprobs=enable_output_logprobs,
            supports_prompt_logprobs=supports_prompt_logprobs)
        reason = req.validation_error or sock._validation_error(req)
        if not reason and req.session_params is not None and req.session_params.id is not None:
            reason = "session id does not exist"  # RequestHandler's check
        return reason

    def handle(job):
        op = job["op"]
        if op == "version":
            return {"version": __version__}
        if op == "add_encode":
            return {"frames": hexes(ENC.encode(build_req(job["req"])))}
        if op == "add_decode":
            fs = frames(job["frames"])
            decoded, err = attempt(lambda: req_view(DEC_ADD.decode(fs)))
            fin, ferr = attempt(lambda: zmq_wire.decode_request_frames([b"\x00", *fs])[0])
            out = {"decoded": decoded, "error": err, "finalized": None if fin is None else req_view(fin),
                   "finalize_error": ferr}
            if fin is not None and "admission" in job:
                out["admission"] = admission(fin, **job["admission"])
            return out
        if op == "out_encode":
            return {"frames": hexes(ENC.encode(BatchTokenIDOutSlim(**job["batch"])))}
        if op == "out_decode":
            decoded, err = attempt(lambda: struct_view(DEC_OUT.decode(frames(job["frames"]))))
            return {"decoded": decoded, "error": err}
        if op == "verify":
            sp = SamplingParams()
            for key, value in job["sampling_params"].items():
                setattr(sp, key, value)
            _, err = attempt(lambda: sp.verify(job["vocab_size"]))
            return {"error": err}
        if op == "ready_response":
            rr = zmq_wire.WireEngineCoreReadyResponse(**job["fields"])
            return {"frames": [zmq_wire.encode(rr).hex()]}
        if op == "init_decode":
            init, err = attempt(lambda: zmq_wire.decode_init(bytes.fromhex(job["payload"])))
            return {"error": err, "inputs": None if init is None else init.addresses.inputs,
                    "outputs": None if init is None else init.addresses.outputs}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except Exception as exc:
            reply = {"helper_error": f"{type(exc).__name__}: {exc}"}
        _out.write(json.dumps(reply) + "\n")
        _out.flush()
    '''
)


class TokenSpeedHelper:
    """One long-lived helper process running TokenSpeed's wire code."""

    def __init__(self, python: str, path: str, script: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # stderr (import-time prints, a crash's traceback) goes to a file, shown if it dies
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )

    def _died(self, job: dict[str, Any]) -> RuntimeError:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.stderr.seek(0)
        tail = self.stderr.read()[-3000:]
        return RuntimeError(f"TokenSpeed helper exited (code {self.proc.poll()}) on {job['op']}; check {ENV_PATH}; "
                            f"its stderr ends:\n{tail}")

    def call(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died(job) from None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died(job)
        reply = json.loads(line)
        if "helper_error" in reply:
            raise RuntimeError(f"TokenSpeed helper failed on {job['op']}: {reply['helper_error']}")
        return reply

    def close(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


@pytest.fixture(scope="module")
def tokenspeed() -> Iterator[TokenSpeedHelper]:
    helper = TokenSpeedHelper(os.environ[ENV_PYTHON], os.environ[ENV_PATH], _HELPER)
    try:
        assert helper.call(op="version")["version"] == ts.TOKENSPEED_VERSION
        yield helper
    finally:
        helper.close()


# ----------------------------------------------------------------- views (JSON-plain, TokenSpeed names)


def plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


def sampling_view(sp: ts.TokenSpeedSamplingParams) -> dict[str, Any]:
    view = {f.name: plain(getattr(sp, f.name)) for f in attrs.fields(type(sp))}
    if view["stop_token_ids"] is not None:
        view["stop_token_ids"] = sorted(view["stop_token_ids"])
    return view


def request_view(req: ts.TokenizedGenerateReqInput) -> dict[str, Any]:
    view = {}
    for f in attrs.fields(type(req)):
        v = getattr(req, f.name)
        if f.name == "sampling_params":
            v = sampling_view(v)
        elif f.name == "session_params" and v is not None:
            v = [v.id, v.rid, v.offset, v.replace]
        view[f.name] = plain(v)
    return view


_OUT_NAMES = {"logprob_vals": "output_token_logprobs_val", "logprob_ids": "output_token_logprobs_idx"}


def batch_view(b: ts.TokenSpeedBatch) -> dict[str, Any]:
    return {_OUT_NAMES.get(f.name, f.name): plain(getattr(b, f.name))
            for f in attrs.fields(type(b)) if f.name != "wire_elements"}


def hexes(frames: list[bytes]) -> list[str]:
    return [bytes(f).hex() for f in frames]


def unhex(hs: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hs]


# Cross-process requests: multimodal_inputs is raw here and would not be a valid
# MultimodalInputs for TokenSpeed, and JSON carries no bytes; everything else is free.
cross_requests = requests.map(lambda r: attrs.evolve(r, multimodal_inputs=None))


def _unordered(req: ts.TokenizedGenerateReqInput) -> ts.TokenizedGenerateReqInput:
    ids = req.sampling_params.stop_token_ids
    if ids is None:
        return req
    return attrs.evolve(req, sampling_params=attrs.evolve(req.sampling_params, stop_token_ids=tuple(sorted(ids))))


def _comparable(view: dict[str, Any]) -> dict[str, Any]:
    view = dict(view)
    view.pop("validation_error", None)  # reason texts differ; presence is compared separately
    return view


# ----------------------------------------------------------------- ADD


@SETTINGS
@given(cross_requests)
def test_tokenspeed_encodes_what_we_encode(tokenspeed: TokenSpeedHelper, req: ts.TokenizedGenerateReqInput) -> None:
    """Same values -> the same bytes from both encoders; our decoder reads theirs."""
    ours = ts.encode_add(req)
    theirs = unhex(tokenspeed.call(op="add_encode", req=request_view(req))["frames"])
    if req.sampling_params.stop_token_ids and len(req.sampling_params.stop_token_ids) > 1:
        # a set in TokenSpeed: its bytes carry set-iteration order, which means nothing
        assert _unordered(ts_engine.decode_add(theirs)) == _unordered(ts_engine.decode_add(ours))
    else:
        assert theirs == ours
    derived = attrs.evolve(req, sampling_params=req.sampling_params.derive())
    assert _unordered(ts_engine.decode_add(theirs)) == _unordered(derived)


@SETTINGS
@given(cross_requests, st.integers(ts.REQUEST_MIN_ELEMENTS, ts.REQUEST_ELEMENTS))
def test_tokenspeed_decodes_what_we_encode(
    tokenspeed: TokenSpeedHelper, req: ts.TokenizedGenerateReqInput, elements: int
) -> None:
    """Their decoder (and finalizer) agrees with ours, for every prefix length we emit."""
    req = attrs.evolve(req, **{f.name: f.default for f in attrs.fields(type(req))[elements - 1 :]})
    frames = ts.encode_add(req, elements=elements)
    reply = tokenspeed.call(op="add_decode", frames=hexes(frames))
    assert reply["error"] is None
    assert reply["decoded"] == request_view(ts_engine.decode_add(frames))
    _, finalized = ts_engine.decode_input([b"\x00", *frames])
    assert reply["finalize_error"] is None
    assert _comparable(reply["finalized"]) == _comparable(request_view(finalized))
    assert (reply["finalized"]["validation_error"] is None) == (finalized.validation_error is None)


@SETTINGS
@given(
    sampling_params.map(lambda sp: attrs.evolve(sp, custom_params=None)),
    st.integers(1, 200),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(-3, 5),
    st.integers(0, 2),
    st.lists(st.integers(0, 9), max_size=4),
)
def test_admission_matches_tokenspeed(
    tokenspeed: TokenSpeedHelper,
    sp: ts.TokenSpeedSamplingParams,
    vocab_size: int,
    return_logprob: bool,
    enable_output_logprobs: bool,
    supports_prompt_logprobs: bool,
    logprob_start_len: int,
    top_logprobs_num: int,
    input_ids: list[int],
) -> None:
    """Whether a request ends in a terminal abort: their ingress vs :func:`checks_tokenspeed.admission_error`."""
    req = ts.TokenizedGenerateReqInput(
        rid="r",
        input_ids=input_ids,
        sampling_params=sp,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
    )
    flags = {
        "vocab_size": vocab_size,
        "enable_output_logprobs": enable_output_logprobs,
        "supports_prompt_logprobs": supports_prompt_logprobs,
    }
    frames = ts.encode_add(req)
    reply = tokenspeed.call(op="add_decode", frames=hexes(frames), admission=flags)
    _, finalized = ts_engine.decode_input([b"\x00", *frames])
    ours = checks_tokenspeed.admission_error(finalized, **flags)
    assert (reply["admission"] is None) == (ours is None), (reply["admission"], ours)


@st.composite
def mutated_adds(draw: st.DrawFn) -> bytes:
    """A valid ADD with one typed element (request or sampling array) replaced."""
    req = draw(cross_requests)
    raw = msgpack.unpackb(ts.encode_add(req)[0])
    value = draw(msgpack_values)
    if draw(st.booleans()):
        raw[5][draw(st.integers(0, ts.SAMPLING_PARAMS_LEN - 1))] = value
    else:
        # rid (1) is excluded: TokenSpeed's decoder admits nil/list rids (dropped later or
        # admitted with an explicit seed); input_embeds (11), input_extra_infos (20) and
        # multimodal_inputs (22) are opaque to us.
        raw[draw(st.sampled_from([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19, 21, 23, 24]))] = value
    return msgpack.packb(raw, use_bin_type=True)


@settings(deadline=None, max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_adds())
def test_add_acceptance_matches_tokenspeed(tokenspeed: TokenSpeedHelper, payload: bytes) -> None:
    """Our decode_add + finalize refuses exactly what TokenSpeed's receiver drops."""
    reply = tokenspeed.call(op="add_decode", frames=[payload.hex()])
    theirs_ok = reply["error"] is None and reply["finalize_error"] is None
    try:
        _, req = ts_engine.decode_input([b"\x00", payload])
    except RemoteProtocolError as exc:
        assert not theirs_ok, f"we refuse what TokenSpeed accepts: {exc}"
        return
    assert theirs_ok, f"we accept what TokenSpeed drops: {reply['error'] or reply['finalize_error']}"
    assert _comparable(reply["finalized"]) == _comparable(request_view(req))


@SETTINGS
@given(
    sampling_params.map(lambda sp: attrs.evolve(sp, custom_params=None)),
    st.integers(1, 10**6),
)
def test_verify_matches_tokenspeed(tokenspeed: TokenSpeedHelper, sp: ts.TokenSpeedSamplingParams, vocab: int) -> None:
    view = sampling_view(sp)
    reply = tokenspeed.call(op="verify", sampling_params=view, vocab_size=vocab)
    ours = checks_tokenspeed.sampling_params_error(sp, vocab)
    assert (reply["error"] is None) == (ours is None), (reply["error"], ours)


# ----------------------------------------------------------------- outputs


@SETTINGS
@given(batches())
def test_outputs_both_ways(tokenspeed: TokenSpeedHelper, batch: ts.TokenSpeedBatch) -> None:
    ours = ts_engine.encode_outputs(batch)
    theirs = unhex(tokenspeed.call(op="out_encode", batch=batch_view(batch))["frames"])
    assert theirs == ours
    assert ts.decode_outputs(theirs) == batch
    reply = tokenspeed.call(op="out_decode", frames=hexes(ours))
    assert reply["error"] is None and reply["decoded"] == batch_view(batch)


@SETTINGS
@given(st.sampled_from([9, 10]).flatmap(lambda n: st.tuples(st.just(n), batches(elements=n))))
def test_legacy_outputs_decode_in_tokenspeed(
    tokenspeed: TokenSpeedHelper, case: tuple[int, ts.TokenSpeedBatch]
) -> None:
    elements, batch = case
    reply = tokenspeed.call(op="out_decode", frames=hexes(ts_engine.encode_outputs(batch, elements=elements)))
    assert reply["error"] is None and reply["decoded"] == batch_view(batch)


@st.composite
def mutated_batches(draw: st.DrawFn) -> bytes:
    raw = msgpack.unpackb(ts_engine.encode_outputs(draw(batches()))[0])
    i = draw(st.integers(0, len(raw)))
    value = draw(msgpack_values)
    raw = raw[:i] + [value] + raw[i + 1 :] if draw(st.booleans()) else raw[:i]
    return msgpack.packb(raw, use_bin_type=True)


@settings(deadline=None, max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_batches())
def test_we_accept_no_batch_tokenspeed_would_refuse(tokenspeed: TokenSpeedHelper, payload: bytes) -> None:
    """Ours is the stricter decoder (ragged columns, negative ids/counts, logprob row
    lengths), so acceptance only has to hold one way; what both accept must agree."""
    try:
        batch = ts.decode_outputs([payload])
    except RemoteProtocolError:
        return
    reply = tokenspeed.call(op="out_decode", frames=[payload.hex()])
    assert reply["error"] is None
    assert reply["decoded"] == batch_view(batch)


# ----------------------------------------------------------------- handshake


def test_ready_response_and_init(tokenspeed: TokenSpeedHelper) -> None:
    fields = {
        "max_model_len": 8192,
        "num_gpu_blocks": 512,
        "prefix_granularity": 32,
        "dtype": "float16",
        "multimodal_encoder_dtype": "bfloat16",
        "vllm_version": "tokenspeed-0.1.1",
        "world_size": 4,
        "data_parallel_size": 2,
        "tensor_parallel_size": 2,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": 1,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 0,
        "instance_id": "m",
        "kv_cache_size_tokens": 16384,
        "kv_cache_max_concurrency": 2.5,
        "kv_events_config": {"enable": False},
    }
    payload = unhex(tokenspeed.call(op="ready_response", fields=fields)["frames"])[0]
    resp = ts.decode_ready_response(payload)
    assert ts.is_tokenspeed(resp) and resp.block_size == 32
    # TokenSpeed's own struct writes the encoder dtype; the client reads it
    assert resp.multimodal_encoder_dtype == "bfloat16" and resp.dtype == "float16"
    assert ts_engine.encode_ready_response(resp) == payload
    init = handshake.encode_init(["ipc:///tmp/x-in.sock"], ["ipc:///tmp/x-out.sock"])
    reply = tokenspeed.call(op="init_decode", payload=init.hex())
    assert reply == {"error": None, "inputs": ["ipc:///tmp/x-in.sock"], "outputs": ["ipc:///tmp/x-out.sock"]}
