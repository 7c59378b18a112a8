"""The benchmark engine: a vLLM EngineCore stand-in built to outrun its client.

Run as ``python -m zmqdispatch.bench.engine``. It attaches like a vLLM engine,
then emits one ``EngineCoreOutputs`` per step covering every running request,
and it does so fast enough that the client, not the engine, is what a
benchmark measures (it reports its own maximum rate to prove it).

``--runtime tokenspeed`` / ``sglang``: it attaches with that runtime's
handshake (:func:`zmqdispatch.testing.dial.dial`, ``docs/tokenspeed-wire.md``
§1.4), decodes its ADD / ABORT (SGLang: and CONTROL, answered as
:class:`zmqdispatch.mock.sglang_core.MockSGLangScheduler` does) and emits one
column-major batch per step (:mod:`.batches`), with the same lifecycle, token
ids, step table, credit window and control socket as below. Those batches
carry no timestamp: clients map a delivery's last token id to its step's send
time in ``table``. Only the handshake attach exists for them (the raw loop and
vLLM's client speak the vLLM wire only).

Attaching (two ways, both vLLM 0.32's engine side, ``docs/vllm-wire.md`` §5.1):

- ``--handshake-address ADDR``: dial the client's handshake ROUTER (HELLO ->
  INIT -> ready response on the input socket -> READY), with
  :mod:`zmqdispatch.testing.dial`. For ``zmqdispatch.connect()``.
- ``--input-address A --output-address B``: dial the data-plane sockets
  directly and send the ready response, which is what an engine does after an
  INIT handed out by someone else. For vLLM's own ``AsyncLLM`` /
  ``AsyncMPClient`` given ``client_addresses`` (they bind input and output and
  wait for the ready response; the handshake belongs to whoever started the
  engine), and for the raw pyzmq loop.

What it does on the wire: ADD, ABORT and UTILITY are decoded with
:mod:`zmqdispatch.wire`; utility calls are answered as
:class:`zmqdispatch.mock.core.MockEngineCore` does. A request's first output
carries ``prefill_stats``; a request with ``max_tokens`` gets a final LENGTH
output with exactly ``max_tokens`` tokens in all; an aborted request gets
nothing more. Token ids are the step number (``token_for_step``), the same for
every request of a step: a client that cannot see ``EngineCoreOutputs.timestamp``
(vLLM's ``RequestOutput`` does not carry it) can still map a delivery to the
step that produced it, with the per-step send times from ``table``.

Speed (:class:`StepEncoder`): each running request's row is encoded once by
:func:`zmqdispatch.wire.vllm_engine.encode_outputs` and split around its token array;
a step is then one ``bytes.join`` of the cached pieces with this step's packed
tokens as the separator, and ``timestamp`` is this process's
``time.monotonic()`` packed right before the join and the send. The loop is a
plain blocking pyzmq loop, not trio (this program is a load generator, not
part of the library's I/O shell).

Credit window: a step goes out only while ``sent - acked < window`` request
ticks, ``acked`` being what the client's consumers reported. Without it, an
engine stepping "as fast as possible" against a slower client grows the
client's receive queue without bound (vLLM's sockets and ours use HWM 0), and
throughput and memory then measure that queue. Acks travel through a FIFO
(``--ack-fifo``, created here; 16-byte records ``struct "<IIQ"``: epoch, 0,
request-ticks received in all), not a zmq socket: one ``os.write`` per ack
costs the client a syscall, where a zmq send would also wake its libzmq I/O
thread, which on a 2-core machine preempts the client (seen as ~5 % of its
time in py-spy).

Control socket (``--control ADDR``, bound here as a ROUTER; frames after the
peer identity):

================  =============================================  ====================
request           meaning                                        reply
================  =============================================  ====================
``cfg JSON``      mode (run / hold), step_interval_ms,           ``{"epoch": E, ...}``
                  tokens_per_tick, window; new epoch, counters
``mark``          start a measurement window (counters, table)   stats JSON
``stats``         counters since ``mark``                        stats JSON
``table``         send times of the steps since ``mark``         header JSON, float64s
``stop``          exit                                           ``{}``
================  =============================================  ====================
"""

from __future__ import annotations

from collections.abc import Mapping

import argparse
import itertools
import json
import math
import os
import signal
import struct
import sys
import time
from array import array
from typing import Any, cast

import msgpack
import trio
import zmq

from ._admitted import RunningRequests
from ..mock.core import MockEngineCore
from ..mock.sglang_core import MockSGLangScheduler
from ..testing.dial import dial as engine_dial
from ..testing.dial import ready_response
from ..wire import sglang as sg
from ..wire import sglang_engine as sg_engine
from ..wire import tokenspeed as ts
from ..wire import tokenspeed_engine as ts_engine
from ..wire import vllm as wire
from ..wire import vllm_engine as wire_engine
from ..wire import vllm_handshake as handshake
from . import batches

__all__ = ["StepEncoder", "BenchEngine", "open_ack_fifo", "token_for_step", "main", "RUNTIMES"]

#: ``--runtime`` values: the wire the engine speaks.
RUNTIMES = ("vllm", "tokenspeed", "sglang")
#: Token ids are ``step % TOKEN_MODULUS`` (below vLLM's int32 and our MAX_TOKEN_ID).
TOKEN_MODULUS = batches.TOKEN_MODULUS
#: SGLang's ``max_new_tokens`` when a request leaves it nil (as the mock scheduler).
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
#: A token id whose msgpack form (uint32, 0xce + 4 bytes) cannot occur in a UTF-8 id.
_SENTINEL = 0xFFFFFFFF
_SENTINEL_BYTES = b"\xce\xff\xff\xff\xff"
_ZERO_FLOAT = b"\xcb" + bytes(8)
_NIL = b"\xc0"
_ACK = struct.Struct("<IIQ")
_FLOAT = struct.Struct(">Bd")


def token_for_step(step: int) -> int:
    """The token id every request gets in step *step*."""
    return step % TOKEN_MODULUS


class StepEncoder(RunningRequests):
    """The running requests and the bytes of their next step (sans-IO).

    Request lifecycle: :meth:`add` -> first output (with ``prefill_stats``)
    in the next step -> one row of ``tokens_per_tick`` tokens per step ->
    a final LENGTH row once ``max_tokens`` tokens were sent (never, with
    ``max_tokens=None``). :meth:`remove` drops a request at any point.

    Args:
        engine_index: ``EngineCoreOutputs.engine_index``.
        tokens_per_tick: new tokens per request per step.
    """

    def __init__(self, *, engine_index: int = 0, tokens_per_tick: int = 1) -> None:
        if tokens_per_tick < 1:
            raise ValueError("tokens_per_tick must be >= 1")
        self.engine_index = engine_index
        self.tokens_per_tick = tokens_per_tick
        self._head = b"\x99" + msgpack.packb(engine_index)
        empty = wire_engine.encode_outputs(engine_index, [], timestamp=0.0, weight_version="default")[0]
        tail = empty[len(self._head) + 1 :]
        if not empty.startswith(self._head + b"\x90") or not tail.startswith(_NIL + _ZERO_FLOAT):
            raise AssertionError(f"unexpected EngineCoreOutputs layout: {empty.hex()}")
        self._tail_post = tail[len(_NIL + _ZERO_FLOAT) :]
        self._row_prefix = self._head + b"\x91"
        self._row_suffix = tail
        #: requests waiting for their first output: rid -> (prompt_len, max_tokens)
        self._new: dict[str, tuple[int, int | None]] = {}
        #: requests past their first output: rid -> (before-tokens, after-tokens) row pieces
        self._steady: dict[str, tuple[bytes, bytes]] = {}
        #: rid -> (final step, tokens in the final row)
        self._final: dict[str, tuple[int, int]] = {}
        self._final_at: dict[int, list[str]] = {}
        self._gaps: list[bytes] | None = None

    # ------------------------------------------------------------------ state

    @property
    def _started(self) -> Mapping[str, object]:
        return self._steady

    def remove(self, request_id: str) -> bool:
        """Drop a request (ABORT: no more output). False when unknown."""
        if self._new.pop(request_id, None) is not None:
            return True
        if self._steady.pop(request_id, None) is not None:
            self._final.pop(request_id, None)
            self._gaps = None
            return True
        return False

    def clear(self) -> None:
        """Drop every request."""
        self._new.clear()
        self._steady.clear()
        self._final.clear()
        self._final_at.clear()
        self._gaps = None

    # ------------------------------------------------------------------ encoding

    def _row(self, request_id: str, tokens: tuple[int, ...], **fields: Any) -> bytes:
        """One row, as vLLM's encoder writes it inside an EngineCoreOutputs."""
        out = wire_engine.EngineCoreOutput(request_id=request_id, new_token_ids=tokens, **fields)
        payload = wire_engine.encode_outputs(self.engine_index, [out], timestamp=0.0, weight_version="default")[0]
        if not payload.startswith(self._row_prefix) or not payload.endswith(self._row_suffix):
            raise AssertionError("unexpected EngineCoreOutputs layout")
        return payload[len(self._row_prefix) : len(payload) - len(self._row_suffix)]

    def _template(self, request_id: str) -> tuple[bytes, bytes]:
        k = self.tokens_per_tick
        row = self._row(request_id, (_SENTINEL,) * k)
        marker = wire.msgpack_array_header(k) + _SENTINEL_BYTES * k
        i = row.index(marker)
        cut = i + len(wire.msgpack_array_header(k))
        return row[:cut], row[i + len(marker) :]

    def _rebuild_gaps(self) -> list[bytes]:
        pieces = list(self._steady.values())
        gaps = [pieces[0][0]]
        for (_, after), (before, _) in itertools.pairwise(pieces):
            gaps.append(after + before)
        gaps.append(pieces[-1][1])
        self._gaps = gaps
        return gaps

    def encode_step(self, step: int, clock: Any = time.monotonic) -> tuple[bytes, float, int, int, list[str]]:
        """Advance every running request by one tick and encode the message.

        Args:
            step: the step number (its tokens are ``token_for_step(step)``).
            clock: called once, right before the bytes are joined, for
                ``EngineCoreOutputs.timestamp``.

        Returns:
            ``(payload, timestamp, rows, tokens, finished_ids)``; ``rows`` is 0
            (and the payload empty) when nothing is running.
        """
        k = self.tokens_per_tick
        tok = token_for_step(step)
        tok_bytes = msgpack.packb(tok)
        fixed: list[bytes] = []
        tokens = 0
        finished: list[str] = []
        # Final rows of requests that reach max_tokens in this step.
        due = self._final_at.pop(step, None)
        if due:
            for rid in due:
                final = self._final.pop(rid, None)
                if final is None or final[0] != step or rid not in self._steady:
                    continue  # aborted meanwhile
                del self._steady[rid]
                self._gaps = None
                n = final[1]
                fixed.append(self._row(rid, (tok,) * n, finish_reason=wire.FinishReason.LENGTH))
                tokens += n
                finished.append(rid)
        # First rows of new requests (prefill_stats); they join the steady rows
        # after this step.
        promoted: dict[str, tuple[bytes, bytes]] = {}
        if self._new:
            new, self._new = self._new, {}
            for rid, (prompt_len, max_tokens) in new.items():
                stats = wire_engine.PrefillStats(num_prompt_tokens=prompt_len, num_computed_tokens=prompt_len)
                if max_tokens is not None and max_tokens <= k:
                    fixed.append(self._row(rid, (tok,) * max_tokens, prefill_stats=stats,
                                           finish_reason=wire.FinishReason.LENGTH))
                    tokens += max_tokens
                    finished.append(rid)
                    continue
                fixed.append(self._row(rid, (tok,) * k, prefill_stats=stats))
                tokens += k
                promoted[rid] = self._template(rid)
                if max_tokens is not None:
                    ticks = -(-max_tokens // k)
                    last = step + ticks - 1
                    self._final[rid] = (last, max_tokens - (ticks - 1) * k)
                    self._final_at.setdefault(last, []).append(rid)
        try:
            return self._assemble(fixed, tokens, finished, tok_bytes * k, clock)
        finally:
            if promoted:
                self._steady.update(promoted)
                self._gaps = None

    def _assemble(self, fixed: list[bytes], tokens: int, finished: list[str], sep: bytes,
                  clock: Any) -> tuple[bytes, float, int, int, list[str]]:
        # Rows that reach their final step are already out of _steady and new
        # ones are not in it yet: the steady rows of this step are exactly the
        # cached pieces.
        n_steady = len(self._steady)
        rows = len(fixed) + n_steady
        if rows == 0:
            return b"", 0.0, 0, 0, finished
        tokens += n_steady * self.tokens_per_tick
        head = self._head + wire.msgpack_array_header(rows) + b"".join(fixed)
        if n_steady == 0:
            ts = clock()
            return head + _NIL + _FLOAT.pack(0xCB, ts) + self._tail_post, ts, rows, tokens, finished
        gaps = self._gaps if self._gaps is not None else self._rebuild_gaps()
        first, last = gaps[0], gaps[-1]
        ts = clock()
        gaps[0] = head + first
        gaps[-1] = last + _NIL + _FLOAT.pack(0xCB, ts) + self._tail_post
        try:
            payload = sep.join(gaps)
        finally:
            gaps[0], gaps[-1] = first, last
        return payload, ts, rows, tokens, finished


# ---------------------------------------------------------------------- attaching


def _data_sockets(
    ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, input_address: str, output_address: str
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, identity)
    inp.setsockopt(zmq.RCVHWM, 0)  # as vLLM's engine
    inp.setsockopt(zmq.LINGER, 0)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, 1000)
    inp.connect(input_address)
    out.connect(output_address)
    return inp, out


def dial(
    ctx: zmq.Context[zmq.Socket[bytes]],
    ready: handshake.EngineCoreReadyResponse,
    *,
    engine_index: int = 0,
    handshake_address: str | None = None,
    input_address: str | None = None,
    output_address: str | None = None,
    timeout: float = 300.0,
    runtime: str = "vllm",
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """Attach like a vLLM engine (or *runtime*'s); return the input DEALER and output PUSH.

    With *handshake_address*: the handshake of :func:`zmqdispatch.testing.dial.dial`
    (vLLM: HELLO, INIT, ready response on the input socket, READY; TokenSpeed and
    SGLang in their order), run once under trio, its data-plane sockets then
    handed to this blocking loop. Otherwise (vLLM only) dial *input_address* /
    *output_address* (in *ctx*) and send the ready response.

    Raises:
        TimeoutError: the handshake did not complete within *timeout* seconds.
        ValueError: no handshake address and not both data-plane addresses, or
            a direct dial for another runtime than vLLM.
    """
    if handshake_address is None:
        if input_address is None or output_address is None:
            raise ValueError("give a handshake address, or both input and output addresses")
        if runtime != "vllm":
            raise ValueError(f"runtime {runtime!r}: only the handshake attach (--handshake-address)")
        inp, out = _data_sockets(ctx, engine_index.to_bytes(2, "little"), input_address, output_address)
        inp.send(handshake.encode_ready_response(ready))
        return inp, out
    address = handshake_address

    async def attach() -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        with trio.move_on_after(timeout):
            socks = await engine_dial(address, ready, engine_index=engine_index, tokenspeed=runtime == "tokenspeed",
                                      sglang=runtime == "sglang")
            return socks.input.detach(), socks.output.detach()
        raise TimeoutError(f"no handshake with {address} within {timeout} s")

    inp, out = trio.run(attach)
    out.setsockopt(zmq.LINGER, 1000)
    return inp, out


# ---------------------------------------------------------------------- the engine


class _Counters:
    __slots__ = ("steps", "rows", "tokens", "busy", "late", "stalls", "wall0", "cpu0", "first_step")

    def __init__(self, step: int) -> None:
        self.steps = self.rows = self.tokens = self.late = self.stalls = 0
        self.busy = 0.0
        self.wall0 = time.monotonic()
        self.cpu0 = time.process_time()
        self.first_step = step


class BenchEngine:
    """The engine loop: input, control and steps on one thread (blocking pyzmq).

    Args:
        inp / out: the data-plane sockets from :func:`dial`.
        control: a bound ROUTER for the control requests (module doc), or None.
        mode: ``"run"`` steps while requests run; ``"hold"`` accepts requests
            and never steps (idle streams).
        step_interval: seconds between steps; 0 = as fast as the window allows.
        window: request-ticks in flight before a step waits for acks (0 = none).
        ack_fd: the read end of the ack FIFO (:func:`open_ack_fifo`), or None.
        runtime: the wire: ``"vllm"``, ``"tokenspeed"`` or ``"sglang"``.
        max_model_len: TokenSpeed fills the context when ``max_new_tokens`` is nil.
        kv_total: the TokenSpeed / SGLang load tail's KV capacity (pages / tokens).

    Raises:
        ValueError: an unknown *runtime*.
    """

    #: seconds between input/control drains while stepping flat out
    IO_INTERVAL = 0.0002

    def __init__(
        self,
        inp: zmq.Socket[bytes],
        out: zmq.Socket[bytes],
        control: zmq.Socket[bytes] | None,
        *,
        engine_index: int = 0,
        mode: str = "run",
        step_interval: float = 0.0,
        tokens_per_tick: int = 1,
        window: int = 0,
        parent_pid: int | None = None,
        ack_fd: int | None = None,
        runtime: str = "vllm",
        max_model_len: int = 2**20,
        kv_total: int = 0,
    ) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
        self.inp, self.out, self.control = inp, out, control
        self.engine_index = engine_index
        self.runtime = runtime
        self.max_model_len = max_model_len
        self.kv_total = kv_total
        self.encoder = self._make_encoder(tokens_per_tick)
        self.sglang_control = MockSGLangScheduler(engine_index=engine_index) if runtime == "sglang" else None
        self.mode = mode
        self.step_interval = step_interval
        self.window = window
        self.parent_pid = parent_pid
        self.utility = MockEngineCore(engine_index=engine_index)
        self.step = 0
        self.epoch = 0
        self.sent = 0  # request-ticks sent in this epoch
        self.acked = 0  # request-ticks the consumers reported in this epoch
        self.next_step = 0.0
        self.adds = self.aborts = self.errors = 0
        self.counters = _Counters(0)
        self.table = array("d")
        self.stopping = False
        self.ack_fd = ack_fd
        self._ack_buf = b""

    def _make_encoder(self, tokens_per_tick: int) -> StepEncoder | batches.BatchStepEncoder:
        if self.runtime == "vllm":
            return StepEncoder(engine_index=self.engine_index, tokens_per_tick=tokens_per_tick)
        return batches.make_step_encoder(self.runtime, engine_index=self.engine_index,
                                         tokens_per_tick=tokens_per_tick, kv_total=self.kv_total)

    def _read_acks(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        buf = self._ack_buf + data
        size = _ACK.size
        whole = len(buf) - len(buf) % size
        for off in range(0, whole, size):
            epoch, _, total = _ACK.unpack_from(buf, off)
            if epoch == self.epoch and total > self.acked:
                self.acked = total
        self._ack_buf = buf[whole:]

    # ------------------------------------------------------------------ input

    def _admit(self, request_id: str, prompt_len: int, max_tokens: int | None) -> None:
        was_idle = self.encoder.running == 0
        self.encoder.add(request_id, prompt_len, max_tokens)
        self.adds += 1
        if was_idle:
            self.next_step = time.monotonic()

    def _on_input_tokenspeed(self, frames: list[bytes]) -> None:
        _, body = ts_engine.decode_input(frames)
        if not isinstance(body, ts.TokenizedGenerateReqInput):  # an ABORT: its request ids
            for rid in body:
                self.aborts += self.encoder.remove(rid)
            return
        prompt = len(body.input_ids or ())
        max_new = body.sampling_params.max_new_tokens
        # nil fills the context, as TokenSpeed does
        self._admit(body.rid, prompt, max(1, self.max_model_len - prompt - 1) if max_new is None else max_new)

    def _on_input_sglang(self, frames: list[bytes]) -> None:
        kind, body = sg_engine.decode_input(frames)
        if kind is sg.RequestType.CONTROL:
            assert self.sglang_control is not None
            call_id, method, args = cast(sg_engine.ControlCall, body)
            self.out.send(sg_engine.encode_control_reply(self.sglang_control.control(call_id, method, args)))
            return
        if not isinstance(body, sg.TokenizedGenerateReqInput):  # an ABORT: its request ids
            # Exact ids: SGLang also aborts every rid that starts with one, which no cell relies on.
            for rid in cast(tuple[str, ...], body):
                self.aborts += self.encoder.remove(rid)
            return
        max_new = body.sampling_params.max_new_tokens
        self._admit(body.rid, len(body.input_ids or ()), SGLANG_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new)

    def _on_input(self, frames: list[bytes]) -> None:
        if self.runtime != "vllm":
            try:
                if self.runtime == "tokenspeed":
                    self._on_input_tokenspeed(frames)
                else:
                    self._on_input_sglang(frames)
            except Exception as exc:  # a bad message is counted, never fatal here
                self.errors += 1
                print(f"bench engine: bad input message: {exc!r}", file=sys.stderr, flush=True)
            return
        kind = frames[0][0] if frames and len(frames[0]) == 1 else -1
        try:
            if kind == wire.RequestType.ADD:
                req = wire_engine.decode_request(frames[1:])
                sp = req.sampling_params
                self._admit(req.request_id, len(req.prompt_token_ids or ()), sp.max_tokens if sp else None)
            elif kind == wire.RequestType.ABORT:
                for rid in wire_engine.decode_abort(frames[1]):
                    self.aborts += self.encoder.remove(rid)
            elif kind == wire.RequestType.UTILITY:
                call = wire_engine.decode_utility_call(frames[1])
                result: object
                failure: str | None
                if call.method == "zmqd_live_requests":
                    result, failure = self.encoder.running, None
                else:
                    result, failure = self.utility.utility(call.method, tuple(call.args))
                reply = wire.UtilityOutput(
                    call_id=call.call_id,
                    failure_message=failure,
                    result=None if failure else wire.UtilityResult(result),
                )
                self.out.send_multipart(
                    wire_engine.encode_utility_output(self.engine_index, reply, timestamp=time.monotonic()))
            else:
                self.errors += 1
        except Exception as exc:  # a bad message is counted, never fatal here
            self.errors += 1
            print(f"bench engine: bad input message: {exc!r}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ control

    def _stats(self) -> dict[str, Any]:
        c = self.counters
        wall = time.monotonic() - c.wall0
        return {
            "epoch": self.epoch,
            "runtime": self.runtime,
            "running": self.encoder.running,
            "adds": self.adds,
            "aborts": self.aborts,
            "errors": self.errors,
            "steps": c.steps,
            "rows": c.rows,
            "tokens": c.tokens,
            "late_steps": c.late,
            "window_stalls": c.stalls,
            "wall_s": wall,
            "cpu_s": time.process_time() - c.cpu0,
            "busy_s": c.busy,
            "steps_per_s": c.steps / wall if wall > 0 else 0.0,
            # What this engine could emit if it did nothing but build and send.
            "max_steps_per_s": c.steps / c.busy if c.busy > 0 else None,
            "max_request_ticks_per_s": c.rows / c.busy if c.busy > 0 else None,
            "first_step": c.first_step,
            "step": self.step,
            "sent": self.sent,
            "acked": self.acked,
        }

    def _on_control(self, ctl: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        peer, op = frames[0], frames[1]
        if op == b"cfg":
            cfg = json.loads(frames[2])
            reply = self._configure(cfg)
        elif op == b"mark":
            self.counters = _Counters(self.step)
            self.table = array("d")
            reply = self._stats()
        elif op == b"stats":
            reply = self._stats()
        elif op == b"table":
            header = json.dumps({"first_step": self.counters.first_step, "steps": len(self.table)}).encode()
            ctl.send_multipart([peer, header, self.table.tobytes()])
            return
        elif op == b"stop":
            self.stopping = True
            reply = {}
        else:
            reply = {"error": f"unknown control op {op!r}"}
        ctl.send_multipart([peer, json.dumps(reply).encode()])

    def _configure(self, cfg: dict[str, Any]) -> dict[str, Any]:
        if "tokens_per_tick" in cfg and cfg["tokens_per_tick"] != self.encoder.tokens_per_tick:
            if self.encoder.running:
                return {"error": "tokens_per_tick can change only while nothing runs"}
            self.encoder = self._make_encoder(int(cfg["tokens_per_tick"]))
        if "mode" in cfg:
            if cfg["mode"] not in ("run", "hold"):
                return {"error": f"unknown mode {cfg['mode']!r}"}
            self.mode = cfg["mode"]
        if "step_interval_ms" in cfg:
            self.step_interval = float(cfg["step_interval_ms"]) / 1000.0
        if "window" in cfg:
            self.window = int(cfg["window"])
        self.epoch += 1
        self.sent = self.acked = 0
        self.next_step = time.monotonic()
        return {"epoch": self.epoch, **self._stats()}

    # ------------------------------------------------------------------ loop

    def _drain(self) -> None:
        inp, ctl = self.inp, self.control
        if self.ack_fd is not None:
            self._read_acks(self.ack_fd)
        while True:
            try:
                frames = inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_input(frames)
        while ctl is not None:
            try:
                frames = ctl.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_control(ctl, frames)

    def _wait(self, now: float) -> float | None:
        """Seconds until the next step may go (<= 0: now), None: not until an event."""
        if self.mode != "run" or self.encoder.running == 0:
            return None
        if self.window and self.sent - self.acked >= self.window:
            return None
        return self.next_step - now if self.step_interval > 0 else 0.0

    def _do_step(self, now: float) -> None:
        c = self.counters
        if self.step_interval > 0:
            if now - self.next_step > self.step_interval:
                c.late += 1
                self.next_step = now  # fell behind: keep the interval from here
            self.next_step += self.step_interval
        t0 = time.thread_time()  # CPU time: a descheduled engine is not a slow one
        payload, ts, rows, tokens, _ = self.encoder.encode_step(self.step)
        if rows:
            self.out.send(payload, 0, copy=len(payload) < 65536)
        c.busy += time.thread_time() - t0
        if rows:
            self.table.append(ts)
            self.step += 1
            self.sent += rows
            c.steps += 1
            c.rows += rows
            c.tokens += tokens

    def serve(self) -> None:
        """Run until ``stop``, SIGTERM, or the parent process is gone."""
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
        # Acks wake the engine only while the window holds a step back: an
        # ack that wakes an engine which has nothing to do would take the
        # client's core away from it at once (wake-up preemption).
        stalled_poller = zmq.Poller()
        for sock in (self.inp, self.control, self.ack_fd):
            if sock is not None:
                stalled_poller.register(sock, zmq.POLLIN)
        last_io = 0.0
        last_parent_check = time.monotonic()
        while not self.stopping:
            now = time.monotonic()
            wait = self._wait(now)
            if wait is not None and wait <= 0:
                if now - last_io >= self.IO_INTERVAL:
                    self._drain()
                    last_io = now
                    if self._wait(now) != wait:
                        continue
                self._do_step(now)
                continue
            if wait is not None and wait < 0.001:
                time.sleep(wait)
                continue
            timeout = 500 if wait is None else min(500, math.floor(wait * 1000.0))
            if self.window and wait is None and self.encoder.running and self.mode == "run":
                self.counters.stalls += 1
                stalled_poller.poll(timeout)
            else:
                poller.poll(timeout)
            self._drain()
            last_io = time.monotonic()
            if last_io - last_parent_check > 1.0:
                last_parent_check = last_io
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    return


def open_ack_fifo(path: str) -> int:
    """Create the ack FIFO and open its read end (non-blocking). A write end
    stays open here too, so a client closing its end never makes the read
    side report EOF (which would make the poller spin)."""
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # keep-alive writer, closed at exit
    return fd


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zmqdispatch.bench.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--handshake-address", help="dial this handshake ROUTER (zmqdispatch.connect)")
    p.add_argument("--input-address", help="dial the input ROUTER directly (vLLM client_addresses, raw loop)")
    p.add_argument("--output-address", help="dial the output PULL directly")
    p.add_argument("--control", help="bind the control ROUTER here")
    p.add_argument("--ack-fifo", help="create this FIFO and read the consumers' acks from it")
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the wire to speak (tokenspeed, sglang: with --handshake-address only)")
    p.add_argument("--engine-index", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2**20)
    p.add_argument("--mode", choices=("run", "hold"), default="run")
    p.add_argument("--step-interval-ms", type=float, default=0.0)
    p.add_argument("--tokens-per-tick", type=int, default=1)
    p.add_argument("--window", type=int, default=0, help="request-ticks in flight before waiting for acks (0: none)")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.runtime != "vllm" and not args.handshake_address:
        parser.error(f"--runtime {args.runtime} needs --handshake-address (the direct dial is vLLM's)")
    # SIGTERM (the runner, or zmqdispatch's launch= teardown) ends the loop
    # wherever it is, like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    # Before dialing: a client opens the FIFO's write end once we answered.
    ack_fd = open_ack_fifo(args.ack_fifo) if args.ack_fifo else None
    try:
        control = None
        if args.control:
            control = ctx.socket(zmq.ROUTER)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(args.control)
            socks.append(control)
        ready = ready_response(args.max_model_len, runtime=args.runtime, engine_index=args.engine_index,
                               max_num_seqs=65536, build="zmqdispatch.bench")
        inp, out = dial(
            ctx,
            ready,
            engine_index=args.engine_index,
            handshake_address=args.handshake_address,
            input_address=args.input_address,
            output_address=args.output_address,
            runtime=args.runtime,
        )
        socks += [inp, out]
        engine = BenchEngine(
            inp,
            out,
            control,
            engine_index=args.engine_index,
            mode=args.mode,
            step_interval=args.step_interval_ms / 1000.0,
            tokens_per_tick=args.tokens_per_tick,
            window=args.window,
            parent_pid=args.parent_pid,
            ack_fd=ack_fd,
            runtime=args.runtime,
            max_model_len=args.max_model_len,
            # the load tail's capacity: TokenSpeed in pages, SGLang in tokens (its ready response's)
            kv_total=ready.num_gpu_blocks if args.runtime == "tokenspeed" else (ready.kv_cache_size_tokens or 0),
        )
        engine.serve()
    except KeyboardInterrupt:
        pass
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
