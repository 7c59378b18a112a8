"""Engine doubles for testing code built on zmqdispatch, in the caller's trio run.

Everything here speaks the real wire over real ``ipc://`` sockets, so a
gateway's code is tested through the same client it runs in production:

- :func:`open_fake_engine_pair` -> ``(FakeEngine, EngineClient)``: an engine
  the test scripts message by message (:class:`FakeEngine`: receive the
  client's ADD / ABORT / utility calls as :class:`Received`, send tokens,
  finishes, utility replies, the ``ENGINE_CORE_DEAD`` sentinel, garbage;
  disconnect). vLLM 0.32 EngineCore wire.
- :func:`open_mock_engine_pair` -> ``(engine, EngineClient)``: the mock engine
  program (:mod:`zmqdispatch.mock`) running in-process, which schedules and
  streams by itself (``runtime="vllm"`` or ``"tokenspeed"``).
- :func:`external_mock`, :func:`mock_argv`: the mock engine as a process of its
  own, to kill, freeze or start with injected faults; :func:`proc_state`,
  :func:`live_group_members`: check that nothing was left behind.
- :func:`dial` and :func:`ready_response`: the engine half of the handshake
  (both runtimes; ``hang_up_after=`` for an engine that dies in it) and the
  ready response it registers with, for an engine of one's own.
- ``zmqdispatch.testing.pytest_plugin``: a ``mock_clock`` fixture (virtual time
  that jumps when the run is idle) for pytest-trio.

How to use them: ``docs/testing.md``.
"""

from .dial import EngineSockets, dial, ready_response
from .fake_engine import FakeEngine, Received
from .pairs import open_fake_engine_pair, open_mock_engine_pair
from .processes import (
    external_mock,
    fixed_addresses,
    live_group_members,
    mock_argv,
    proc_state,
)

__all__ = [
    "EngineSockets",
    "FakeEngine",
    "Received",
    "dial",
    "external_mock",
    "fixed_addresses",
    "live_group_members",
    "mock_argv",
    "open_fake_engine_pair",
    "open_mock_engine_pair",
    "proc_state",
    "ready_response",
]
