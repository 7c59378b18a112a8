"""Which engine is on the other end of a connection: :class:`Runtime` (sans-IO).

One transport, three engine dialects. Every engine dials the same three sockets
and run the same HELLO / INIT / READY handshake; what differs is the payload
of an ADD, the shape of an output message, and a few behaviours:

==========================  ===============================  ==================================
                            vLLM EngineCore (0.32 / 0.33)    TokenSpeed scheduler (0.1.1)
==========================  ===============================  ==================================
request type                ``wire.vllm.EngineCoreRequest``  ``wire.tokenspeed.TokenizedGenerateReqInput``
output message              ``EngineCoreOutputs`` (rows)     ``BatchTokenIDOutSlim`` (columns)
input types                 ADD, ABORT, UTILITY, DP wave     ADD, ABORT
client ABORT                no further output                no further output
refused request             engine death / input-thread      terminal ``"abort"`` without
                            death (checked before send)      tokens or reason
stop / EOS token            in ``new_token_ids``,            in ``output_ids``, not named:
                            ``stop_reason`` names stop ids   the finish ``"stop"`` ends on it
how to tell                 any other ``vllm_version``       ready ``vllm_version`` =
                                                             ``"tokenspeed-<version>"``
==========================  ===============================  ==================================

An SGLang scheduler (SGLang 0.5.21 behind the SGLang plugin, ``docs/sglang.md``):
request type ``wire.sglang.TokenizedGenerateReqInput``; output ``BatchTokenIDSlimOutput``
(columns) and ``ControlReplySlim``; input types ADD, ABORT, CONTROL; a client ABORT
produces no further output; a refused request ends in a terminal ``"abort"`` carrying
the reason and status 400; the stop token is in ``output_ids`` and named in
``finished_matched``; told apart by ``vllm_version = "sglang-<version>"``.

Every "which engine is this?" answer in zmqdispatch comes from the connection's
:class:`Runtime` (decided from the engine's own ready response, or pinned by the
caller and then checked against it), never from a constant.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from ..errors import EngineHandshakeError, LocalProtocolError, RequestRejected, RuntimeMismatchError
from ..wire import sglang as sg
from ..wire import tokenspeed as ts
from ..wire import vllm as wire
from ..wire import vllm_handshake as handshake
from . import checks, checks_sglang

__all__ = ["Runtime"]


class Runtime(enum.Enum):
    """The engine dialect of one connection (``"vllm"``, ``"tokenspeed"`` or ``"sglang"``)."""

    VLLM = "vllm"
    TOKENSPEED = "tokenspeed"
    SGLANG = "sglang"

    @classmethod
    def of_ready_response(cls, ready: handshake.EngineCoreReadyResponse) -> Runtime:
        """The runtime that sent this ready response.

        TokenSpeed announces itself with ``vllm_version = "tokenspeed-<version>"``
        (``docs/tokenspeed-wire.md`` §1.4), an SGLang scheduler with
        ``"sglang-<version>"`` (``docs/sglang.md``); anything else is a vLLM EngineCore.
        """
        if ts.is_tokenspeed(ready):
            return cls.TOKENSPEED
        return cls.SGLANG if sg.is_sglang(ready) else cls.VLLM

    @classmethod
    def resolve(cls, expected: Runtime | str | None, ready: handshake.EngineCoreReadyResponse) -> Runtime:
        """The connection's runtime: what the engine announced, checked against *expected*.

        Raises:
            EngineHandshakeError: the engine is not the runtime the caller asked for.
            ValueError: *expected* is not a runtime name.
        """
        actual = cls.of_ready_response(ready)
        if expected is not None and cls(expected) is not actual:
            raise EngineHandshakeError(
                f"expected a {cls(expected).engine_name}, but the engine that dialed in is a "
                f"{actual.engine_name} (vllm_version={ready.vllm_version!r})"
            )
        return actual

    # ------------------------------------------------------------------ facts

    @property
    def engine_name(self) -> str:
        """Human name of the engine, for messages."""
        return _ENGINE_NAMES[self]

    @property
    def request_class(self) -> type:
        """The request type this runtime takes on its wire."""
        return _REQUEST_CLASSES[self]

    @property
    def supports_utility_calls(self) -> bool:
        """vLLM has UTILITY messages and SGLang CONTROL calls (answered by
        ``ControlReplySlim``); TokenSpeed's direct wire has only ADD and ABORT."""
        return self is not Runtime.TOKENSPEED

    @property
    def names_stop_token(self) -> bool:
        """Whether the engine says which stop ended a request (vLLM's
        ``stop_reason``, SGLang's ``finished_matched``); TokenSpeed's ``"stop"``
        finish does not, but it always ends on that token."""
        return self is not Runtime.TOKENSPEED

    # ------------------------------------------------------------------ requests

    def request_id(self, request: Any) -> str:
        """The request's id (``request_id`` on vLLM, ``rid`` on TokenSpeed)."""
        rid: str = request.request_id if self is Runtime.VLLM else request.rid
        return rid

    def with_request_id(self, request: Any, wire_id: str) -> Any:
        """*request* under the engine-side id *wire_id* (see
        ``EngineProtocol.submit``). vLLM: ``request_id`` replaced and the
        caller's id kept in ``external_req_id`` (as vLLM's own front end does
        when it suffixes ids), unless one was set; TokenSpeed and SGLang: ``rid`` replaced."""
        if self is Runtime.VLLM:
            external = request.external_req_id if request.external_req_id is not None else request.request_id
            return attrs.evolve(request, request_id=wire_id, external_req_id=external)
        return attrs.evolve(request, rid=wire_id)

    def check_type(self, request: Any) -> None:
        """Refuse a request built for the other runtime.

        Raises:
            RuntimeMismatchError: *request* is not this runtime's request type.
        """
        if not isinstance(request, self.request_class):
            other = next((r for r in Runtime if isinstance(request, r.request_class)), None)
            built_for = f" (built for the {other.engine_name})" if other is not None else ""
            rid = getattr(request, "request_id", None) or getattr(request, "rid", None) or ""
            raise RuntimeMismatchError(
                f"a {type(request).__name__}{built_for} cannot be sent to a {self.engine_name}: "
                f"this connection takes {self.request_class.__name__}",
                request_id=rid if isinstance(rid, str) else "",
                runtime=self.value,
            )

    def check_request(
        self,
        request: Any,
        *,
        max_model_len: int | None,
        vocab_size: int | None = None,
        max_logprobs: int = checks.DEFAULT_MAX_LOGPROBS,
    ) -> None:
        """Type check, then the runtime's own request checks (:mod:`.checks`).

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected / ContextLengthError: the request fails a check.
        """
        self.check_type(request)
        if self is Runtime.VLLM:
            checks.check_request(request, max_model_len=max_model_len, vocab_size=vocab_size,
                                 max_logprobs=max_logprobs)
        elif self is Runtime.SGLANG:
            checks_sglang.check_request(request, max_model_len=max_model_len, vocab_size=vocab_size)
        else:
            checks.check_tokenspeed_request(request, max_model_len=max_model_len, vocab_size=vocab_size)

    def encode_add(self, request: Any) -> list[bytes]:
        """The ADD payload frames ``[payload, *aux]`` (after the type byte).

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected: a value the wire cannot carry (e.g. an int beyond 64 bits).
        """
        self.check_type(request)
        try:
            if self is Runtime.VLLM:
                return wire.encode_request(request)
            if self is Runtime.SGLANG:
                return sg.encode_add(request)
            return ts.encode_add(request)
        except LocalProtocolError as exc:
            raise RequestRejected(
                f"request cannot be encoded for the {self.engine_name}: {exc}", request_id=self.request_id(request)
            ) from exc


_ENGINE_NAMES = {Runtime.VLLM: "vLLM EngineCore", Runtime.TOKENSPEED: "TokenSpeed scheduler",
                 Runtime.SGLANG: "SGLang scheduler"}
_REQUEST_CLASSES: dict[Runtime, type] = {Runtime.VLLM: wire.EngineCoreRequest,
                                         Runtime.TOKENSPEED: ts.TokenizedGenerateReqInput,
                                         Runtime.SGLANG: sg.TokenizedGenerateReqInput}
