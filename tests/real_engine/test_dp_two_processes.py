"""Two ``vllm serve --headless`` processes as ranks 0 and 1 of one data-parallel
group (``--data-parallel-size 2 --data-parallel-size-local 1
--data-parallel-start-rank i``: the one-process-per-GPU shape) behind one
many-engine client: one rank SIGKILLed mid-stream fails only its own
requests, the other keeps serving, and the restarted rank dials the same
handshake address and rejoins placement.

Both processes start at once and are shared by the module's tests; the client
stays open across them (``serve.ClientThread``). Runs before the session's
single engine starts (see ``test_dp_one_process.py``).
"""

from __future__ import annotations

import sys
import time

import attrs
import pytest
import trio

from zmqdispatch.errors import EngineDeadError
from zmqdispatch.multi import MultiEngineClient
from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request
from .serve import (
    STARTUP_TIMEOUT,
    ClientThread,
    ServeProcess,
    client_thread,
    free_port,
    serve_argv,
    serve_processes,
)
from .test_real_vllm import GUARD, case_request, collect

pytestmark = pytest.mark.real_engine


def rank_argv(vllm_py: str, model_dir: str, port: int, rank: int) -> list[str]:
    return serve_argv(vllm_py, model_dir, port, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                      "--data-parallel-start-rank", str(rank))


@attrs.define
class TwoRanks:
    client: ClientThread
    procs: list[ServeProcess]
    argvs: list[list[str]]


@pytest.fixture(scope="module")
def ranks(vllm_py, model_dir, reference):
    port = free_port()
    argvs = [rank_argv(vllm_py, model_dir, port, r) for r in (0, 1)]
    with serve_processes(*argvs) as procs, client_thread(port, 2) as ct:
        ct.wait_ready(STARTUP_TIMEOUT + 30)
        print(f"\nvllm serve, two processes: both ranks up {ct.connect_seconds:.1f} s after the client bound; "
              f"RSS {procs[0].rss_mib()} + {procs[1].rss_mib()} MiB", file=sys.stderr)
        yield TwoRanks(ct, procs, argvs)


def pinned(rid: str, name: str, rank: int) -> wire.EngineCoreRequest:
    return attrs.evolve(case_request(rid, name), data_parallel_rank=rank)


def test_each_process_is_one_rank_with_vllms_tokens(ranks: TwoRanks, reference):
    async def body(client: MultiEngineClient):
        assert [(s.engine_index, s.state) for s in client.states()] == [(0, EngineState.UP), (1, EngineState.UP)]
        # the identity of each (its engine_index) is its DP rank, as its ready response says
        assert {i: e.ready.data_parallel_rank for i, e in client.engines.items()} == {0: 0, 1: 1}
        got = {}
        with trio.fail_after(GUARD):
            for rank in (0, 1):
                async with client.generate(pinned(f"two-{rank}", "greedy16_long", rank)) as s:
                    got[rank], _ = await collect(s)
        return got

    got = ranks.client.run(body)
    assert got == {0: reference["greedy16_long"][0]["token_ids"], 1: reference["greedy16_long"][0]["token_ids"]}


def test_sigkill_one_rank_mid_stream_then_restart_rejoins(ranks: TwoRanks, reference):
    expected = reference["greedy8"][0]["token_ids"]

    async def kill_mid_stream(client: MultiEngineClient):
        outcome: dict[str, object] = {}
        where: dict[str, int | None] = {}
        streaming = {f"k{i}": trio.Event() for i in range(4)}  # each request had a token
        killed = trio.Event()
        mid_loads: list = []

        async def one(rid: str, rank: int) -> None:
            req = attrs.evolve(make_request(rid, prompt=[1, 2, 3], max_tokens=200, ignore_eos=True),
                               data_parallel_rank=rank)
            tokens: list[int] = []
            tokens_at_kill = None
            try:
                async with client.generate(req) as s:
                    where[rid] = client.engine_of(rid)
                    async for d in s:
                        tokens += d.token_ids
                        streaming[rid].set()
                        if rank == 0 and len(tokens) >= 20 and not mid_loads:
                            mid_loads.append(client.loads()[0])
                        if killed.is_set() and tokens_at_kill is None:
                            tokens_at_kill = len(tokens)
                # the survivor's requests ran across the kill
                outcome[rid] = ("done", len(tokens), d.finish_reason, tokens_at_kill is not None)
            except EngineDeadError as exc:
                outcome[rid] = ("dead", exc.engine_index, exc.reason, len(tokens))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                for i, rank in enumerate((0, 1, 0, 1)):
                    nursery.start_soon(one, f"k{i}", rank)
                for started in streaming.values():  # every request is mid-stream at the kill
                    await started.wait()
                await trio.to_thread.run_sync(ranks.procs[1].kill_group)
                killed.set()
            # the survivor serves new requests, unpinned ones go there
            async with client.generate(case_request("after-kill", "greedy8")) as s:
                after_engine = client.engine_of("after-kill")
                after, _ = await collect(s)
            try:
                client.generate(pinned("pin-dead", "greedy8", 1))
                pin_dead: object = None
            except EngineDeadError as exc:
                pin_dead = exc.engine_index
        return outcome, where, after_engine, after, pin_dead, client.states(), mid_loads

    outcome, where, after_engine, after, pin_dead, states, mid_loads = ranks.client.run(kill_mid_stream)
    # vllm serve logs stats by default: rank 0's scheduler_stats reached placement
    # (both of this client's requests running there, nothing beyond them)
    (load0,) = mid_loads
    assert (load0.in_flight, load0.reported_running, load0.reported_waiting, load0.other) == (2, 2, 0, 0), load0
    assert where == {"k0": 0, "k1": 1, "k2": 0, "k3": 1}
    for rid in ("k0", "k2"):
        assert outcome[rid] == ("done", 200, wire.FinishReason.LENGTH, True), outcome
    for rid in ("k1", "k3"):
        kind, engine_index, reason, n = outcome[rid]
        # the whole tree killed: its connections close (no sentinel, no final output)
        assert (kind, engine_index, reason) == ("dead", 1, "disconnected"), outcome
        assert 0 < n < 200
    assert after_engine == 0 and after == expected
    assert pin_dead == 1
    assert [(s.engine_index, s.state) for s in states] == [(0, EngineState.UP), (1, EngineState.DEAD)]

    # The same command again: it dials the same handshake address as rank 1.
    t0 = time.monotonic()
    ranks.procs.append(ServeProcess(ranks.argvs[1]))

    async def rejoin(client: MultiEngineClient):
        with trio.fail_after(STARTUP_TIMEOUT):
            await client.wait_for_engines(2)
        rejoined = time.monotonic() - t0
        with trio.fail_after(GUARD):
            async with client.generate(pinned("pin-back", "greedy8", 1)) as s:
                toks, _ = await collect(s)
            # and placement uses it again: a burst of 4 spreads over both
            placed = []

            async def one(i: int) -> None:
                async with client.generate(case_request(f"back-{i}", "greedy8")) as s:
                    placed.append(client.engine_of(f"back-{i}"))
                    await collect(s)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
        return rejoined, toks, sorted(p for p in placed if p is not None), client.states()

    rejoined, toks, placed, states = ranks.client.run(rejoin)
    print(f"\nrank 1 restarted: up again {rejoined:.1f} s after its spawn", file=sys.stderr)
    assert toks == expected
    assert placed == [0, 0, 1, 1]
    assert [(s.engine_index, s.state, s.incarnation) for s in states] == [
        (0, EngineState.UP, 0), (1, EngineState.UP, 1)]
