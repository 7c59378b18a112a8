"""A program for tests/aio/test_lifecycle.py: an asyncio client that launches the
mock engine and is then ended one way or another while it streams.

    python lifecycle_program.py MODE LOOP      MODE: return | close | sigint | sigint-bare   LOOP: asyncio | uvloop

It prints ``ENGINE <pid>`` once the engine is up, ``STREAMING`` once tokens
flow, and what its streams ended with; the test checks its exit, its stderr
(no traceback) and that the engine process is gone.
"""

from __future__ import annotations

import asyncio
import sys

from zmqdispatch import ClientConfig, EngineDeadError, aio
from zmqdispatch.testing import mock_argv
from zmqdispatch.wire.vllm import EngineCoreRequest, SamplingParams


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=(1, 2, 3), arrival_time=0.0,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=4000))


async def _stream_forever(client: aio.AsyncEngineClient, name: str, streaming: asyncio.Event) -> None:
    k = 0
    while True:
        k += 1
        async with client.generate(_request(f"{name}-{k}")) as stream:
            async for _ in stream:
                streaming.set()


#: the launched engine's pid
ENGINE: list[int] = []


def _engine_state() -> str:
    """Whether the engine this process launched is still there, checked before
    exiting (the client, not its watchdog, must have stopped it)."""
    from zmqdispatch.testing import live_group_members, proc_state

    gone = proc_state(ENGINE[0]) is None and not live_group_members(ENGINE[0])
    return "ENGINE-GONE" if gone else f"ENGINE-ALIVE {proc_state(ENGINE[0])}"


async def main(mode: str) -> None:
    streaming = asyncio.Event()
    config = ClientConfig(handshake_timeout=60)

    async def holder() -> None:
        async with aio.connect(launch=mock_argv(), config=config) as client:
            print("ENGINE", client.process.pid, flush=True)
            ENGINE.append(client.process.pid)
            tasks = [asyncio.create_task(_stream_forever(client, f"s{i}", streaming)) for i in range(3)]
            await streaming.wait()
            print("STREAMING", flush=True)
            if mode != "close":
                await asyncio.gather(*tasks)
            # "close": leaves the block with three streams open
        # (mode "close") the streams saw the client close
        for t in tasks:
            await asyncio.wait([t])
            print("STREAM-ENDED", type(t.exception()).__name__, flush=True)
            assert isinstance(t.exception(), EngineDeadError)

    task = asyncio.create_task(holder())
    if mode == "return":
        await streaming.wait()
        return  # asyncio.run cancels the holder with its client still open
    await task


if __name__ == "__main__":
    mode, loop = sys.argv[1], sys.argv[2]
    try:
        if mode == "sigint-bare":
            # a loop run by hand, without asyncio.run's SIGINT handler: Ctrl-C goes to trio
            import uvloop

            bare = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
            try:
                bare.run_until_complete(main("sigint"))
            finally:
                bare.close()
        elif loop == "uvloop":
            import uvloop

            uvloop.run(main(mode))
        else:
            asyncio.run(main(mode))
    except KeyboardInterrupt:
        print("INTERRUPTED", _engine_state(), flush=True)
        sys.exit(130)
    print("DONE", _engine_state(), flush=True)
