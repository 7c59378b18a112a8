"""A program for tests/aio/test_lifecycle.py: an asyncio client that launches the
mock engine and is then ended one way or another while it streams.

    python lifecycle_program.py MODE LOOP
        MODE: return | close | sigint | sigint-bare | loop-closed | loop-closed-tick | threads
        LOOP: asyncio | uvloop

``loop-closed``: a loop run by hand is closed with the client still open
(its engine must be stopped all the same); ``loop-closed-tick``: the same,
with trio's next tick queued on the loop when it closes (the close drops it); ``threads``: two threads run a loop
each, with a client each, at the same time as the main thread's.

It prints ``ENGINE <pid>`` once the engine is up, ``STREAMING`` once tokens
flow, and what its streams ended with; the test checks its exit, its stderr
(no traceback) and that the engine process is gone.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import trio

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
    """Whether the engines this process launched are still there, checked before
    exiting (the client, not its watchdog, must have stopped and reaped them)."""
    from zmqdispatch.testing import live_group_members, proc_state

    alive = [f"{pid}:{proc_state(pid)}" for pid in ENGINE if proc_state(pid) is not None]
    # the rest of an engine's group (the launch watchdog) was sent SIGKILL with
    # the engine's exit; its death is the kernel's, awaited here
    deadline = time.monotonic() + 10
    while any(live_group_members(pid) for pid in ENGINE) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive += [f"{pid}:group {live_group_members(pid)}" for pid in ENGINE if live_group_members(pid)]
    return "ENGINE-GONE" if not alive else f"ENGINE-ALIVE {' '.join(alive)}"


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


def _new_loop(loop: str) -> asyncio.AbstractEventLoop:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _loop_closed(loop: str, tick_pending: bool) -> None:
    streaming = asyncio.Event()
    bare = _new_loop(loop)

    async def stop_with_a_tick_queued() -> None:
        # trio code, in the guest run: the loop stops after this callback, and
        # the checkpoint leaves trio with work, so its next tick is queued
        # (call_soon) rather than left to its I/O thread
        bare.stop()
        await trio.sleep(0)
        await trio.sleep_forever()

    async def holder() -> None:
        async with aio.connect(launch=mock_argv(), config=ClientConfig(handshake_timeout=60)) as client:
            print("ENGINE", client.process.pid, flush=True)
            ENGINE.append(client.process.pid)
            await _stream_forever(client, "s", streaming)

    async def until_streaming() -> None:
        asyncio.get_running_loop().create_task(holder())
        await streaming.wait()
        print("STREAMING", flush=True)
        if tick_pending:
            await aio.run_in_trio(stop_with_a_tick_queued)

    try:
        bare.run_until_complete(until_streaming())
    except RuntimeError as exc:  # "Event loop stopped before Future completed."
        assert tick_pending, exc
    bare.close()  # the holder task and its client are still open
    from zmqdispatch.testing import proc_state

    deadline = time.monotonic() + 30
    while proc_state(ENGINE[0]) is not None and time.monotonic() < deadline:
        time.sleep(0.02)  # another process's exit (stopped and reaped by the library): polled


async def _short_streams(name: str, n: int) -> int:
    async with aio.connect(launch=mock_argv(), config=ClientConfig(handshake_timeout=60)) as client:
        ENGINE.append(client.process.pid)
        tokens = 0
        for k in range(n):
            req = EngineCoreRequest(request_id=f"{name}-{k}", prompt_token_ids=(1, 2, 3), arrival_time=0.0,
                                    sampling_params=SamplingParams(temperature=0.0, max_tokens=50))
            async with client.generate(req) as stream:
                async for d in stream:
                    tokens += len(d.token_ids)
        return tokens


def _threads(loop: str) -> None:
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = _new_loop(loop).run_until_complete(_short_streams(name, 20))
        except BaseException as exc:  # reported by the main thread
            results[name] = exc

    threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    results["main"] = _new_loop(loop).run_until_complete(_short_streams("main", 20))
    for t in threads:
        t.join()
    for name in sorted(results):
        print("TOKENS", name, results[name], flush=True)


if __name__ == "__main__":
    mode, loop = sys.argv[1], sys.argv[2]
    try:
        if mode.startswith("loop-closed"):
            _loop_closed(loop, tick_pending=mode == "loop-closed-tick")
        elif mode == "threads":
            _threads(loop)
        elif mode == "sigint-bare":
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
