"""zmqdispatch: an LLM gateway's direct ZeroMQ transport to inference engines.

Public API (vLLM v1 EngineCore wire, vLLM 0.32 / 0.33; TokenSpeed 0.1.1)::

    from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_request

    async with connect(handshake_address, launch=...) as client:   # one engine or many
        t = translate_vllm_request(proto_request, VllmTranslationConfig(max_model_len=client.max_model_len))
        async with client.generate(t.request) as stream:      # one request
            async for delta in stream:
                ...

``client.generate_samples(requests)`` (``n > 1``) and ``client.stream_group()``
(many requests, one reader) are the other two streams (``docs/usage.md``).

Layout: ``wire/`` sans-IO codecs; ``protocol/`` sans-IO per-engine state
(request table, mailboxes, aborts, death, placement); ``translate/`` gateway
protos <-> wire; ``_zmq_trio`` the only module that calls pyzmq; ``shell``
the trio shell (``connect``), ``connection`` one engine's tasks, ``client``
the one client, ``engine`` one engine's handle; ``mock/`` the mock engine
program; ``testing/`` scripted fakes.
"""

import logging as _logging
from importlib import metadata as _metadata

# The public names. Everything a gateway needs comes from here; the
# submodules hold the rest (wire codecs, the sans-IO core, the mock engine).
from . import errors
from .client import EngineClient, LoRARequest
from .config import ClientConfig, EngineSession
from .engine import Engine
from .errors import (
    AddressBindError,
    AddressError,
    ContextLengthError,
    DeadlineExceeded,
    DuplicateRequestIdError,
    EngineAbortedRequest,
    EngineDeadError,
    EngineDrainingError,
    EngineError,
    EngineHandshakeError,
    EngineHandshakeTimeout,
    EngineRequestError,
    MultiModalCacheMissError,
    InvalidAddressError,
    LocalProtocolError,
    NoEngineAvailableError,
    RemoteProtocolError,
    RequestError,
    RequestRejected,
    RequestStreamClosed,
    RuntimeMismatchError,
    SlowConsumerError,
    UnsupportedByRuntimeError,
    UtilityCallError,
    UtilityCallTimeout,
    ZmqDispatchError,
)
from .metrics import EngineStats
from .multi import MultiEngineClient, connect_engines
from .protocol.deadlines import Deadlines
from .protocol.engines import EngineState, EngineStatus
from .protocol.handshake import ADDRESS_INDEX_STRIDE
from .protocol.mailbox import OutputDelta
from .protocol.placement import EngineLoad
from .protocol.runtime import Runtime
from .shell import connect
from .streams import (
    EngineRequest,
    GroupItem,
    GroupMember,
    RequestStream,
    SampleStream,
    StreamGroup,
)
from .translate.sglang import ResponseBuilder as SGLangResponseBuilder
from .translate.sglang import Translation as SGLangTranslation
from .translate.sglang import TranslationConfig as SGLangTranslationConfig
from .translate.sglang import pb as sglang_pb
from .translate.sglang import translate_parallel as translate_sglang_samples
from .translate.sglang import translate_request as translate_sglang_request
from .translate.tokenspeed import ResponseBuilder as TokenSpeedResponseBuilder
from .translate.tokenspeed import Translation as TokenSpeedTranslation
from .translate.tokenspeed import TranslationConfig as TokenSpeedTranslationConfig
from .translate.tokenspeed import pb as tokenspeed_pb
from .translate.tokenspeed import translate_parallel as translate_tokenspeed_samples
from .translate.tokenspeed import translate_request as translate_tokenspeed_request
from .translate.vllm import ResponseBuilder as VllmResponseBuilder
from .translate.vllm import Translation as VllmTranslation
from .translate.vllm import TranslationConfig as VllmTranslationConfig
from .translate.vllm import pb as vllm_pb
from .translate.vllm import translate_parallel as translate_vllm_samples
from .translate.vllm import translate_request as translate_vllm_request

# A library is silent unless its user configures logging (docs/operations.md).
# No module of the package logs while it is imported, so the handler can come last.
_logging.getLogger("zmqdispatch").addHandler(_logging.NullHandler())

try:
    #: the installed distribution's version (``pyproject.toml``)
    __version__ = _metadata.version("zmqdispatch")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [  # every public name, written out (static tools read this list)
    "ADDRESS_INDEX_STRIDE",
    "AddressBindError",
    "AddressError",
    "ClientConfig",
    "ContextLengthError",
    "DeadlineExceeded",
    "Deadlines",
    "DuplicateRequestIdError",
    "Engine",
    "EngineAbortedRequest",
    "EngineClient",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineError",
    "EngineHandshakeError",
    "EngineHandshakeTimeout",
    "EngineLoad",
    "EngineRequest",
    "EngineRequestError",
    "MultiModalCacheMissError",
    "EngineSession",
    "EngineState",
    "EngineStats",
    "EngineStatus",
    "GroupItem",
    "GroupMember",
    "InvalidAddressError",
    "LoRARequest",
    "LocalProtocolError",
    "MultiEngineClient",  # alias of EngineClient, this release only
    "NoEngineAvailableError",
    "OutputDelta",
    "RemoteProtocolError",
    "RequestError",
    "RequestRejected",
    "RequestStream",
    "RequestStreamClosed",
    "Runtime",
    "RuntimeMismatchError",
    "SGLangResponseBuilder",
    "SGLangTranslation",
    "SGLangTranslationConfig",
    "SampleStream",
    "SlowConsumerError",
    "StreamGroup",
    "TokenSpeedResponseBuilder",
    "TokenSpeedTranslation",
    "TokenSpeedTranslationConfig",
    "UnsupportedByRuntimeError",
    "UtilityCallError",
    "UtilityCallTimeout",
    "VllmResponseBuilder",
    "VllmTranslation",
    "VllmTranslationConfig",
    "ZmqDispatchError",
    "__version__",
    "connect",
    "connect_engines",  # alias of connect, this release only
    "errors",
    "sglang_pb",
    "tokenspeed_pb",
    "translate_sglang_request",
    "translate_sglang_samples",
    "translate_tokenspeed_request",
    "translate_tokenspeed_samples",
    "translate_vllm_request",
    "translate_vllm_samples",
    "vllm_pb",
]
