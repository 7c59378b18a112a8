"""Sans-IO output routing of one engine link: the rules by which a received
output message reaches the requests' mailboxes, mixed into
:class:`~.engine.EngineProtocol` (:class:`OutputRouting`).

- **Decode.** :meth:`OutputRouting.frames_received` decodes one message of the
  link's dialect; the ``ENGINE_CORE_DEAD`` sentinel kills the link at once,
  ``max_decode_errors`` undecodable messages in a row kill it, a single one
  fails every live request whose ADD may have reached the engine (the message
  may have carried their tokens).
- **Route and retire.** Each row goes to its :class:`~.mailbox.Mailbox`
  without waiting; terminal rows, ids in vLLM's ``finished_requests``, rows
  that do not decode and slow consumers (``max_pending_tokens``) retire their
  entry (``on_retired``), the last two also aborted on the engine. Outputs
  for unknown ids (normal after an abort) are counted and dropped; a
  TokenSpeed finish of an unknown id notes a parked ABORT. TokenSpeed's
  ``"abort"`` / ``"error"`` finishes fail the stream with a typed error.
- **Load.** A load report (vLLM ``scheduler_stats``, TokenSpeed's piggybacked
  snapshot, SGLang's load tail in tokens) goes to ``on_load`` before the rows
  of its message. SGLang's ``"abort"`` fails the stream with its reason and status.
- **Utility replies** (SGLang: ``ControlReplySlim``) settle their
  :class:`~.messages.PendingUtilityCall`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import (
    EngineAbortedRequest,
    EngineDeadError,
    EngineRequestError,
    RemoteProtocolError,
    UtilityCallError,
)
from ..wire import sglang as sg
from ..wire import tokenspeed as ts
from ..wire import vllm as wire
from .mailbox import PUT_MORE, PUT_OVERFLOW, Mailbox
from .messages import LinkState, PendingUtilityCall, SendState
from .runtime import Runtime
from .stats import LinkStats

__all__ = ["OutputRouting"]

#: TokenSpeed finish strings -> what the stream reports ("abort" and "error" fail it).
_TS_FINISH = {"stop": wire.FinishReason.STOP, "length": wire.FinishReason.LENGTH}

_log = logging.getLogger("zmqdispatch.protocol")
#: bytes of an undecodable message shown (hex) in its warning
_DECODE_ERROR_PREVIEW = 32


def _preview(frames: list[bytes], n: int) -> bytes:
    """The first *n* bytes of the concatenated *frames*, without joining them all
    (an undecodable message can be megabytes)."""
    head = bytearray()
    for f in frames:
        head += f[: n - len(head)]
        if len(head) >= n:
            break
    return bytes(head)


class OutputRouting:
    """The inbound half of :class:`~.engine.EngineProtocol` (its base class):
    routing, retiring and load reports. The state it reads and retires from
    is :class:`~.engine.EngineProtocol`'s, declared here for the type checker
    and set by its ``__init__``."""

    runtime: Runtime
    state: LinkState
    timer: Callable[[], float]
    now: float
    stats: LinkStats
    engine_index: int
    max_decode_errors: int
    on_retired: Callable[[Mailbox], None] | None
    on_load: Callable[[Any, float | None], None] | None
    load: ts.LoadSnapshot | sg.SGLangLoad | None
    unknown_outputs: int
    decode_errors: int
    decode_error_streak: int
    messages_received: int
    bad_rows: int
    unknown_finish_reasons: int
    last_decode_error: RemoteProtocolError | None
    _requests: dict[str, Mailbox]
    _utility: dict[int, PendingUtilityCall]

    if TYPE_CHECKING:  # EngineProtocol's
        def engine_died(self, exc: EngineDeadError) -> None: ...
        def _queue_abort(self, wire_id: str) -> None: ...
        def _note_parked(self, rid: str) -> None: ...
        def _wake_sender(self) -> None: ...


    def frames_received(self, frames: list[bytes], now: float | None = None) -> None:
        """Route one message from the output PULL socket. Never raises.

        *now*: its receipt time on the ``timer`` clock (default: read it).
        Undecodable messages are counted; ``max_decode_errors`` in a row kill
        the link. The sentinel kills it at once.
        """
        if self.state is LinkState.DEAD:
            return
        self.now = self.timer() if now is None else now
        self.messages_received += 1
        if wire.is_dead_sentinel(frames):
            self.engine_died(
                EngineDeadError(
                    f"engine {self.engine_index} sent ENGINE_CORE_DEAD (fatal engine error; see engine logs)",
                    engine_index=self.engine_index,
                    reason="sentinel",
                )
            )
            return
        try:
            if self.runtime is Runtime.VLLM:
                msg = wire.decode_outputs(frames)
            elif self.runtime is Runtime.SGLANG:
                sgl = sg.decode_outputs(frames)
            else:
                batch = ts.decode_outputs(frames)
        except RemoteProtocolError as exc:
            self.decode_errors += 1
            self.decode_error_streak += 1
            self.last_decode_error = exc
            size = sum(len(f) for f in frames)
            head = _preview(frames, _DECODE_ERROR_PREVIEW)
            _log.warning(
                "engine %d: undecodable output message (%d bytes in %d frames, first bytes %s%s): %s; "
                "%d in a row (max_decode_errors=%d), %d live requests failed",
                self.engine_index, size, len(frames), head.hex(), "..." if size > len(head) else "", exc,
                self.decode_error_streak, self.max_decode_errors,
                len(self._requests) if self.decode_error_streak < self.max_decode_errors else 0,
            )
            if self.decode_error_streak >= self.max_decode_errors:
                self.engine_died(
                    EngineDeadError(
                        f"engine {self.engine_index}: {self.decode_error_streak} undecodable output "
                        f"messages in a row (last: {exc})",
                        engine_index=self.engine_index,
                        reason="decode_errors",
                    )
                )
            else:
                # The message may have carried tokens of any live request: fail
                # them rather than let a stream silently miss tokens or wait for
                # a final output that was in it.
                self._fail_requests(list(self._requests), exc)
            return
        self.decode_error_streak = 0
        if self.runtime is Runtime.VLLM:
            self._route(msg, frames)
        elif self.runtime is Runtime.SGLANG:
            if isinstance(sgl, sg.ControlReply):
                self._control_reply(sgl)
            else:
                self._route_sglang(sgl)
        else:
            self._route_tokenspeed(batch)

    def _route(self, msg: wire.EngineCoreOutputs, frames: list[bytes]) -> None:
        requests = self._requests
        ts = msg.timestamp
        if msg.scheduler_stats is not None and self.on_load is not None:
            self.on_load(msg.scheduler_stats, ts)
        to_abort: list[str] | None = None
        unknown = self.unknown_outputs
        for row in msg.outputs:
            rid = row.request_id
            mb = requests.get(rid)
            if mb is None:
                self.unknown_outputs += 1
                continue
            try:
                status = mb.put(row, frames, ts)
            except RemoteProtocolError as exc:
                # This request's logprobs do not decode: fail it alone.
                mb.fail(exc)
                self._retire(rid, mb)
                (to_abort := to_abort or []).append(rid)
                continue
            if status != PUT_MORE and self._put_ended(rid, mb, status):
                (to_abort := to_abort or []).append(rid)
        if msg.outputs:
            self.stats.routed(msg.outputs, len(msg.outputs) - (self.unknown_outputs - unknown), self.now)
        if msg.bad_rows:
            self.bad_rows += len(msg.bad_rows)
            unattributed = [row_error for bad_rid, row_error in msg.bad_rows if bad_rid is None]
            for bad_rid, row_error in msg.bad_rows:
                if bad_rid is not None and bad_rid in requests:
                    self._fail_requests([bad_rid], row_error)
            if unattributed:
                # A row without a readable id may have been any request that got
                # no valid row in this message (one row per request per step).
                seen = {row.request_id for row in msg.outputs}
                self._fail_requests([rid for rid in requests if rid not in seen], unattributed[0])
        if msg.finished_requests:
            # Engine-generated finishes may list ids without a terminal row
            # (docs/reference-gateway-lessons.md lesson 11b: retire the union of both).
            for rid in msg.finished_requests:
                entry = requests.pop(rid, None)
                if entry is not None:
                    if self.on_retired is not None:
                        self.on_retired(entry)
                    entry.finish(wire.FinishReason.ABORT)
                    self.stats.count_finish(entry)
        if to_abort:
            for rid in to_abort:
                self._queue_abort(rid)
            self._wake_sender()
        uo = msg.utility_output
        if uo is not None:
            call = self._utility.pop(uo.call_id, None)
            if call is not None:
                if uo.failure_message is not None:
                    call.error = UtilityCallError(
                        f"utility call {call.method!r} failed on engine {self.engine_index}: {uo.failure_message}",
                        engine_index=self.engine_index,
                    )
                else:
                    call.result = None if uo.result is None else uo.result.value
                call.settle()

    def _route_tokenspeed(self, batch: ts.TokenSpeedBatch) -> None:
        """Route one TokenSpeed ``BatchTokenIDOutSlim`` (columns parallel to ``rids``)."""
        if batch.kv_total_pages > 0:
            self.load = batch.load
            if self.on_load is not None:
                self.on_load(batch.load, None)
        requests = self._requests
        to_abort: list[str] | None = None
        reasons = batch.finished_reasons
        unknown = self.unknown_outputs
        for i, rid in enumerate(batch.rids):
            mb = requests.get(rid)
            reason = reasons[i]
            if mb is None:
                self.unknown_outputs += 1
                if reason:
                    # The engine finished a request we no longer track: if we sent
                    # it an ABORT, that ABORT arrives (or arrived) after the finish
                    # and stays parked for the next request with this id.
                    self._note_parked(rid)
                continue
            finish = None
            if reason:
                finish = _TS_FINISH.get(reason)
                if finish is None and reason not in ("abort", "error"):
                    self.unknown_finish_reasons += 1  # a newer engine's reason: a stop, as SMG reads it
                    finish = wire.FinishReason.STOP
            prompt = batch.prompt_tokens[i]
            cached = batch.cached_tokens[i]
            try:
                status = PUT_MORE if finish is None and not batch.output_ids[i] else mb.put_tokens(
                    batch.output_ids[i],
                    finish,
                    batch.logprob_vals[i],
                    batch.logprob_ids[i],
                    prompt if prompt > 0 else None,
                    cached if cached > 0 else None,
                )
            except RemoteProtocolError as exc:
                mb.fail(exc)
                self._retire(rid, mb)
                (to_abort := to_abort or []).append(rid)
                continue
            if reason and finish is None:
                done = batch.completion_tokens[i]
                if reason == "abort":
                    what = (
                        "refused the request at admission (TokenSpeed sends no reason: a sampling value out of "
                        "range, logprobs on an engine without --enable-output-logprobs, a grammar that does not "
                        "compile, ...)"
                        if done == 0
                        else f"aborted the request after {done} tokens"
                    )
                    mb.fail(EngineAbortedRequest(f"request {mb.request_id!r}: the {self.runtime.engine_name} {what}",
                                                 request_id=mb.request_id, tokens_before_abort=done))
                else:
                    mb.fail(EngineRequestError(
                        f"request {mb.request_id!r}: engine finished the request with an error (see engine logs)",
                        request_id=mb.request_id))
                self._retire(rid, mb)
            elif status != PUT_MORE and self._put_ended(rid, mb, status):
                (to_abort := to_abort or []).append(rid)
        if batch.rids:
            self.stats.routed(batch.rids, len(batch.rids) - (self.unknown_outputs - unknown), self.now)
        if to_abort:
            for rid in to_abort:
                self._queue_abort(rid)
            self._wake_sender()

    def _control_reply(self, reply: sg.ControlReply) -> None:
        call = self._utility.pop(reply.call_id, None)
        if call is None:
            return  # timed out or cancelled: forgotten
        if reply.success:
            call.result = reply.message
        else:
            call.error = UtilityCallError(
                f"control call {call.method!r} failed on engine {self.engine_index}: "
                f"{reply.message or 'no reason given'}", engine_index=self.engine_index)
        call.settle()

    def _route_sglang(self, batch: sg.SGLangBatch) -> None:
        """Route one SGLang ``BatchTokenIDSlimOutput`` (columns parallel to ``rids``)."""
        load = batch.load
        if load is not None:
            self.load = load
            if self.on_load is not None:
                self.on_load(load, None)
        requests = self._requests
        to_abort: list[str] | None = None
        unknown = self.unknown_outputs
        tops = batch.top_logprob_vals
        for i, rid in enumerate(batch.rids):
            mb = requests.get(rid)
            if mb is None:
                self.unknown_outputs += 1
                continue
            reason = batch.finished_reasons[i]
            if reason == "abort":
                done = batch.completion_tokens[i]
                status = batch.finished_status[i] if batch.finished_status is not None else None
                why = batch.finished_messages[i] or "no reason given"
                what = "refused the request" if status == 400 else f"aborted the request after {done} tokens"
                mb.fail(EngineAbortedRequest(
                    f"request {mb.request_id!r}: the {self.runtime.engine_name} {what}: {why}"
                    + (f" (status {status})" if status is not None else ""),
                    request_id=mb.request_id, tokens_before_abort=done, status=status))
                self._retire(rid, mb)
                continue
            finish = None
            if reason:
                finish = _TS_FINISH.get(reason)
                if finish is None:
                    self.unknown_finish_reasons += 1  # a newer reason: a stop, as the reference gateway reads it
                    finish = wire.FinishReason.STOP
            prompt = batch.prompt_tokens[i]
            cached = batch.cached_tokens[i]
            try:
                status_put = PUT_MORE if finish is None and not batch.output_ids[i] else mb.put_tokens(
                    batch.output_ids[i], finish, batch.logprob_vals[i], batch.logprob_ids[i],
                    prompt if prompt > 0 else None, cached if cached > 0 else None,
                    top_vals=tops[i] if tops is not None else None,
                    top_ids=batch.top_logprob_ids[i] if batch.top_logprob_ids is not None else None,
                    stop_reason=batch.finished_matched[i] if finish is not None else None,
                )
            except RemoteProtocolError as exc:
                mb.fail(exc)
                self._retire(rid, mb)
                (to_abort := to_abort or []).append(rid)
                continue
            if status_put != PUT_MORE and self._put_ended(rid, mb, status_put):
                (to_abort := to_abort or []).append(rid)
        if batch.rids:
            self.stats.routed(batch.rids, len(batch.rids) - (self.unknown_outputs - unknown), self.now)
        if to_abort:
            for rid in to_abort:
                self._queue_abort(rid)
            self._wake_sender()

    def _retire(self, rid: str, mb: Mailbox) -> None:
        """Stop routing to *rid* (its mailbox has ended or failed)."""
        del self._requests[rid]
        if self.on_retired is not None:
            self.on_retired(mb)

    def _put_ended(self, rid: str, mb: Mailbox, status: int) -> bool:
        """Retire *rid*, whose last put ended its mailbox (finished, or
        overflowed: a slow consumer). True: abort it on the engine."""
        self._retire(rid, mb)
        if status == PUT_OVERFLOW:
            self._slow_consumer(mb)
            return True
        self.stats.count_finish(mb)
        return False

    def _slow_consumer(self, mb: Mailbox) -> None:
        self.stats.slow_consumers += 1
        _log.warning("engine %d: %s", self.engine_index, mb.error)

    def _fail_requests(self, request_ids: list[str], exc: RemoteProtocolError) -> None:
        """Fail these live requests with *exc* (after tokens they already have)
        and abort them on the engine: their outputs can no longer be trusted.
        Requests whose ADD is still queued are left alone: the engine has not
        seen them, so no output was about them (and their ADD is still to go)."""
        woke = False
        requests = self._requests
        for rid in request_ids:
            entry = requests.get(rid)
            if entry is None or entry.add.state is SendState.QUEUED:
                continue
            self._retire(rid, entry)
            entry.fail(RemoteProtocolError(f"request {entry.request_id!r}: undecodable engine output: {exc}"))
            if self.state is LinkState.READY:
                self._queue_abort(rid)
                woke = True
        if woke:
            self._wake_sender()
