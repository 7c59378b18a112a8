"""The engine control plane, against the mock engine (or a real one).

Run it as is: it starts zmqdispatch's mock vLLM engine, which answers the control
plane as a vLLM 0.32 CPU engine started without LoRA or a profiler does::

    python examples/control_plane.py

Against a real engine, pass its command (``{handshake_address}`` is filled in)::

    python examples/control_plane.py "$PY scripts/real_vllm/engine.py --handshake-address {handshake_address}"
"""

from __future__ import annotations

import sys

import trio

from zmqdispatch import ClientConfig, LoRARequest, UnsupportedByRuntimeError, UtilityCallError, connect
from zmqdispatch.wire import vllm as wire

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


def request(request_id: str, max_tokens: int) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        arrival_time=0.0,
    )


async def main(launch: str | list[str]) -> None:
    async with connect(launch=launch, config=ClientConfig(handshake_timeout=300)) as client:
        print("engine:", client.engine_version.engine_name, "(known)" if client.engine_version.known else "")

        # Sleep level 0 pauses scheduling only; wake_up(["scheduling"]) resumes it.
        await client.sleep(0)
        print("sleeping:", await client.is_sleeping())
        print("fully awake:", await client.wake_up(["scheduling"]))

        # "keep" freezes scheduling (new requests wait); "abort" then ends what is
        # there: its stream finishes with ABORT.
        await client.pause_scheduler("keep")
        print("paused:", await client.is_scheduler_paused())
        async with client.generate(request("long", max_tokens=200)) as stream:
            await client.pause_scheduler("abort")
            async for delta in stream:
                last = delta
        print("running request ended with:", last.finish_reason.name)
        await client.resume_scheduler()
        async with client.generate(request("after", max_tokens=4)) as stream:
            tokens = [t async for delta in stream for t in delta.token_ids]
        print("served after resume:", tokens)

        print("prefix cache reset:", await client.reset_prefix_cache())
        print("workers healthy:", await client.collective_rpc("check_health"))

        # vLLM 0.33 only: refused here, before anything is sent.
        try:
            await client.pause_generation()
        except UnsupportedByRuntimeError as exc:
            print("pause_generation:", exc)

        # The engine must have been started with LoRA enabled (--enable-lora).
        try:
            loaded = await client.add_lora(LoRARequest(lora_name="mine", lora_int_id=1, lora_path="/adapters/mine"))
            print("LoRA loaded:", loaded, await client.list_loras())
        except UtilityCallError as exc:
            print("add_lora:", exc)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else MOCK)
