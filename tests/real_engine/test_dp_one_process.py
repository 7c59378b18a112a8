"""One ``vllm serve --headless --data-parallel-size 2`` process (two ranks, each
an independent engine for this non-MoE model) behind one many-engine client
(``zmqdispatch.multi``, docs/many-engines.md §5).

The engines are started once for the module; the client stays open across its
tests in a thread of its own (``serve.ClientThread``). Expectations are vLLM's
own ``LLM`` results (the session's ``reference`` fixture).

This module sorts before the single-engine modules on purpose: it runs before
the session's ``real_engine`` starts, so its two busy-polling ranks do not
share the two cores with a third engine.
"""

from __future__ import annotations

import sys

import attrs
import pytest
import trio

from zmqdispatch.multi import MultiEngineClient
from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_parallel

from .conftest import REFERENCE_CASES
from .serve import (
    STARTUP_TIMEOUT,
    ClientThread,
    client_thread,
    free_port,
    serve_argv,
    serve_processes,
)
from .test_real_vllm import GUARD, case_request, collect

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def dp2(vllm_py, model_dir, reference):
    # ``reference`` first: vLLM's own LLM computes the expectations before two
    # busy-polling ranks take the cores.
    port = free_port()
    argv = serve_argv(vllm_py, model_dir, port, "--data-parallel-size", "2")
    with serve_processes(argv) as (proc,), client_thread(port, 2) as ct:
        ct.wait_ready(STARTUP_TIMEOUT + 30)
        print(f"\nvllm serve DP=2 (one process): both ranks up {ct.connect_seconds:.1f} s after the client bound; "
              f"RSS of the process group {proc.rss_mib()} MiB", file=sys.stderr)
        yield ct


def test_both_ranks_handshaken_independent(dp2: ClientThread):
    async def body(client: MultiEngineClient):
        assert [(s.engine_index, s.state) for s in client.states()] == [(0, EngineState.UP), (1, EngineState.UP)]
        readies = {i: e.ready for i, e in client.engines.items()}
        # non-MoE ranks run as independent engines: each reports a DP size of 1
        assert {i: r.data_parallel_size for i, r in readies.items()} == {0: 1, 1: 1}
        assert all(r.vllm_version.startswith("0.32.0") for r in readies.values())
        # the identity of each (its engine_index) is its DP rank, as its ready response says
        assert {i: e.ready.data_parallel_rank for i, e in client.engines.items()} == {0: 0, 1: 1}
        assert await client.call_all("is_sleeping") == {0: False, 1: False}

    dp2.run(body)


def test_requests_spread_over_both_ranks_with_vllms_tokens(dp2: ClientThread, reference):
    names = ["greedy8", "greedy16_long"] * 4
    before = {i: s.requests for i, s in dp2.run(_stats).items()}

    async def body(client: MultiEngineClient):
        placed: dict[str, int | None] = {}
        got: dict[str, tuple[list[int], str]] = {}

        async def one(rid: str, name: str) -> None:
            async with client.generate(case_request(rid, name)) as s:
                placed[rid] = client.engine_of(rid)
                toks, last = await collect(s)
            got[rid] = (toks, last.finish_reason.wire_name)

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                for i, name in enumerate(names):
                    nursery.start_soon(one, f"spread-{i}", name)
        return placed, got, client.stats(), client.states()

    placed, got, stats, states = dp2.run(body)
    for i, name in enumerate(names):
        (expected,) = reference[name]
        assert got[f"spread-{i}"] == (expected["token_ids"], expected["finish_reason"]), (name, placed[f"spread-{i}"])
    # a burst of 8 spreads 4 / 4 (placement counts its own requests), and each
    # rank's own link counted what it served
    assert sorted(placed.values()) == [0] * 4 + [1] * 4
    assert {i: s.requests - before[i] for i, s in stats.items()} == {0: 4, 1: 4}
    assert [s.in_flight for s in states] == [0, 0]


def test_pinned_to_each_rank_and_samples_on_one_rank(dp2: ClientThread, reference):
    case = REFERENCE_CASES["n3_seed7"]
    req = pb.GenerateRequest(
        request_id="dp-n3",
        tokenized=pb.TokenizedInput(input_ids=case["prompt_token_ids"]),
        sampling_params=pb.SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6),
    )

    async def body(client: MultiEngineClient):
        pinned = {}
        with trio.fail_after(GUARD):
            for rank in (0, 1):
                request = attrs.evolve(case_request(f"pin-{rank}", "greedy8"), data_parallel_rank=rank)
                async with client.generate(request) as s:
                    assert client.engine_of(f"pin-{rank}") == rank
                    pinned[rank], _ = await collect(s)
            samples = translate_parallel(req, TranslationConfig(max_model_len=client.max_model_len))
            got: dict[int, list[int]] = {0: [], 1: [], 2: []}
            where: set[int | None] = set()
            async with client.generate_samples([t.request for t in samples]) as ps:
                async for index, delta in ps:
                    where |= {client.engine_of(t.request.request_id) for t in samples} - {None}
                    got[index] += delta.token_ids
        return pinned, got, where

    pinned, got, where = dp2.run(body)
    assert pinned == {0: reference["greedy8"][0]["token_ids"], 1: reference["greedy8"][0]["token_ids"]}
    assert [got[i] for i in range(3)] == [c["token_ids"] for c in reference["n3_seed7"]]
    assert len(where) == 1  # the three samples shared one rank


async def _stats(client: MultiEngineClient):
    return client.stats()
