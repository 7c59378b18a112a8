"""zmqdispatch: an LLM gateway's direct ZeroMQ transport to inference engines.

Public API (vLLM v1 EngineCore wire, vLLM 0.32 / 0.33; TokenSpeed 0.1.1)::

    async with zmqdispatch.connect(handshake_address, launch=...) as client:
        t = translate.vllm.translate_request(proto_request, TranslationConfig(max_model_len=client.max_model_len))
        async with client.generate(t.request) as stream:
            async for delta in stream:
                ...

Layout: ``wire/`` sans-IO codecs; ``protocol/`` sans-IO per-engine state
(request table, mailboxes, aborts, death); ``translate/`` gateway protos <->
wire; ``_zmq_trio`` the only module that calls pyzmq; ``client`` the trio
shell; ``mock/`` the mock engine program; ``testing/`` scripted fakes.
"""

import logging as _logging
from importlib import metadata as _metadata

# A library is silent unless its user configures logging (docs/operations.md).
_logging.getLogger("zmqdispatch").addHandler(_logging.NullHandler())

try:
    #: the installed distribution's version (``pyproject.toml``)
    __version__ = _metadata.version("zmqdispatch")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

from .client import ClientConfig, EngineClient, EngineSession, LoRARequest, RequestStream, connect  # noqa: E402
from . import errors  # noqa: E402
from .errors import *  # noqa: F403,E402  (the public hierarchy, listed in errors.__all__)
from .metrics import EngineStats  # noqa: E402
from .protocol.deadlines import Deadlines  # noqa: E402
from .protocol.mailbox import OutputDelta  # noqa: E402

__all__ = [
    "__version__",
    "ClientConfig",
    "Deadlines",
    "EngineClient",
    "EngineSession",
    "LoRARequest",
    "EngineStats",
    "RequestStream",
    "OutputDelta",
    "connect",
    *errors.__all__,
]
