"""The one streaming API: every stream is opened from the client, is an async
context manager with abort() / aclose(), aborts by handle, and the public names
come from ``zmqdispatch`` itself (against the scripted fake engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trio

import zmqdispatch
from zmqdispatch import (
    DuplicateRequestIdError,
    EngineClient,
    GroupMember,
    LocalProtocolError,
    OutputDelta,
    RequestRejected,
    RequestStreamClosed,
    SampleStream,
    StreamGroup,
)
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out

GUARD = 20


def test_all_is_a_literal_list_of_names_that_exist() -> None:
    tree = ast.parse(Path(zmqdispatch.__file__).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
    assert isinstance(node.value, ast.List)
    assert all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts)
    names = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    assert len(names) == len(set(names))
    for name in names:
        getattr(zmqdispatch, name)
    assert set(zmqdispatch.errors.__all__) <= set(names)
    # a gateway's entry points, for both runtimes
    for name in ("connect", "ClientConfig", "EngineRequest", "translate_vllm_request", "VllmTranslationConfig",
                 "VllmResponseBuilder", "translate_tokenspeed_request", "TokenSpeedTranslationConfig",
                 "TokenSpeedResponseBuilder", "RequestStream", "SampleStream", "StreamGroup", "GroupMember"):
        assert name in names
    # many engines: the client, its entry point, and the states a caller reads from it
    for name in ("MultiEngineClient", "connect_engines", "EngineState", "EngineStatus", "EngineLoad",
                 "ADDRESS_INDEX_STRIDE", "NoEngineAvailableError", "EngineDrainingError"):
        assert name in names
    assert zmqdispatch.connect_engines is zmqdispatch.multi.connect_engines


def test_there_is_no_abort_by_id_on_the_client() -> None:
    # An id whose request finished may name a newer request of another caller.
    assert not hasattr(EngineClient, "abort")


async def test_samples_are_validated_when_opened_and_refuse_misuse() -> None:
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(DuplicateRequestIdError):
                client.generate_samples([make_request("p-0"), make_request("p-0")])  # raises here, not on entry
            with pytest.raises(RequestRejected, match="n must be >= 1"):
                client.generate_samples([])
            merged = client.generate_samples([make_request("p-0"), make_request("p-1")])
            assert isinstance(merged, SampleStream) and merged.request_ids == ["p-0", "p-1"]
            with pytest.raises(LocalProtocolError, match="enter"):
                await merged.receive()
            assert client.protocol.inflight == 0  # nothing sent before the block is entered
            async with merged:
                assert [(await engine.receive_add()).request_id for _ in range(2)] == ["p-0", "p-1"]
                with pytest.raises(LocalProtocolError, match="once"):
                    async with merged:
                        pass  # pragma: no cover
                await engine.send_outputs([out("p-0", [1])])
                index, delta = await merged.receive()
                assert index == 0 and delta.token_ids == [1]
                await merged.aclose()  # every live sample, one ABORT
                assert sorted(await engine.receive_abort()) == ["p-0", "p-1"]
                with pytest.raises(RequestStreamClosed):  # as a RequestStream read after its abort
                    await merged.receive()
            assert client.protocol.inflight == 0


async def test_a_stream_aborted_by_handle_is_closed_and_one_abort_is_sent() -> None:
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1")) as stream:
                await engine.receive_add()
                await stream.aclose()
                await stream.aclose()  # idempotent
                assert stream.finished
                with pytest.raises(RequestStreamClosed):
                    await stream.receive()
                assert await engine.receive_abort() == ("r1",)


async def test_group_members_are_handles_and_abort_alone() -> None:
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.stream_group() as group:
                assert isinstance(group, StreamGroup)
                a = group.generate(make_request("a"))
                b = group.generate(make_request("b"))
                assert isinstance(a, GroupMember) and a.request_id == "a" and not a.finished
                for _ in range(2):
                    await engine.receive_add()
                await engine.send_outputs([out("a", [1]), out("b", [2])])
                batch = await group.receive()
                got = {(m, tuple(d.token_ids)) for m, d in batch if isinstance(d, OutputDelta)}
                assert got == {(a, (1,)), (b, (2,))}
                assert len(batch) == 2
                a.abort()
                a.abort()  # idempotent: still one ABORT
                assert a.finished and len(group) == 1
                assert await engine.receive_abort() == ("a",)
                await engine.send_outputs([out("a", [3]), out("b", [4], wire.FinishReason.LENGTH)])
                ((m, d),) = await group.receive()  # nothing more for the aborted member
                assert isinstance(d, OutputDelta)
                assert m is b and d.finish_reason is wire.FinishReason.LENGTH and b.finished
                async with client.stream_group() as other:
                    c = other.generate(make_request("c"))
                    await engine.receive_add()
                    group.abort([c])  # another group's member: not this group's to abort
                    assert not c.finished and client.protocol.is_live("c")
                assert await engine.receive_abort() == ("c",)  # left its own group
                await group.aclose()
                with pytest.raises(trio.EndOfChannel):
                    await group.receive()
                with pytest.raises(LocalProtocolError):
                    group.generate(make_request("late"))
