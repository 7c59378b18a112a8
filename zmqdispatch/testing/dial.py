"""The engine side of the startup handshake: dial in like an EngineCore does.

The one engine-side dialer of the package, and the one factory of the ready
response an engine registers with (:func:`ready_response`). Used by the
scripted fake engine (:mod:`zmqdispatch.testing.fake_engine`), the mock engine
program (:mod:`zmqdispatch.mock.server`) and the benchmark engine
(:mod:`zmqdispatch.bench.engine`); a test may also call :func:`dial` itself to
script an engine that stops part-way through its handshake.
Sequence (vLLM 0.32 ``EngineCoreProc``, ``docs/vllm-wire.md`` §5.1):

1. DEALER (identity = engine index, 2 bytes LE) connects to the handshake
   address and sends ``{"status": "HELLO", "local": ..., "headless": ...}``.
2. It receives the INIT reply with the input/output addresses.
3. It connects a DEALER (same identity) to the input address and a PUSH to the
   output address, sends the ``EngineCoreReadyResponse`` on the input DEALER,
   then ``READY`` on the handshake DEALER, and closes the handshake socket.

TokenSpeed 0.1.1 (``tokenspeed=True``, ``docs/tokenspeed-wire.md`` §1.4) runs the
same exchange with its own maps (HELLO/READY always ``local=true,
headless=true`` plus a nil ``parallel_config_hash``; the ready response names
``block_size`` ``prefix_granularity``) and in another order: READY on the
handshake socket first, then the ready response on the input DEALER, then the
output PUSH connects.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import zmq

from .._zmq_trio import TrioSocket, ZmqContext
from ..wire import sglang_engine as sg_engine
from ..wire import tokenspeed_engine as ts_engine
from ..wire import vllm_handshake
from ..wire.sglang import SGLANG_VERSION
from ..wire.tokenspeed import TOKENSPEED_VERSION

__all__ = ["EngineSockets", "dial", "ready_response"]


def ready_response(
    max_model_len: int = 1024,
    *,
    runtime: Literal["vllm", "tokenspeed", "sglang"] = "vllm",
    engine_index: int = 0,
    max_num_seqs: int = 1024,
    build: str = "zmqdispatch.testing",
    **fields: Any,
) -> vllm_handshake.EngineCoreReadyResponse:
    """The ready response of a small CPU engine, as the engine sends it after INIT.

    Wire source: vLLM 0.32 ``EngineCoreProc``'s ready map, or TokenSpeed
    0.1.1's (``runtime="tokenspeed"``: ``vllm_version`` is
    ``tokenspeed-0.1.1+<build>``, which is how the client tells the runtimes
    apart, and ``kv_cache_size_tokens`` is set), or an SGLang 0.5.21 scheduler's
    (``runtime="sglang"``: ``sglang-0.5.21+<build>``, block size 1 (SGLang's page
    size), ``kv_cache_size_tokens`` set and SGLang 0.5.21's ``positional_layouts``).
    ``vllm_version`` is a checked
    release (``0.32.0``) with ``+<build>`` as its local part, so the client's
    version guard accepts it; ``num_gpu_blocks`` is 64 per 16 tokens of
    ``max_model_len`` (block size 16); ``data_parallel_rank`` and
    ``instance_id`` follow ``engine_index``. *fields* override any field of
    ``wire.vllm_handshake.EngineCoreReadyResponse`` (e.g. ``vllm_version="0.34.0"`` to
    test the guard).

    Raises:
        TypeError: a name in *fields* that is not a field of the response.
    """
    tokenspeed = runtime == "tokenspeed"
    blocks = max(1, max_model_len // 16) * 64
    if runtime == "sglang":
        values: dict[str, Any] = {
            "max_model_len": max_model_len, "num_gpu_blocks": blocks * 16, "block_size": 1, "dtype": "bfloat16",
            "vllm_version": f"sglang-{SGLANG_VERSION}+{build}", "data_parallel_rank": engine_index,
            "max_num_seqs": max_num_seqs, "instance_id": f"{build.replace('.', '-')}-{engine_index}",
            "kv_cache_size_tokens": blocks * 16, "positional_layouts": sg_engine.ready_layouts(),
        }
        values.update(fields)
        return vllm_handshake.EngineCoreReadyResponse(**values)
    values = {
        "max_model_len": max_model_len,
        "num_gpu_blocks": blocks,
        "block_size": 16,
        "dtype": "float32",
        "vllm_version": f"tokenspeed-{TOKENSPEED_VERSION}+{build}" if tokenspeed else f"0.32.0+{build}",
        "data_parallel_rank": engine_index,
        "max_num_seqs": max_num_seqs,
        "instance_id": f"{build.replace('.', '-')}-{engine_index}",
        "kv_cache_size_tokens": blocks * 16 if tokenspeed else None,
    }
    values.update(fields)
    return vllm_handshake.EngineCoreReadyResponse(**values)


@attrs.define(eq=False)
class EngineSockets:
    """An engine's data-plane sockets after the handshake.

    Attributes:
        input: DEALER receiving ``[type, payload, *aux]`` from the client.
        output: PUSH sending ``[payload, *aux]`` (EngineCoreOutputs, sentinel).
        engine_index: the DP rank this engine announced.
    """

    input: TrioSocket
    output: TrioSocket
    engine_index: int
    #: the handshake DEALER, kept open when READY was held back (a slow engine)
    handshake: TrioSocket | None = None
    #: monitor of ``input`` (``EVENT_DISCONNECTED | EVENT_HANDSHAKE_SUCCEEDED``)
    #: when dialed with ``monitor_input=True``: the client's departure and return
    input_monitor: TrioSocket | None = None

    def close(self, *, output_linger_ms: int = 0) -> None:
        """Close the sockets (linger 0; the output's *output_linger_ms*). Idempotent."""
        if self.input_monitor is not None:
            self.input.disable_monitor()
            self.input_monitor.close()
        self.input.close()
        self.output.close(linger_ms=output_linger_ms)
        if self.handshake is not None:
            self.handshake.close()


async def dial(
    handshake_address: str,
    ready: vllm_handshake.EngineCoreReadyResponse,
    *,
    engine_index: int = 0,
    local: bool = True,
    headless: bool = False,
    send_ready_response: bool = True,
    send_ready: bool = True,
    input_rcvhwm: int = 0,
    tokenspeed: bool = False,
    sglang: bool = False,
    monitor_input: bool = False,
    hang_up_after: Literal["HELLO", "INIT", "READY"] | None = None,
) -> EngineSockets:
    """Do the engine half of the handshake and return the data-plane sockets.

    The caller owns them and must close them (:meth:`EngineSockets.close`):
    sockets left to the garbage collector close with linger 0 and may discard
    the ready response before it left.

    ``send_ready_response`` / ``send_ready`` = False script a handshake that
    never completes (fault injection); without READY the handshake connection
    stays open (in ``EngineSockets.handshake``), as a slow engine's does.
    ``input_rcvhwm`` is 0 (unbounded) as in vLLM; a small value lets a test
    make the client's sends block. ``monitor_input`` adds
    ``EngineSockets.input_monitor``. ``hang_up_after`` scripts an engine that
    dies in its handshake: right after sending HELLO, after receiving INIT, or
    after sending READY, it closes every socket (what it sent is still
    delivered: 1 s linger) and returns them closed. TokenSpeed sends READY
    before its ready response, so that handshake never completes; vLLM sends
    it last, so ``"READY"`` is an engine that dies as its handshake completes
    (the client may see the handshake fail, or complete and the engine die).
    ``sglang=True``: the SGLang plugin's handshake, TokenSpeed's order and maps with
    the ready response as the plugin writes it (``block_size``, ``positional_layouts``).

    Raises:
        InvalidAddressError: libzmq refused an address (the handshake
            address, or one the INIT named).

    Cancellation: the sockets created so far are closed.
    """
    ctx = ZmqContext()
    identity = engine_index.to_bytes(2, "little")
    hs = ctx.socket(zmq.DEALER, name="engine-handshake", identity=identity)
    inp = ctx.socket(zmq.DEALER, name="engine-input", identity=identity, rcvhwm=input_rcvhwm)
    out = ctx.socket(zmq.PUSH, name="engine-output", sndhwm=0)
    # Created before connect, so that no event of the input connection is missed.
    mon = inp.monitor(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                      name="engine-input-monitor") if monitor_input else None

    def hang_up(stage: str) -> bool:
        if hang_up_after != stage:
            return False
        if mon is not None:
            inp.disable_monitor()
            mon.close()
        for sock in (inp, out, hs):
            sock.close(linger_ms=1000)
        return True

    try:
        hs.connect(handshake_address, role="handshake_address")
        if tokenspeed or sglang:
            await hs.send([ts_engine.encode_hello()])
            if hang_up("HELLO"):
                return EngineSockets(inp, out, engine_index)
            # TokenSpeed takes the last frame of the INIT message as its payload.
            init = vllm_handshake.decode_init((await hs.recv_multipart())[-1])
            if hang_up("INIT"):
                return EngineSockets(inp, out, engine_index)
            if send_ready:
                await hs.send([ts_engine.encode_ready()])
            if hang_up("READY"):
                return EngineSockets(inp, out, engine_index)
            inp.connect(init.inputs[0])
            if send_ready_response:
                await inp.send([vllm_handshake.encode_ready_response(ready) if sglang
                                else ts_engine.encode_ready_response(ready)])
            out.connect(init.outputs[0])
        else:
            await hs.send([vllm_handshake.encode_hello(local=local, headless=headless)])
            if hang_up("HELLO"):
                return EngineSockets(inp, out, engine_index)
            (init_payload,) = await hs.recv_multipart()
            init = vllm_handshake.decode_init(init_payload)
            if hang_up("INIT"):
                return EngineSockets(inp, out, engine_index)
            inp.connect(init.inputs[0])
            out.connect(init.outputs[0])
            if send_ready_response:
                await inp.send([vllm_handshake.encode_ready_response(ready)])
            if send_ready:
                await hs.send([vllm_handshake.encode_ready(local=local, headless=headless)])
            if hang_up("READY"):
                return EngineSockets(inp, out, engine_index)
    except BaseException:
        EngineSockets(inp, out, engine_index, hs, mon).close()
        raise
    if not send_ready:
        return EngineSockets(inp, out, engine_index, hs, mon)
    # vLLM's engine lingers 5 s on this socket so READY is not lost (TokenSpeed's too).
    hs.close(linger_ms=5000)
    return EngineSockets(inp, out, engine_index, input_monitor=mon)
