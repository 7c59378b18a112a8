"""The vLLM v1 engine handshake, both sides (vLLM 0.32.0; TokenSpeed 0.1.1 speaks it too), sans-IO.

The engine dials the front-end's handshake ROUTER and sends HELLO
(:func:`encode_hello` / :func:`decode_handshake_status`); the front-end answers with the
socket addresses (:func:`encode_init` / :func:`decode_init`); the engine connects, sends
its :class:`EngineCoreReadyResponse` on each input socket
(:func:`encode_ready_response` / :func:`decode_ready_response`) and READY on the
handshake socket (``docs/vllm-wire.md`` §5.1). TokenSpeed's engine-side variants (a 4-key HELLO, its
ready-response keys) are in :mod:`zmqdispatch.wire.tokenspeed_engine`.

Decoders raise only :class:`~zmqdispatch.errors.RemoteProtocolError`; encoders
:class:`~zmqdispatch.errors.LocalProtocolError`. This runs once per connection, so it
uses cattrs for the ready response (never on the per-tick path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import cattrs

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.schema import (
    _Bad,
    _k_bool,
    _k_float,
    _k_int,
    _k_map,
    _k_opt,
    _k_seq,
    _k_str,
    _pack,
    _unpack,
)

__all__ = [
    "EngineCoreReadyResponse",
    "HandshakeInit",
    "HandshakeStatus",
    "decode_handshake_status",
    "decode_init",
    "decode_ready_response",
    "encode_hello",
    "encode_init",
    "encode_ready",
    "encode_ready_response",
]

# =========================================================================== handshake


@attrs.frozen(kw_only=True)
class HandshakeStatus:
    """HELLO / READY on the handshake socket (engine -> front-end), a plain map.

    ``local=True, headless=False`` for a co-located engine, ``local=False,
    headless=True`` for ``vllm serve --headless``. ``parallel_config_hash`` only with
    MoE DP > 1. Extra keys (elastic EP) are ignored.
    """

    status: str
    local: bool = False
    headless: bool = False
    parallel_config_hash: str | None = None


def _encode_status(status: str, local: bool, headless: bool, parallel_config_hash: str | None) -> bytes:
    try:
        body: dict[str, Any] = {"status": status, "local": _k_bool(local), "headless": _k_bool(headless)}
        if parallel_config_hash is not None:
            body["parallel_config_hash"] = _k_str(parallel_config_hash)
    except _Bad as exc:
        raise LocalProtocolError(f"handshake {status}: {exc}") from None
    return _pack(body)


def encode_hello(local: bool, headless: bool) -> bytes:
    """HELLO map ``{"status": "HELLO", "local": .., "headless": ..}`` (plain msgspec map)."""
    return _encode_status("HELLO", local, headless, None)


def encode_ready(local: bool, headless: bool, parallel_config_hash: str | None = None) -> bytes:
    """READY map; ``parallel_config_hash`` is only added when given (MoE DP > 1)."""
    return _encode_status("READY", local, headless, parallel_config_hash)


def decode_handshake_status(payload: bytes) -> HandshakeStatus:
    """Decode HELLO/READY. ``status`` is required; ``local``/``headless`` default False.

    Raises:
        RemoteProtocolError: not a map, no str ``status``, or a key of the wrong type.
    """
    obj = _unpack(payload, "handshake message")
    if type(obj) is not dict:
        raise RemoteProtocolError("handshake message: expected a map")
    status = obj.get("status")
    if type(status) is not str:
        raise RemoteProtocolError("handshake message: missing str 'status'")
    try:
        local = _k_bool(obj.get("local", False))
        headless = _k_bool(obj.get("headless", False))
        pch = _k_opt(_k_str)(obj.get("parallel_config_hash"))
    except _Bad as exc:
        raise RemoteProtocolError(f"handshake message: {exc}") from None
    return HandshakeStatus(status=status, local=local, headless=headless, parallel_config_hash=pch)


@attrs.frozen(kw_only=True)
class HandshakeInit:
    """The front-end's reply to HELLO (vLLM ``EngineHandshakeMetadata``).

    ``inputs[i]`` / ``outputs[i]`` are the sockets of front-end client i (an engine's
    ``client_index`` selects ``outputs[i]``); ``parallel_config`` is ``{}`` except for
    MoE DP.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None
    parallel_config: dict[str, Any] = attrs.field(factory=dict)


def encode_init(
    inputs: Sequence[str],
    outputs: Sequence[str],
    coordinator_input: str | None = None,
    coordinator_output: str | None = None,
    frontend_stats_publish_address: str | None = None,
    parallel_config: dict[str, Any] | None = None,
) -> bytes:
    """INIT map ``{"addresses": {inputs, outputs, coordinator_input, coordinator_output,
    frontend_stats_publish_address}, "parallel_config": {...}}``, all keys written.

    Raises LocalProtocolError for non-str addresses.
    """
    try:
        addresses = {
            "inputs": list(_k_seq(_k_str)(list(inputs))),
            "outputs": list(_k_seq(_k_str)(list(outputs))),
            "coordinator_input": _k_opt(_k_str)(coordinator_input),
            "coordinator_output": _k_opt(_k_str)(coordinator_output),
            "frontend_stats_publish_address": _k_opt(_k_str)(frontend_stats_publish_address),
        }
        pc = _k_map({} if parallel_config is None else parallel_config)
    except _Bad as exc:
        raise LocalProtocolError(f"handshake INIT: {exc}") from None
    return _pack({"addresses": addresses, "parallel_config": pc})


def decode_init(payload: bytes) -> HandshakeInit:
    """Decode INIT (used by the mock engine). ``addresses.inputs``/``outputs`` required.

    Raises RemoteProtocolError.
    """
    obj = _unpack(payload, "handshake INIT")
    addr = obj.get("addresses") if type(obj) is dict else None
    if type(addr) is not dict:
        raise RemoteProtocolError("handshake INIT: expected a map with an 'addresses' map")
    try:
        return HandshakeInit(
            inputs=_k_seq(_k_str)(addr.get("inputs")),
            outputs=_k_seq(_k_str)(addr.get("outputs")),
            coordinator_input=_k_opt(_k_str)(addr.get("coordinator_input")),
            coordinator_output=_k_opt(_k_str)(addr.get("coordinator_output")),
            frontend_stats_publish_address=_k_opt(_k_str)(addr.get("frontend_stats_publish_address")),
            parallel_config=_k_map(obj.get("parallel_config", {})),
        )
    except _Bad as exc:
        raise RemoteProtocolError(f"handshake INIT: {exc}") from None


def _positive(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class EngineCoreReadyResponse:
    """The engine's first message on each input socket (vLLM ``EngineCoreReadyResponse``).

    A full map, in this field order (vLLM 0.32.0, byte-checked against a real engine).
    ``max_model_len`` (tokens, > 0) is the only required key: it bounds prompt +
    ``max_tokens``. Missing keys take the defaults below, unknown keys (0.33.0's
    ``coord_store_port``/``coordinator_*_address``, TokenSpeed's extras) are ignored,
    and TokenSpeed's ``prefix_granularity`` is read as ``block_size``. SGLang's
    ``positional_layouts`` and TokenSpeed's ``multimodal_encoder_dtype`` are read into
    the last two fields.
    ``data_parallel_size > 1`` means MoE lock-step waves. ``max_num_batched_tokens`` is
    signed (TokenSpeed sends -1).
    """

    max_model_len: int = attrs.field(validator=_positive)
    num_gpu_blocks: int = 0
    block_size: int = 0
    dp_stats_address: str | None = None
    dtype: str = ""
    vllm_version: str = ""
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None
    #: SGLang only: the field order of each positional struct the scheduler decodes,
    #: by class name (``wire.sglang.check_layouts``); None when not sent, and then
    #: not written either (vLLM and TokenSpeed send no such key).
    positional_layouts: dict[str, tuple[str, ...]] | None = None
    #: TokenSpeed only: the dtype of the model's multimodal encoder (its vision or
    #: audio tower, ``"bfloat16"``...), None when the scheduler found none (a text
    #: model); not written when None (vLLM and SGLang send no such key).
    multimodal_encoder_dtype: str | None = None


def _strict(kind: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(v: Any, _type: Any) -> Any:
        try:
            return kind(v)
        except _Bad as exc:
            raise TypeError(str(exc)) from None

    return hook


# cattrs belongs here (handshake/config), not on the per-tick path. Its default
# hooks call int()/str() and would turn 1.5 into 1 or 5 into "5"; these are strict.
_handshake_converter = cattrs.Converter(forbid_extra_keys=False)
_handshake_converter.register_structure_hook(int, _strict(_k_int))
_handshake_converter.register_structure_hook(float, _strict(_k_float))
_handshake_converter.register_structure_hook(bool, _strict(_k_bool))
_handshake_converter.register_structure_hook(str, _strict(_k_str))


def encode_ready_response(resp: EngineCoreReadyResponse) -> bytes:
    """The ready-response map, every field in declaration order (vector
    ``handshake_ready_response``). Raises LocalProtocolError if a value cannot be packed."""
    body = _handshake_converter.unstructure(resp)
    if body.get("multimodal_encoder_dtype") is None:
        body.pop("multimodal_encoder_dtype", None)
    if body.get("positional_layouts") is None:
        body.pop("positional_layouts", None)
    else:
        body["positional_layouts"] = {k: list(v) for k, v in body["positional_layouts"].items()}
    if type(body.get("kv_cache_max_concurrency")) is int:
        body["kv_cache_max_concurrency"] = float(body["kv_cache_max_concurrency"])
    return _pack(body)


def decode_ready_response(payload: bytes) -> EngineCoreReadyResponse:
    """Decode the ready response an engine sends on the input socket.

    Raises:
        RemoteProtocolError: not a map, ``max_model_len`` missing / not an int > 0, or a
            known key of the wrong type (message lists the offending paths).
    """
    obj = _unpack(payload, "EngineCoreReadyResponse")
    if type(obj) is not dict:
        raise RemoteProtocolError("EngineCoreReadyResponse: expected a map")
    mml = obj.get("max_model_len")
    if type(mml) is not int or mml <= 0:
        raise RemoteProtocolError(f"EngineCoreReadyResponse.max_model_len: expected an int > 0, got {mml!r}")
    if "block_size" not in obj and "prefix_granularity" in obj:
        obj = dict(obj, block_size=obj["prefix_granularity"])
    try:
        return _handshake_converter.structure(obj, EngineCoreReadyResponse)
    except Exception as exc:  # cattrs ClassValidationError (an ExceptionGroup) and friends
        try:
            detail = "; ".join(cattrs.transform_error(exc))
        except Exception:  # transform_error does not know every exception
            detail = str(exc)
        raise RemoteProtocolError(f"EngineCoreReadyResponse: {detail}") from None

