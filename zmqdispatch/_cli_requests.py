"""``zmqdispatch generate --requests FILE``: many requests, one client.

The input is proto-JSON ``GenerateRequest`` lines (``vllm.grpc.engine`` or
``tokenspeed.grpc.scheduler``); the output is one JSON object per response on
stdout, ``{"request_id": ID, "response": <proto-JSON GenerateResponse>}``
(a vLLM ``GenerateResponse`` carries no request id of its own). The rules
(``docs/cli.md``, "Many requests"):

- every line is read and checked before anything is sent (:func:`parse_requests`):
  one bad line rejects the whole input, each bad line named on stderr (exit 2);
- blank lines (only whitespace) are skipped; every other line must be one JSON
  object with a non-empty ``request_id``, unique in the input, whose
  engine-side ids (``<id>-<i>`` for the samples of ``n > 1``) are unique too;
- the requests then run concurrently through one client (:func:`run_requests`);
  their output lines interleave as the responses arrive, each line one whole
  object, flushed; a request that fails prints one stderr line naming its
  ``request_id`` and the others go on: exit 2 when any was rejected before it
  was sent (``RequestRejected``, known only once the engines are: a prompt past
  their ``max_model_len``, a ``data_parallel_rank`` naming no engine), else 3
  when any failed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO, cast

import attrs
import trio
from google.protobuf import json_format
from google.protobuf.message import Message

from .client import EngineClient
from .errors import RequestRejected, ZmqDispatchError
from .protocol.deadlines import Deadlines

__all__ = ["LineRejected", "RequestLine", "StdoutUnwritable", "parse_requests", "run_requests", "split_lines",
           "write_out"]


def generated_request_id(request: Message) -> str:
    """The ``request_id`` field of either runtime's generated ``GenerateRequest``
    (smg_grpc_proto ships no annotations: the stubs know only ``Message``)."""
    rid: str = cast(Any, request).request_id
    return rid


@attrs.frozen
class RequestLine:
    """One accepted input line.

    Attributes:
        line: its 1-based line number.
        request: the ``GenerateRequest`` it holds.
        engine_ids: the ids its samples will have on the engine (one, or
            ``n`` for ``n > 1``).
    """

    line: int
    request: Message
    engine_ids: tuple[str, ...]

    @property
    def request_id(self) -> str:
        return generated_request_id(self.request)


@attrs.frozen
class LineRejected:
    """One refused input line: its 1-based number, the field at fault ("" for
    the line as a whole) and why."""

    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def split_lines(text: str) -> list[str]:
    """*text* cut at ``\\n`` only (a trailing ``\\r`` dropped): JSON may carry
    U+2028 and other characters ``str.splitlines`` would cut at."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _describe(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def parse_requests(
    lines: Iterable[str],
    message_type: Callable[[], Message],
    check: Callable[[Message], Sequence[str]],
) -> tuple[list[RequestLine], list[LineRejected]]:
    """Parse and check every line; return the accepted requests and the refusals.

    Args:
        lines: the input, one request per item (see :func:`split_lines`).
        message_type: the runtime's ``GenerateRequest`` class.
        check: translates and checks one request without an engine; returns
            its engine-side ids, raises ``RequestRejected`` naming the field.

    A line is refused when it is not JSON, not a JSON object, not a proto-JSON
    ``GenerateRequest`` (an unknown field, a wrong type), has no
    ``request_id``, repeats one, maps a sample to an engine-side id another
    line uses, or fails *check*. Blank lines are skipped.
    """
    accepted: list[RequestLine] = []
    rejected: list[LineRejected] = []
    by_id: dict[str, int] = {}  # request_id -> line
    by_engine_id: dict[str, tuple[int, str]] = {}  # engine-side id -> (line, request_id)
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            pos = f" (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
            rejected.append(LineRejected(number, "", f"not JSON: {why}{pos}"))
            continue
        if not isinstance(obj, dict):
            rejected.append(
                LineRejected(number, "", f"expected a JSON object (a GenerateRequest), got {_describe(obj)}"))
            continue
        request = message_type()
        try:
            json_format.ParseDict(obj, request)
        except (json_format.ParseError, RecursionError) as exc:
            name = request.DESCRIPTOR.full_name
            rejected.append(LineRejected(number, "", f"not a proto-JSON {name}: {exc}"))
            continue
        rid = generated_request_id(request)
        if not rid:
            rejected.append(LineRejected(number, "request_id", "request_id is required (the output lines are keyed "
                                                               "by it; give each request its own)"))
            continue
        if rid in by_id:
            rejected.append(LineRejected(number, "request_id",
                                         f"duplicate request_id {json.dumps(rid)} (also on line {by_id[rid]})"))
            continue
        try:
            engine_ids = tuple(check(request))
        except RequestRejected as exc:
            field = f" {exc.field}" if exc.field and not str(exc).startswith(exc.field) else ""
            rejected.append(LineRejected(number, exc.field, f"request_id {json.dumps(rid)} rejected:{field} {exc}"))
            continue
        clash = next((e for e in engine_ids if e in by_engine_id), None)
        if clash is not None:
            other_line, other_rid = by_engine_id[clash]
            rejected.append(LineRejected(
                number, "request_id",
                f"request_id {json.dumps(rid)} is sent to the engine as {json.dumps(clash)}, as is request_id "
                f"{json.dumps(other_rid)} of line "
                f"{other_line} (a sample of n > 1 is <request_id>-<index>); the engine needs distinct ids"))
            continue
        by_id[rid] = number
        for e in engine_ids:
            by_engine_id[e] = (number, rid)
        accepted.append(RequestLine(number, request, engine_ids))
    return accepted, rejected


def response_line(request_id: str, response: Message) -> str:
    """The output line of one response (without the newline): the
    ``request_id`` first, then the response as the single-request output
    prints it (proto field names, fields without presence included)."""
    body = json_format.MessageToDict(response, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    return json.dumps({"request_id": request_id, "response": body})


def one_line(message: str) -> str:
    """*message* on one line (library messages may span lines)."""
    return " ".join(message.split())


class StdoutUnwritable(Exception):
    """stdout refused a write for another reason than its reader leaving (a
    full disk, an I/O error, a file closed under us)."""


def write_out(stdout: TextIO, text: str) -> None:
    """Write *text* to *stdout* and flush.

    Raises:
        BrokenPipeError: the reader went away.
        StdoutUnwritable: any other refusal, with its cause in the message.
    """
    try:
        stdout.write(text)
        stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a closed file object
        raise StdoutUnwritable(f"cannot write to stdout: {exc}") from exc


async def run_requests(
    client: EngineClient,
    requests: Sequence[RequestLine],
    translate: Callable[[Message, int, int | None], list[Any]],
    *,
    deadlines: Deadlines | None = None,
    max_concurrency: int | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> tuple[int, int]:
    """Run *requests* concurrently through *client*; return ``(failed,
    rejected)``: how many failed, and how many of those were refused before
    anything was sent (``RequestRejected``: a prompt past ``max_model_len``, a
    ``data_parallel_rank`` that names no engine).

    Each request is translated against the engine (``translate(request,
    client.max_model_len, client.engine_index)``, the runtime's
    ``translate_parallel``: a prompt at or past ``max_model_len`` fails here)
    and streamed through :meth:`EngineClient.generate_samples <zmqdispatch.EngineClient.generate_samples>`; every
    response is written to *out* (default stdout) as one flushed line
    (:func:`response_line`), as it arrives. A request that fails (rejected by
    the engine's limits, an engine-side error, a deadline, the engine's
    death) writes one line to *err* (default stderr) naming its
    ``request_id``; the others go on. At most *max_concurrency* requests are
    in flight at once (None: all); a waiting request's deadlines have not
    started.

    Raises:
        BrokenPipeError: *out* was closed (the reader went away); every
            request still running was aborted (its stream left).
        StdoutUnwritable: *out* refused a write otherwise (a full disk, an
            I/O error); every request still running was aborted.

    Cancellation: every running request's stream is left, which aborts it on
    the engine.
    """
    stdout = sys.stdout if out is None else out
    stderr = sys.stderr if err is None else err
    limiter = trio.CapacityLimiter(math.inf if max_concurrency is None else max_concurrency)
    failed = 0
    rejected = 0
    broken_pipe = False
    unwritable: StdoutUnwritable | None = None

    async def one(item: RequestLine, cancel: trio.CancelScope) -> None:
        nonlocal failed, rejected, broken_pipe, unwritable
        rid = item.request_id
        try:
            async with limiter:
                samples = translate(item.request, client.max_model_len, client.engine_index)
                builders = [t.response_builder() for t in samples]
                async with client.generate_samples([t.request for t in samples], deadlines=deadlines) as stream:
                    async for index, delta in stream:
                        builder = builders[index]
                        for response in builder.feed(delta):
                            write_out(stdout, response_line(rid, response) + "\n")
                        if builder.stopped_early:  # a stop string matched: stop that sample on the engine
                            stream.abort_sample(index)
        except ZmqDispatchError as exc:
            failed += 1
            refused = isinstance(exc, RequestRejected)  # raised before the request was sent
            rejected += refused
            stderr.write(f"zmqdispatch: error: request_id {json.dumps(rid)} {'rejected' if refused else 'failed'}: "
                         f"{type(exc).__name__}: {one_line(str(exc))}\n")
            stderr.flush()
        except BrokenPipeError:
            broken_pipe = True
            cancel.cancel()
        except StdoutUnwritable as exc:
            unwritable = exc
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for item in requests:
            nursery.start_soon(one, item, nursery.cancel_scope)
    if broken_pipe:
        raise BrokenPipeError("stdout was closed")
    if unwritable is not None:
        raise unwritable
    return failed, rejected
