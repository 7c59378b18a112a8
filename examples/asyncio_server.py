"""A streaming HTTP endpoint in plain asyncio: token ids in, NDJSON token deltas out.

    python examples/asyncio_server.py                 # serves on a free port, runs a demo client, exits
    python examples/asyncio_server.py --serve 8080    # serves until Ctrl-C

``POST /generate`` with ``{"input_ids": [1, 2, 3], "max_tokens": 8}`` answers
``200`` with a chunked body of one JSON line per delta (``{"token_ids":
[...]}``) and a last line ``{"finish_reason": "length"}``. A refused request
is ``400`` naming the field (``RequestRejected.field``); a dead engine ``503``.
A client that disconnects mid-stream aborts its request on the engine (the
handler's task leaves the stream's ``async with``). It launches the mock engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from zmqdispatch import EngineDeadError, RequestRejected, aio
from zmqdispatch.wire.vllm import EngineCoreRequest, SamplingParams

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]
MAX_BODY = 1 << 20
_ids = iter(range(1 << 62))


def _head(status: str, content_type: str, chunked: bool, length: int = 0) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{framing}\r\nConnection: close\r\n\r\n".encode()


def _reply(writer: asyncio.StreamWriter, status: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    writer.write(_head(status, "application/json", False, len(data)) + data)


def _chunk(line: dict[str, Any]) -> bytes:
    data = json.dumps(line).encode() + b"\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, Any]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    method, path, _ = head[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if ":" in h)}
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY:
        raise ValueError(f"body of {length} bytes is over {MAX_BODY}")
    body = json.loads(await reader.readexactly(length)) if length else {}
    return f"{method} {path}", body


def _engine_request(body: dict[str, Any]) -> EngineCoreRequest:
    ids, max_tokens = body.get("input_ids"), body.get("max_tokens", 16)
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RequestRejected("input_ids: expected a list of token ids", field="input_ids")
    if type(max_tokens) is not int:
        raise RequestRejected("max_tokens: expected an int", field="max_tokens")
    return EngineCoreRequest(request_id=f"http-{next(_ids)}", prompt_token_ids=tuple(ids), arrival_time=0.0,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def handler(client: aio.AsyncEngineClient) -> Any:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                route, body = await _read_request(reader)
                if route != "POST /generate":
                    _reply(writer, "404 Not Found", {"error": f"no route {route}"})
                    return
                stream = client.generate(_engine_request(body))  # validated now: nothing sent yet
            except RequestRejected as exc:
                _reply(writer, "400 Bad Request", {"error": str(exc), "field": exc.field})
                return
            except (ValueError, asyncio.IncompleteReadError) as exc:
                _reply(writer, "400 Bad Request", {"error": f"malformed request: {exc}"})
                return
            except EngineDeadError as exc:
                _reply(writer, "503 Service Unavailable", {"error": str(exc)})
                return
            writer.write(_head("200 OK", "application/x-ndjson", True))
            async with stream:  # leaving it (the peer gone, this task cancelled) aborts the request
                async for delta in stream:
                    writer.write(_chunk({"token_ids": delta.token_ids}))
                    if delta.finish_reason is not None:
                        writer.write(_chunk({"finish_reason": delta.finish_reason.name.lower()}))
                    await writer.drain()  # ConnectionError once the peer is gone
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except EngineDeadError as exc:  # mid-stream: the status is sent, end the body with the reason
            writer.write(_chunk({"error": str(exc)}) + b"0\r\n\r\n")
        except ConnectionError:
            pass  # the peer left: its request was aborted by leaving the stream
        finally:
            writer.close()

    return handle


async def _post(port: int, body: dict[str, Any], *, lines: int | None = None) -> tuple[str, list[str]]:
    """A tiny HTTP client: the status line and the body's lines (stop after *lines*, hanging up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    got: list[str] = []
    chunked = "transfer-encoding: chunked" in (h.lower() for h in head)
    while lines is None or len(got) < lines:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            got.extend((await reader.readexactly(size + 2)).decode().splitlines()[:1])
        else:
            got.extend((await reader.read()).decode().splitlines())
            break
    writer.close()
    return head[0], got


async def main(port: int | None) -> None:
    async with aio.connect(launch=MOCK) as client:
        server = await asyncio.start_server(handler(client), "127.0.0.1", port or 0)
        async with server:
            if port is not None:
                print(f"serving on http://127.0.0.1:{port}/generate", flush=True)
                await server.serve_forever()
            bound = server.sockets[0].getsockname()[1]
            status, lines = await _post(bound, {"input_ids": [1, 2, 3], "max_tokens": 6})
            print(status)
            for line in lines:
                print(line)
            status, lines = await _post(bound, {"input_ids": "1 2 3"})
            print(status, lines[0])
            # a client that hangs up after its first delta: its request is aborted on the engine
            await _post(bound, {"input_ids": [1, 2, 3], "max_tokens": 4000}, lines=1)
            while client.stats()[0].aborts < 1:
                await asyncio.sleep(0.01)
            print("aborted after the client left:", client.stats()[0].aborts)


if __name__ == "__main__":
    serve = sys.argv[1:2] == ["--serve"]
    try:
        asyncio.run(main(int(sys.argv[2]) if serve else None))
    except KeyboardInterrupt:
        pass
