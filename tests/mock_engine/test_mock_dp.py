"""The mock engine's data-parallel mode: N ranks dial one handshake address, as
the ``EngineCore_DPn`` engines of one ``vllm serve --data-parallel-size N`` do
(``docs/vllm-wire.md`` §2, §5.10; ``docs/mock-engine.md``).

A raw handshake ROUTER plays the front end: it must see one HELLO per rank with
identities 0..N-1, answer each with addresses of its own, get that rank's ready
response there (``data_parallel_rank`` = its rank) and its READY, and each rank
must then serve a request on its own sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import zmq

from zmqdispatch import ClientConfig, connect
from zmqdispatch._zmq_trio import TrioSocket, ZmqContext
from zmqdispatch.mock.server import MockEngineConfig, rank_configs, serve_mock_ranks
from zmqdispatch.testing import external_mock
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_handshake

from ..helpers import GUARD, make_request, make_ts_request


def identity(rank: int) -> bytes:
    return rank.to_bytes(2, "little")


class Rank:
    """The front end's sockets for one rank: its own input ROUTER and output PULL."""

    def __init__(self, ctx: ZmqContext, d: str, rank: int) -> None:
        self.rank = rank
        self.input_address = f"ipc://{d}/in{rank}.sock"
        self.output_address = f"ipc://{d}/out{rank}.sock"
        self.input = ctx.socket(zmq.ROUTER, name=f"in{rank}", router_mandatory=True)
        self.output = ctx.socket(zmq.PULL, name=f"out{rank}")
        self.input.bind(self.input_address)
        self.output.bind(self.output_address)

    def close(self) -> None:
        self.input.close()
        self.output.close()


@asynccontextmanager
async def front_end(d: str, address: str, n: int) -> AsyncIterator[tuple[TrioSocket, dict[int, Rank]]]:
    ctx = ZmqContext()
    hs = ctx.socket(zmq.ROUTER, name="handshake")
    hs.bind(address)
    ranks = {r: Rank(ctx, d, r) for r in range(n)}
    try:
        yield hs, ranks
    finally:
        hs.close()
        for r in ranks.values():
            r.close()


async def handshake(hs: TrioSocket, ranks: dict[int, Rank], *, tokenspeed: bool = False) -> dict[int, object]:
    """Answer every rank's HELLO with INIT naming that rank's own sockets; return
    each rank's ready response once its READY came too."""
    hellos: list[bytes] = []
    readies: set[bytes] = set()
    responses: dict[int, object] = {}
    decode_ready = ts.decode_ready_response if tokenspeed else vllm_handshake.decode_ready_response
    while len(readies) < len(ranks):
        who, payload = await hs.recv_multipart()
        status = vllm_handshake.decode_handshake_status(payload)
        if status.status == "HELLO":
            assert who not in hellos, f"second HELLO from {who.hex()}"
            hellos.append(who)
            rank = ranks[int.from_bytes(who, "little")]
            await hs.send([who, vllm_handshake.encode_init(inputs=[rank.input_address], outputs=[rank.output_address])])
        else:
            assert status.status == "READY" and who in hellos
            readies.add(who)
    assert sorted(hellos) == [identity(r) for r in range(len(ranks))]
    for r, rank in ranks.items():
        who, payload = await rank.input.recv_multipart()  # arrived on this rank's input only
        assert who == identity(r)
        responses[r] = decode_ready(payload)
    return responses


async def serve_one(rank: Rank, rid: str, *, tokenspeed: bool = False) -> list[int]:
    """Send one 3-token request to *rank* by identity; its tokens, from its own output."""
    if tokenspeed:
        await rank.input.send([identity(rank.rank), ts.RequestType.ADD.frame,
                               *ts.encode_add(make_ts_request(rid, max_new_tokens=3))])
    else:
        await rank.input.send([identity(rank.rank), bytes([wire.RequestType.ADD]),
                               *wire.encode_request(make_request(rid, max_tokens=3))])
    tokens: list[int] = []
    while True:
        frames = await rank.output.recv_multipart()
        if tokenspeed:
            batch = ts.decode_outputs(frames)
            assert batch.engine_index == rank.rank
            assert set(batch.rids) == {rid}
            tokens += [t for ids in batch.output_ids for t in ids]
            if any(batch.finished_reasons):  # "" while running
                return tokens
        else:
            outs = wire.decode_outputs(frames)
            assert outs.engine_index == rank.rank
            for o in outs.outputs:
                assert o.request_id == rid
                tokens += o.new_token_ids
                if o.finish_reason is not None:
                    return tokens


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
async def test_n_ranks_dial_one_handshake_with_identities_0_to_n_minus_1(tmp_path, runtime):
    n = 3
    tokenspeed = runtime == "tokenspeed"
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, runtime=runtime, step_interval=0,
                           data_parallel_size_local=n, data_parallel_size=n)
    with trio.fail_after(GUARD):
        async with front_end(str(tmp_path), address, n) as (hs, ranks), trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_mock_ranks(cfg, in_process=True))
            responses = await handshake(hs, ranks, tokenspeed=tokenspeed)
            for r, ready in responses.items():
                assert ready.data_parallel_rank == r
                assert ready.data_parallel_size == (n if tokenspeed else 1)  # vLLM non-MoE ranks report 1
            # the same request id on every rank at once: the engines are independent
            async with trio.open_nursery() as requests:
                for rank in ranks.values():
                    requests.start_soon(lambda rank=rank: serve_one(rank, "same", tokenspeed=tokenspeed))
            for rank in ranks.values():
                assert len(await serve_one(rank, f"r{rank.rank}", tokenspeed=tokenspeed)) == 3
            nursery.cancel_scope.cancel()


async def test_serve_mock_ranks_reports_started_once_every_rank_is_up(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, step_interval=0, data_parallel_size_local=2,
                           data_parallel_size=2)
    with trio.fail_after(GUARD):
        async with front_end(str(tmp_path), address, 2) as (hs, ranks), trio.open_nursery() as nursery:
            started = trio.Event()

            async def run() -> None:
                await nursery.start(lambda task_status: serve_mock_ranks(cfg, in_process=True,
                                                                         task_status=task_status))
                started.set()

            nursery.start_soon(run)
            hellos = []
            while len(hellos) < 2:  # both ranks dial at once, before anyone is answered
                who, payload = await hs.recv_multipart()
                assert vllm_handshake.decode_handshake_status(payload).status == "HELLO"
                hellos.append(who)
            assert sorted(hellos) == [identity(0), identity(1)]
            rank0 = ranks[0]
            await hs.send([identity(0), vllm_handshake.encode_init(inputs=[rank0.input_address],
                                                         outputs=[rank0.output_address])])
            who, payload = await hs.recv_multipart()
            assert (who, vllm_handshake.decode_handshake_status(payload).status) == (identity(0), "READY")
            await trio.testing.wait_all_tasks_blocked()
            assert not started.is_set()  # rank 1 still waits for its INIT
            rank1 = ranks[1]
            await hs.send([identity(1), vllm_handshake.encode_init(inputs=[rank1.input_address],
                                                         outputs=[rank1.output_address])])
            await started.wait()
            nursery.cancel_scope.cancel()


def test_rank_configs_are_consecutive_ranks_from_the_start_rank():
    cfg = MockEngineConfig(handshake_address="ipc:///x", engine_index=2, data_parallel_size_local=3,
                           data_parallel_size=5)
    ranks = rank_configs(cfg)
    assert [c.engine_index for c in ranks] == [2, 3, 4]
    assert {c.data_parallel_size_local for c in ranks} == {1} and {c.data_parallel_size for c in ranks} == {5}
    assert rank_configs(MockEngineConfig(handshake_address="ipc:///x")) == [MockEngineConfig(handshake_address="ipc:///x")]
    with pytest.raises(ValueError, match="2-byte identity"):
        rank_configs(MockEngineConfig(handshake_address="ipc:///x", engine_index=65535, data_parallel_size_local=2))
    with pytest.raises(ValueError, match=">= 1"):
        rank_configs(MockEngineConfig(handshake_address="ipc:///x", data_parallel_size_local=0))


async def test_the_program_runs_n_ranks_and_two_processes_split_a_group(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        # one process, ranks 0..1
        async with front_end(str(tmp_path), address, 2) as (hs, ranks), \
                external_mock(address, "--data-parallel-size", "2", "--step-interval-ms", "0") as proc:
            responses = await handshake(hs, ranks)
            assert [responses[r].data_parallel_rank for r in (0, 1)] == [0, 1]
            for rank in ranks.values():
                assert len(await serve_one(rank, "x")) == 3
            assert proc.returncode is None
        # two processes, one rank each (vllm serve's flags for one engine per container)
        split = ("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--step-interval-ms", "0")
        async with front_end(str(tmp_path), address, 2) as (hs, ranks), \
                external_mock(address, *split, "--data-parallel-start-rank", "0"), \
                external_mock(address, *split, "--data-parallel-start-rank", "1"):
            responses = await handshake(hs, ranks)
            assert [responses[r].data_parallel_rank for r in (0, 1)] == [0, 1]
            for rank in ranks.values():
                assert len(await serve_one(rank, "y")) == 3


async def test_one_rank_still_works_with_the_client_through_the_dp_flags(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with external_mock(address, "--data-parallel-size", "1", "--step-interval-ms", "0"), \
                connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
            assert client.engine_index == 0
            async with client.generate(make_request("a", max_tokens=3)) as s:
                assert sum([len(d.token_ids) async for d in s]) == 3
        # rank 1 alone (the second process of a split group) is a client's engine 1
        async with external_mock(address, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                                 "--data-parallel-start-rank", "1", "--step-interval-ms", "0"), \
                connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
            assert client.engine_index == 1
            async with client.generate(make_request("b", max_tokens=3)) as s:
                assert sum([len(d.token_ids) async for d in s]) == 3


def test_a_client_waiting_for_one_engine_serves_a_two_rank_mock():
    """Both ranks dial at once; the client waits for the first and serves the
    second as an engine joining: the request completes, nothing is refused."""
    launch = (f"{sys.executable} -m zmqdispatch mock-engine --handshake-address {{handshake_address}} "
              "--data-parallel-size 2")
    p = subprocess.run([sys.executable, "-m", "zmqdispatch", "generate", "--prompt-token-ids", "1,2,3",
                        "--max-tokens", "3", "--launch", launch, "--handshake-timeout", "30", "--log-level", "info"],
                       capture_output=True, text=True, timeout=90, check=False)
    assert p.returncode == 0, p.stderr
    complete = json.loads(p.stdout.splitlines()[-1])["complete"]
    assert complete["finish_reason"] == "length" and len(complete["output_ids"]) == 3
    assert "refused" not in p.stderr and "Error" not in p.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--engine-index", "1", "--data-parallel-size", "2"], "--engine-index: not with --data-parallel-size"),
    (["--data-parallel-start-rank", "1"], "give --data-parallel-size too"),
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "2"], "past --data-parallel-size 2"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "1"],
     "ranks 1..2, past --data-parallel-size 2"),
    (["--data-parallel-size", "0"], "0 is outside 1..65536"),
])
def test_dp_flags_are_refused_by_name(flags, message):
    p = subprocess.run([sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address",
                        "ipc:///tmp/zmqd-never-dialed.sock", *flags],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2
    assert message in p.stderr and p.stderr.count("\n") == 1 and p.stdout == ""
