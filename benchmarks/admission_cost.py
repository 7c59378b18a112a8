#!/usr/bin/env python3
"""Client CPU of admitting one request: ``client.generate(request)`` plus entering its
stream (validation, placement, the ADD queued), measured in the request's own task.

Starts ``--requests`` tasks at once (a burst, as ``burst-c100-1ms`` of ``zmqdispatch bench``
does), each opening one stream of 2 tokens against the mock engine launched by the client,
and sums each task's first step (``time.thread_time``, from a trio instrument): what every
running stream waits for while a burst is admitted. Prints µs per request for every batch
and the median of all but the first two (warm-up). The engine's encoding of the ADD runs in
the input pump, not in this figure.

    python benchmarks/admission_cost.py --batches 12 --requests 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import trio

from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_request
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


class FirstSteps(trio.abc.Instrument):
    """CPU of the first step of every task named ``admit``, in ns."""

    def __init__(self) -> None:
        self.seen: set[trio.lowlevel.Task] = set()
        self.total_ns = 0
        self._t0 = 0
        self._on = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("admit") and task not in self.seen:
            self.seen.add(task)
            self._on = True
            self._t0 = time.thread_time_ns()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._on:
            self.total_ns += time.thread_time_ns() - self._t0
            self._on = False


async def main(batches: int, requests: int) -> None:
    async with connect(launch=MOCK) as client:
        config = VllmTranslationConfig(max_model_len=client.max_model_len)
        per_request: list[float] = []
        for k in range(batches):
            batch = [
                translate_vllm_request(pb.GenerateRequest(
                    request_id=f"r{k}-{i}", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                    sampling_params=pb.SamplingParams(max_tokens=2), stream=True), config).request
                for i in range(requests)
            ]

            async def admit(request: object) -> None:
                async with client.generate(request) as stream:  # type: ignore[arg-type]
                    async for _ in stream:
                        pass

            steps = FirstSteps()
            trio.lowlevel.add_instrument(steps)
            async with trio.open_nursery() as nursery:
                for r in batch:
                    nursery.start_soon(admit, r)
            trio.lowlevel.remove_instrument(steps)
            per_request.append(steps.total_ns / requests / 1e3)
        print("admission CPU µs/request per batch:", [round(x, 1) for x in per_request])
        print(f"median (batches 3-{batches}): {statistics.median(per_request[2:]):.1f} µs/request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    if args.batches < 3 or args.requests < 1:
        parser.error("--batches must be at least 3 and --requests at least 1")
    trio.run(main, args.batches, args.requests)
