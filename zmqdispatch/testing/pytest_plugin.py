"""pytest fixtures for tests of code built on zmqdispatch (a pytest plugin).

Enable it in a ``conftest.py`` (it is not registered automatically)::

    pytest_plugins = ["zmqdispatch.testing.pytest_plugin"]

Needs ``pytest`` and ``pytest-trio`` (which runs a test under the clock a
fixture returns).
"""

from __future__ import annotations

import pytest
import trio.testing

__all__ = ["mock_clock"]


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    """Virtual time that jumps ahead only after 50 ms of real idleness.

    Timeouts of minutes (deadlines, ``handshake_timeout``, silence) then fire
    at once, while real socket I/O, sub-millisecond over ``ipc://``, always
    completes before the clock jumps. Replaces pytest-trio's ``mock_clock``
    (which never jumps on its own).
    """
    return trio.testing.MockClock(autojump_threshold=0.05)
