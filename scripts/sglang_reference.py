#!/usr/bin/env python3
"""SGLang's own wire classes without a GPU: golden vectors and a reference decoder.

SGLang's ``io_struct`` module imports torch and a long chain after it, so it does not
import on a CPU machine. Its request structs are plain msgspec classes, though, and
``sampling_params.py`` imports only the standard library and msgspec. This script:

- imports ``sglang/srt/sampling/sampling_params.py`` from the unzipped wheel as it is;
- compiles, from ``sglang/srt/managers/io_struct.py``'s own source, the class
  statements the SGLang plugin's decoder uses (``BaseReq``,
  ``TokenizedGenerateReqInput``, ``TokenizedEmbeddingReqInput``,
  ``EncoderDispatchErrorReq``, ``AbortReq``, ``FlushCacheReqInput``, ``ProfileReqType``,
  ``ProfileReq``) into a module registered as ``sglang.srt.managers.io_struct``, with
  the names their annotations use that need torch (multimodal, pickle and KV-hint
  structs) bound to ``typing.Any``: field order, defaults, tags and msgspec options
  are SGLang's;
- imports the plugin's ``smg_grpc_servicer.sglang.zmq_msgpack`` over that module, so
  its ``decode_request_frames`` and its output structs are the real ones.

Commands (``--sglang DIR``: the unzipped sglang wheel; ``--servicer DIR``: the
unzipped smg-grpc-servicer wheel; both default to ``$ZMQD_SGLANG_PATH``'s entries):

- ``vectors [--layouts-from V=DIR ...]``: print the golden vectors JSON
  (``tests/wire/vectors/sglang_0.5.21.json``), made with SGLang's and the plugin's
  encoders; ``--layouts-from`` adds other releases' layouts read from their source;
- ``decode``: read ``{"add": [hex...], "abort": [hex...], "control": [hex...],
  "vocab_size": N}`` on stdin, decode each with the plugin's ``decode_request_frames``
  and run the plugin's request validation, print the decoded fields as JSON.

Setup: ``eval "$(scripts/install_sglang_reference.sh)"``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import types
import typing
from array import array
from enum import Enum
from typing import Any

import msgspec

_CLASSES = ("BaseReq", "TokenizedGenerateReqInput", "TokenizedEmbeddingReqInput", "EncoderDispatchErrorReq",
            "AbortReq", "FlushCacheReqInput", "ProfileReqType", "ProfileReq")


def _paths(args: argparse.Namespace) -> tuple[str, str]:
    entries = [p for p in os.environ.get("ZMQD_SGLANG_PATH", "").split(os.pathsep) if p]
    sglang = args.sglang or next((p for p in entries if os.path.isdir(os.path.join(p, "sglang"))), None)
    servicer = args.servicer or next((p for p in entries if os.path.isdir(os.path.join(p, "smg_grpc_servicer"))),
                                     None)
    if not sglang or not servicer:
        sys.exit("need --sglang and --servicer (or ZMQD_SGLANG_PATH holding both unzipped wheels)")
    return sglang, servicer


def _module(name: str) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = sys.modules[name] = types.ModuleType(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_module(parent), child, mod)
    return mod


def class_fields(source: str, name: str) -> list[str]:
    """Field order of a msgspec struct in *source*, base classes first (read by ``ast``)."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> list[str]:
        out: list[str] = []
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in classes:
                out += fields(classes[b.id])
        out += [st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]
        return out

    return fields(classes[name])


def load(sglang_root: str, servicer_root: str) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """``(sampling_params, io_struct, zmq_msgpack)`` as described in the module doc."""
    sp_path = os.path.join(sglang_root, "sglang", "srt", "sampling", "sampling_params.py")
    spec = importlib.util.spec_from_file_location("sglang.srt.sampling.sampling_params", sp_path)
    assert spec is not None and spec.loader is not None
    sp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sp
    _module("sglang.srt.sampling").sampling_params = sp
    spec.loader.exec_module(sp)

    io_path = os.path.join(sglang_root, "sglang", "srt", "managers", "io_struct.py")
    tree = ast.parse(open(io_path).read())
    picked = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in _CLASSES]
    io = _module("sglang.srt.managers.io_struct")
    ns = io.__dict__
    ns.update({k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Union", "Tuple", "Set")})
    ns.update(array=array, Enum=Enum, msgspec=msgspec, SamplingParams=sp.SamplingParams)
    for node in picked:  # every other name an annotation uses needs torch: Any
        for sub in ast.walk(node):
            if isinstance(sub, ast.AnnAssign):
                for name in ast.walk(sub.annotation):
                    if isinstance(name, ast.Name) and name.id not in ns:
                        ns[name.id] = Any
    module = ast.Module(body=[*ast.parse("from __future__ import annotations").body, *picked], type_ignores=[])
    exec(compile(module, io_path, "exec"), ns)

    utils = _module("sglang.srt.utils")
    utils.get_bool_env_var = lambda name, default="false": os.environ.get(name, default).lower() in ("1", "true")

    def dec_hook(tp: type, obj: object) -> object:
        raise NotImplementedError(f"no decoder for {tp}")

    def ext_hook(code: int, data: memoryview) -> object:
        raise NotImplementedError(f"no ext type {code}")

    mp = _module("sglang.srt.utils.msgpack_utils")
    mp.dec_hook, mp.ext_hook = dec_hook, ext_hook
    sys.path.insert(0, servicer_root)
    from smg_grpc_servicer.sglang import zmq_msgpack

    return sp, io, zmq_msgpack


def _hex(b: bytes) -> str:
    return bytes(b).hex()


def _layouts(io: types.ModuleType, sp: types.ModuleType) -> dict[str, list[str]]:
    return {
        "TokenizedGenerateReqInput": list(io.TokenizedGenerateReqInput.__struct_fields__),
        "SamplingParams": list(sp.SamplingParams.__struct_fields__),
    }


# Request cases: (name, request fields, sampling fields); stop_token_ids become a set.
ADD_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("add_minimal", {"rid": "r-0", "input_ids": [1, 2, 3, 4, 5]}, {"max_new_tokens": 3}),
    ("add_greedy_stops", {"rid": "req-greedy", "input_ids": [7, 8], "stream": True},
     {"max_new_tokens": 16, "temperature": 0.0, "stop": ["\n\n", "END"], "stop_token_ids": [9, 2, 2],
      "ignore_eos": False, "no_stop_trim": True}),
    ("add_sampling", {"rid": "sampled", "input_ids": [11, 12, 13], "stream": True},
     {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
      "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1, "min_new_tokens": 2,
      "logit_bias": {"5": -3.5, "17": 1.0}, "sampling_seed": 1234, "stream_interval": 4}),
    ("add_logprobs", {"rid": "lp", "input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 3},
     {"max_new_tokens": 4, "top_k": 1}),
    ("add_grammar_reasoning", {"rid": "json-1", "input_ids": [3], "require_reasoning": True, "priority": 2},
     {"max_new_tokens": None, "json_schema": "{\"type\": \"object\"}", "skip_special_tokens": False,
      "spaces_between_special_tokens": False}),
    ("add_unicode_rid", {"rid": "r\u00e9q-\u00fc", "input_ids": [0, 4294967295], "stream": False},
     {"max_new_tokens": 0, "regex": "[a-z]+", "stop": "x"}),
]

# Defaults of the fields SGLang gives none (what a plain text request uses).
_REQUIRED = {"input_text": None, "input_embeds": None, "mm_inputs": None, "token_type_ids": None,
             "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
             "token_ids_logprob": None, "stream": False}


def _build_add(io: types.ModuleType, sp: types.ModuleType, request: dict[str, Any], sampling: dict[str, Any]) -> Any:
    s = dict(sampling)
    if s.get("stop_token_ids") is not None:
        s["stop_token_ids"] = set(s["stop_token_ids"])
    return io.TokenizedGenerateReqInput(**{**_REQUIRED, **request, "sampling_params": sp.SamplingParams(**s)})


def _output_cases(z: types.ModuleType) -> list[dict[str, Any]]:
    B = z.BatchTokenIDSlimOutput
    cols = dict(finished_messages=None, finished_matched=None)
    cases = []

    def case(name: str, description: str, **kw: Any) -> None:
        obj = B(**kw)
        cases.append({"name": name, "kind": "output", "description": description,
                      "frames_hex": [_hex(z.encode(obj))], "fields": _plain(obj)})

    case("output_running", "two requests mid-stream, no load reported",
         rids=["a", "b"], output_ids=[[5], [6, 7]], finished_reasons=["", ""], finished_messages=[None, None],
         finished_matched=[None, None], prompt_tokens=[3, 4], completion_tokens=[1, 2], cached_tokens=[0, 2],
         output_token_logprobs_val=[[], []], output_token_logprobs_idx=[[], []])
    case("output_finishes", "stop on a token id, stop on a string, length; load tail of rank 1",
         rids=["s-id", "s-str", "len"], output_ids=[[2], [44], [9]], finished_reasons=["stop", "stop", "length"],
         finished_messages=[None, None, None], finished_matched=[2, "END", None], prompt_tokens=[3, 3, 3],
         completion_tokens=[4, 5, 16], cached_tokens=[0, 0, 0], output_token_logprobs_val=[[], [], []],
         output_token_logprobs_idx=[[], [], []], engine_index=1, num_running=2, num_waiting=1,
         kv_used_tokens=96, kv_total_tokens=4096, finished_status=[None, None, None])
    case("output_logprobs", "sampled logprobs with 2 ranked candidates per token",
         rids=["lp"], output_ids=[[5, 6]], finished_reasons=[""], finished_messages=[None],
         finished_matched=[None], prompt_tokens=[2], completion_tokens=[2], cached_tokens=[0],
         output_token_logprobs_val=[[-0.25, -1.5]], output_token_logprobs_idx=[[5, 6]],
         output_top_logprobs_val=[[[-0.25, -2.0], [-1.5, -1.75]]],
         output_top_logprobs_idx=[[[5, 8], [6, 1]]], reasoning_tokens=[0])
    case("output_refused", "the plugin's terminal abort for a request it refused (status 400)",
         rids=["bad"], output_ids=[[]], finished_reasons=["abort"],
         finished_messages=["top_p must be in (0, 1], got 0.0."], finished_matched=[None], prompt_tokens=[0],
         completion_tokens=[0], cached_tokens=[0], output_token_logprobs_val=[[]],
         output_token_logprobs_idx=[[]], finished_status=[400])
    del cols
    # The shortest batch a reader must take (SMG decodes any prefix of >= 11 elements).
    short = ["BatchTokenIDSlimOutput", ["p"], [[1]], [""], [None], [None], [2], [1], [0], [[]], [[]]]
    cases.append({"name": "output_prefix_11", "kind": "output", "description": "an 11-element prefix (no tail)",
                  "frames_hex": [_hex(msgspec.msgpack.encode(short))],
                  "fields": {"rids": ["p"], "output_ids": [[1]], "finished_reasons": [""],
                             "finished_messages": [None], "finished_matched": [None], "prompt_tokens": [2],
                             "completion_tokens": [1], "cached_tokens": [0], "output_token_logprobs_val": [[]],
                             "output_token_logprobs_idx": [[]]}})
    for name, reply in (("control_reply_ok", z.ControlReplySlim(call_id=3, success=True, message="", engine_index=0)),
                        ("control_reply_failed", z.ControlReplySlim(call_id=9, success=False,
                                                                    message="unknown control method 'x'",
                                                                    engine_index=2))):
        cases.append({"name": name, "kind": "control_reply", "frames_hex": [_hex(z.encode(reply))],
                      "fields": _plain(reply)})
    return cases


def cmd_vectors(args: argparse.Namespace) -> None:
    sp, io, z = load(*_paths(args))
    cases: list[dict[str, Any]] = []
    enc = msgspec.msgpack.Encoder()
    for name, request, sampling in ADD_CASES:
        obj = _build_add(io, sp, request, sampling)
        cases.append({"name": name, "kind": "add", "request": request, "sampling": sampling,
                      "frames_hex": ["00", _hex(enc.encode(obj))]})
    cases.append({"name": "abort_two", "kind": "abort", "rids": ["r-1", "r-2"],
                  "frames_hex": ["01", _hex(enc.encode(["r-1", "r-2"]))]})
    for name, call in (("control_flush_cache", [3, "flush_cache", [0.0]]),
                       ("control_start_profile", [4, "start_profile", [{"output_dir": "/tmp/p", "num_steps": 5}]]),
                       ("control_stop_profile", [5, "stop_profile", []])):
        cases.append({"name": name, "kind": "control", "call": call, "frames_hex": ["02", _hex(enc.encode(call))]})
    cases += _output_cases(z)
    ready = z.WireEngineCoreReadyResponse(
        max_model_len=2048, num_gpu_blocks=4096, block_size=1, dtype="bfloat16", vllm_version="sglang-0.5.21",
        world_size=1, data_parallel_size=2, data_parallel_rank=1, max_num_seqs=256, max_num_batched_tokens=8192,
        instance_id="tiny-model", kv_cache_size_tokens=4096, positional_layouts=_layouts(io, sp))
    cases.append({"name": "ready_response_dp_rank1", "kind": "ready_response", "frames_hex": [_hex(z.encode(ready))],
                  "fields": _plain(ready)})
    layouts = {"0.5.21": _layouts(io, sp)}
    for spec in args.layouts_from or []:
        version, _, root = spec.partition("=")
        io_src = open(os.path.join(root, "sglang", "srt", "managers", "io_struct.py")).read()
        sp_src = open(os.path.join(root, "sglang", "srt", "sampling", "sampling_params.py")).read()
        layouts[version] = {"TokenizedGenerateReqInput": class_fields(io_src, "TokenizedGenerateReqInput"),
                            "SamplingParams": class_fields(sp_src, "SamplingParams")}
    doc = {"sglang": "0.5.21", "smg_grpc_servicer": "0.14.1",
           "source": "scripts/sglang_reference.py vectors: SGLang's own structs (sampling_params.py imported, "
                     "io_struct.py's class statements compiled) and the plugin's zmq_msgpack, msgspec encoders",
           "layouts": layouts, "cases": cases}
    print(json.dumps(doc, indent=1, ensure_ascii=False))


def _plain(v: Any) -> Any:
    if isinstance(v, msgspec.Struct):
        return {f: _plain(getattr(v, f)) for f in v.__struct_fields__}
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if isinstance(v, (list, tuple, array)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, Enum):
        return v.name
    return v


def cmd_decode(args: argparse.Namespace) -> None:
    sp, io, z = load(*_paths(args))
    job = json.load(sys.stdin)
    vocab = int(job.get("vocab_size", 32000))
    out: dict[str, list[Any]] = {"add": [], "abort": [], "control": []}
    check = z.MsgpackRecvSocket.__new__(z.MsgpackRecvSocket)
    check._vocab_size, check._tokenizer = vocab, None  # noqa: SLF001  (the plugin's validation, no socket)
    for kind, type_byte in (("add", b"\x00"), ("abort", b"\x01"), ("control", b"\x02")):
        for h in job.get(kind, []):
            try:
                decoded = z.decode_request_frames([type_byte, bytes.fromhex(h)])
            except Exception as exc:
                out[kind].append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            items = []
            for obj in decoded:
                view = {"type": type(obj).__name__, **_plain(obj)}
                if kind == "add":
                    raw = _plain(obj.sampling_params)
                    view["validation_error"] = check._validation_error(obj)  # noqa: SLF001
                    view["normalized"] = _plain(obj.sampling_params)
                    view["sampling_params"] = raw
                items.append(view)
            out[kind].append(items)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sglang")
    p.add_argument("--servicer")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vectors")
    v.add_argument("--layouts-from", action="append", metavar="VERSION=DIR")
    sub.add_parser("decode")
    args = p.parse_args()
    {"vectors": cmd_vectors, "decode": cmd_decode}[args.cmd](args)


if __name__ == "__main__":
    main()
