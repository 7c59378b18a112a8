"""Logging set-up of the ``zmqdispatch`` program (the library itself only adds
a ``NullHandler``: ``docs/operations.md``).

Records of the ``zmqdispatch`` tree go to stderr at the chosen level; stdout
stays for the program's output. With ``announce_waits``, one kind of record
passes at any level: what the program is waiting for
(``extra={"zmqdispatch_wait": True}``: "waiting for an engine at ADDR, timeout
N s"), so a wait for an engine started elsewhere is never silent.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG_LEVELS", "configure"]

#: ``--log-level`` choices
LOG_LEVELS = ("debug", "info", "warning", "error")

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The command line's stderr handler (told apart to be replaced)."""


def configure(level: str, *, announce_waits: bool = False) -> logging.Handler:
    """Send the ``zmqdispatch`` logger tree to stderr at *level* (one of
    :data:`LOG_LEVELS`); with *announce_waits*, the wait records at any level.
    Return the handler. Idempotent per process: a second call replaces the
    first handler."""
    threshold = getattr(logging, level.upper())
    root = logging.getLogger("zmqdispatch")
    for h in list(root.handlers):
        if isinstance(h, _CliHandler):
            root.removeHandler(h)
    handler = _CliHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(
        lambda r: r.levelno >= threshold or (announce_waits and getattr(r, "zmqdispatch_wait", False))
    )
    root.addHandler(handler)
    root.setLevel(min(threshold, logging.INFO))  # INFO records exist for the wait line
    root.propagate = False  # the program owns stderr: no second copy through the root logger
    return handler
