"""Tensors the client sends, in any layout: C order on the wire, zero-copy when
already contiguous, refused at generate() when they cannot be sent, never able to
break the connection. End to end over real sockets: the scripted fake engine
decodes what it received and compares it with the C-order values."""

from __future__ import annotations


import attrs
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zmqdispatch import RequestRejected
from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.testing import ready_response
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire.tensors import Tensor, as_c_bytes, check_tensor

from ..helpers import make_request

GUARD = 30

# torch name -> numpy dtype holding the same bytes (bfloat16 travels as uint16 bits)
DTYPES = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}


@st.composite
def views(draw):
    """A numpy view of any layout: (torch dtype name, the view)."""
    name = draw(st.sampled_from(sorted(DTYPES)))
    # sides <= 8: an empty tensor then has at most 64 "rows" before its 0, the
    # fake engine's decoder limit (limits.MAX_EMPTY_TENSOR_ROWS); up to 512
    # elements, so both inline (< 256 B) and aux frames occur for every dtype
    base = draw(hnp.arrays(DTYPES[name], hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=8)))
    how = draw(st.sampled_from(["as is", "fortran", "transpose", "step", "reverse"]))
    if how == "fortran":
        view = np.asfortranarray(base)
    elif how == "transpose":
        view = base.T
    elif how == "step" and base.ndim:
        view = base[::2]
    elif how == "reverse" and base.ndim:
        view = base[::-1]
    else:
        view = base
    return name, view


def test_contiguous_data_is_not_copied():
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    out = as_c_bytes(a)
    assert (isinstance(out, memoryview) and out.obj is a) or np.shares_memory(np.frombuffer(out, np.float32), a)
    a[0, 0] = 7.0  # zero-copy: the frame sees the caller's memory
    assert np.frombuffer(out, np.float32)[0] == 7.0
    assert as_c_bytes(b"abc") == b"abc"


@pytest.mark.parametrize("make", [lambda a: a.T, lambda a: np.asfortranarray(a), lambda a: a[:, ::2],
                                  lambda a: a[::-1]])
def test_non_contiguous_data_is_copied_in_c_order(make):
    view = make(np.arange(24, dtype=np.int64).reshape(4, 6))
    out = as_c_bytes(view)
    assert bytes(out) == np.ascontiguousarray(view).tobytes()
    frames = wire.encode_request(attrs.evolve(make_request(), prompt_embeds=Tensor.from_array(view)))
    assert all(type(f) is bytes or (f.c_contiguous and f.format == "B" and f.ndim == 1) for f in frames)


def pair():
    return fake_pair(ready=ready_response(), handshake_timeout=GUARD)


async def send_and_receive(engine, client, request):
    """Enter the request's stream; return what the engine decoded."""
    async with client.generate(request):
        received = await engine.receive_add()
    await engine.receive_abort()  # leaving the stream aborted it
    return received


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(views(), min_size=1, max_size=6))
async def test_any_layout_arrives_in_c_order(tensors):
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            for i, (name, view) in enumerate(tensors):
                t = Tensor.from_array(view, dtype=name)
                got = (await send_and_receive(engine, client, attrs.evolve(make_request(f"t{i}"), prompt_embeds=t)))
                emb = got.prompt_embeds
                assert (emb.dtype, emb.shape) == (name, view.shape)
                assert bytes(emb.data) == np.ascontiguousarray(view).tobytes()


async def test_inline_and_aux_both_carry_c_order():
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            for rows, expect_aux in ((2, False), (40, True)):  # 2*3*4 = 24 B; 40*3*4 = 480 B
                view = np.arange(rows * 3, dtype=np.float32).reshape(3, rows).T
                req = attrs.evolve(make_request(f"r{rows}"), prompt_embeds=Tensor.from_array(view))
                async with client.generate(req):
                    msg = await engine.receive()
                await engine.receive_abort()
                assert (len(msg.frames) > 2) is expect_aux  # [type, payload, *aux]
                assert bytes(msg.value.prompt_embeds.data) == np.ascontiguousarray(view).tobytes()


def _released() -> memoryview:
    mv = memoryview(bytearray(16))
    mv.release()
    return mv


@pytest.mark.parametrize("tensor, words", [
    (Tensor("float32", (2, 2), _released()), "not a readable buffer"),
    (Tensor("float32", (2, 2), [1.0, 2.0, 3.0, 4.0]), "not a readable buffer"),
    (Tensor("float32", (2, 3), bytes(16)), "needs 24"),
    (Tensor("<f4", (2, 2), bytes(16)), "torch tensor"),
    (Tensor(">f4", (2, 2), bytes(16)), "cannot be sent"),
    (Tensor("complex64", (2,), bytes(16)), "cannot be sent"),
    (Tensor("float32", (-1, 2), bytes(16)), "non-negative"),
])
async def test_unsendable_tensor_is_rejected_at_generate_and_the_link_serves_on(tensor, words):
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("live", max_tokens=4)) as live:
                await engine.receive_add()
                with pytest.raises(RequestRejected, match=words) as ei:
                    client.generate(attrs.evolve(make_request("bad"), prompt_embeds=tensor))
                assert ei.value.field == "prompt_embeds" and ei.value.request_id == "bad"
                # the other stream and the connection are untouched
                await engine.send_tokens("live", [5, 6], finish=wire.FinishReason.LENGTH)
                assert [t for d in [d async for d in live] for t in d.token_ids] == [5, 6]
            good = attrs.evolve(make_request("after"), prompt_embeds=Tensor.from_array(np.ones((3, 2), np.float32).T))
            assert (await send_and_receive(engine, client, good)).prompt_embeds.shape == (2, 3)


async def test_a_non_contiguous_view_does_not_break_the_connection():
    # Before C-order normalisation, a strided view reached pyzmq as is: BufferError
    # in the input pump, which ended the connection and every stream on it.
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("live", max_tokens=4)) as live:
                await engine.receive_add()
                view = np.arange(400, dtype=np.float32).reshape(20, 20)[:, ::2]
                got = await send_and_receive(
                    engine, client, attrs.evolve(make_request("strided"), prompt_embeds=Tensor(
                        "float32", view.shape, memoryview(view))))
                assert bytes(got.prompt_embeds.data) == np.ascontiguousarray(view).tobytes()
                await engine.send_tokens("live", [5], finish=wire.FinishReason.LENGTH)
                assert [t for d in [d async for d in live] for t in d.token_ids] == [5]
            assert client.is_alive


def test_check_tensor_accepts_any_layout_without_copying():
    view = np.zeros((8, 8), np.float16)[::2]
    t = Tensor("float16", view.shape, memoryview(view))
    assert check_tensor(t, torch=True) is t
    with pytest.raises(LocalProtocolError, match="numpy"):
        check_tensor(Tensor.from_array(view, torch=True), torch=False)


def test_from_array_dtypes():
    assert Tensor.from_array(np.zeros((2, 3), np.int64)).dtype == "int64"
    assert Tensor.from_array(np.zeros((2, 3), np.int64), torch=False).dtype == "<i8"
    assert Tensor.from_array(np.zeros(3, np.bool_), torch=False).dtype == "|b1"
    assert Tensor.from_array(np.zeros(3, np.uint16), dtype="bfloat16").dtype == "bfloat16"
    assert Tensor.from_array(memoryview(bytes(8)).cast("f")).dtype == "float32"
    with pytest.raises(LocalProtocolError, match="buffer"):
        Tensor.from_array([1, 2])
    with pytest.raises(LocalProtocolError, match="dtype"):
        Tensor.from_array(np.zeros(2, np.complex64))


async def test_tensors_inside_opaque_fields_arrive_in_c_order():
    view = np.arange(120, dtype=np.float16).reshape(10, 12).T  # 240 B: inline
    big = np.arange(300, dtype=np.int32).reshape(30, 10)[::3]  # 400 B: aux frame
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            req = attrs.evolve(make_request("mm"), kv_hints={"a": Tensor.from_array(view),
                                                              "b": [Tensor.from_array(big, torch=False)]})
            async with client.generate(req):
                msg = await engine.receive()
            await engine.receive_abort()
    hints = msg.value.kv_hints
    frames = msg.frames[1:]  # [payload, *aux]
    from zmqdispatch.wire.tensors import decode_tensor

    a = decode_tensor(hints["a"], frames)
    b = decode_tensor(hints["b"][0], frames)
    assert (a.dtype, a.shape, bytes(a.data)) == ("float16", (12, 10), np.ascontiguousarray(view).tobytes())
    assert (b.dtype, b.shape, bytes(b.data)) == ("<i4", (10, 10), np.ascontiguousarray(big).tobytes())


@pytest.mark.parametrize("value, words", [
    (memoryview(np.zeros((4, 4), np.float32))[::2], "non-contiguous"),
    ({"x": _released()}, "released"),
    ([Tensor("float32", (3,), bytes(4))], "needs 12"),
    ({"k": {1, 2}}, "cannot be encoded"),
    ({(1, 2): 3}, "map key"),
    ([2**70], "64 bits"),
])
async def test_unsendable_opaque_values_are_rejected_at_generate(value, words):
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(RequestRejected, match=words) as ei:
                client.generate(attrs.evolve(make_request("bad"), kv_hints=value))
            assert ei.value.field == "kv_hints"
            got = await send_and_receive(engine, client, make_request("after"))
            assert got.request_id == "after"
