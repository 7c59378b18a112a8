"""The names of the many-engine client before one client served one engine and
many (:mod:`zmqdispatch.client`, :mod:`zmqdispatch.shell`). Aliases, kept for
this release only: use :class:`~zmqdispatch.EngineClient` and
:func:`~zmqdispatch.connect`.
"""

from __future__ import annotations

from .client import EngineClient
from .protocol.handshake import ADDRESS_INDEX_STRIDE
from .shell import connect

__all__ = ["ADDRESS_INDEX_STRIDE", "MultiEngineClient", "connect_engines"]

#: The one client (:class:`zmqdispatch.EngineClient`); an alias for this release.
MultiEngineClient = EngineClient

#: :func:`zmqdispatch.connect` (its ``data_parallel_size`` defaults to 1); an alias for this release.
connect_engines = connect
