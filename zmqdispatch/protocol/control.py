"""The engine control plane as typed calls (sans-IO): arguments checked and put in
the engine's positional form, results checked and typed.

Every call here is a vLLM *utility call* (``docs/control-plane.md``): a UTILITY
message ``[client_index, call_id, method, args]`` on the input socket, answered by
an ``EngineCoreOutputs`` carrying ``utility_output`` on the output socket. The
engine runs ``getattr(engine_core, method)(*args)``; an argument whose parameter is
annotated with a msgspec Struct (``add_lora``'s ``LoRARequest``) is converted from
its positional array. A method that returns a Future (``sleep``,
``pause_scheduler`` while requests drain) is answered when the Future completes.

A builder (``sleep(version, ...)``) returns a :class:`ControlCall`: the method
name on the wire, the positional arguments, and a ``parse`` function for the
reply value. Builders raise before anything is sent:

- ``UnsupportedByRuntimeError``: TokenSpeed (its direct wire has only ADD and
  ABORT), or a vLLM version that lacks the method (``pause_generation`` and
  ``profile(profiler_kwargs=)`` came in 0.33; the message names the engine's
  version);
- ``ValueError`` / ``TypeError``: an argument vLLM would refuse (the message
  names the argument and what it accepts).

``parse`` raises ``RemoteProtocolError`` when the engine's reply is not of the
type vLLM's method returns.

Method signatures (vLLM 0.32.0 and 0.33.0 ``vllm/v1/engine/core.py``,
``EngineCore`` / ``EngineCoreProc``): ``sleep(level=1, mode="abort")``,
``wake_up(tags=None) -> bool``, ``is_sleeping() -> bool``,
``pause_scheduler(mode="abort", clear_cache=True)``, ``resume_scheduler()``,
``is_scheduler_paused() -> bool``, 0.33: ``pause_generation(mode="abort",
clear_cache=True)`` (vLLM's own ``resume_generation`` calls ``resume_scheduler``),
``reset_prefix_cache(reset_running_requests=False, reset_connector=False) -> bool``,
``add_lora(LoRARequest) -> bool``, ``remove_lora(int) -> bool``,
``pin_lora(int) -> bool``, ``list_loras() -> set[int]``,
``collective_rpc(method, timeout=None, args=(), kwargs=None) -> list``,
``profile(is_start=True, profile_prefix=None, delay_iterations=None,
max_iterations=None[, profiler_kwargs=None in 0.33])``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeGuard, TypeVar

import attrs

from ..errors import RemoteProtocolError, UnsupportedByRuntimeError
from .versions import EngineVersion

__all__ = [
    "PAUSE_MODES",
    "ControlCall",
    "LoRARequest",
    "PauseMode",
    "SGLANG_CONTROL_CALLS",
    "add_lora",
    "flush_cache",
    "collective_rpc",
    "is_scheduler_paused",
    "is_sleeping",
    "list_loras",
    "pause_generation",
    "pause_scheduler",
    "pin_lora",
    "profile",
    "remove_lora",
    "reset_prefix_cache",
    "resume_generation",
    "resume_scheduler",
    "sleep",
    "start_profile",
    "stop_profile",
    "wake_up",
]

#: vLLM's ``PauseMode``: what a pause does with running requests. ``"abort"``:
#: abort them (each gets a final ABORT output); ``"wait"``: let them finish (the
#: call is answered once they have); ``"keep"``: freeze them until resumed.
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")
#: vLLM's sleep levels: 0 pauses scheduling only; 1 also offloads the weights
#: and drops the KV cache; 2 drops all device memory (needs an engine started
#: with ``enable_sleep_mode``).
SLEEP_LEVELS: tuple[int, ...] = (0, 1, 2)

#: The CONTROL methods the SGLang plugin maps onto the scheduler's own requests.
SGLANG_CONTROL_CALLS: tuple[str, ...] = ("flush_cache", "start_profile", "stop_profile")

#: the parsed result type of a :class:`ControlCall`
R = TypeVar("R")


@attrs.frozen
class ControlCall(Generic[R]):
    """One typed utility call, ready to send (``ControlCall[R]``: its reply parses to ``R``).

    Attributes:
        name: the client method's name (for messages).
        method: the ``EngineCore`` method the engine runs.
        args: its positional arguments, in wire form (msgpack-ready).
        parse: checks and types the reply's value; raises ``RemoteProtocolError``.
    """

    name: str
    method: str
    args: tuple[Any, ...]
    parse: Callable[[Any], R]


def _is_int(v: Any) -> TypeGuard[int]:
    return type(v) is int  # bool is not an int here


def _check_str(name: str, v: Any, *, empty: bool = False) -> None:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a str, got {type(v).__name__}")
    if not empty and not v:
        raise ValueError(f"{name}: must not be empty")


@attrs.frozen(kw_only=True)
class LoRARequest:
    """A LoRA adapter to load: vLLM's ``LoRARequest`` (``vllm/lora/request.py``,
    identical in 0.32.0 and 0.33.0), a msgspec Struct with ``array_like=True``: on
    the wire a 6-element array in this field order (vLLM's encoder writes every
    field; golden bytes in ``tests/control/test_control_wire.py``).

    Attributes:
        lora_name: the adapter's name; vLLM compares adapters by name.
        lora_int_id: the adapter's id, an int >= 1 (vLLM refuses 0 and below),
            unique per adapter; ``remove_lora`` / ``pin_lora`` take it.
        lora_path: a non-empty path (on the engine's host) or hub id of a PEFT
            adapter (``adapter_config.json`` + weights).
        base_model_name: the base model's name, or ``None``.
        load_inplace: reload even if an adapter with this id is loaded.
        is_3d_lora_weight: MoE adapters stored in the fused 3-D layout (read only
            by engines started with ``enable_mixed_moe_lora_format``).

    Raises:
        TypeError / ValueError: a field vLLM's ``LoRARequest`` would refuse
            (message names it).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __attrs_post_init__(self) -> None:
        _check_str("lora_name", self.lora_name)
        if not _is_int(self.lora_int_id):
            raise TypeError(f"lora_int_id: expected an int, got {type(self.lora_int_id).__name__}")
        if not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id: must be >= 1 (and < 2**63), got {self.lora_int_id}")
        _check_str("lora_path", self.lora_path)
        if self.base_model_name is not None:
            _check_str("base_model_name", self.base_model_name, empty=True)
        for name in ("load_inplace", "is_3d_lora_weight"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")

    def to_wire(self) -> list[Any]:
        """The positional array vLLM's encoder writes."""
        return [self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name, self.load_inplace,
                self.is_3d_lora_weight]


# ---------------------------------------------------------------------- version checks


def _require(version: EngineVersion, name: str, since: tuple[int, int] | None = None, hint: str = "") -> None:
    if version.runtime == "sglang":
        raise UnsupportedByRuntimeError(
            f"{name}: the {version.engine_name} scheduler does not answer it (its control calls: "
            f"{', '.join(SGLANG_CONTROL_CALLS)})",
            runtime="sglang",
        )
    if version.runtime != "vllm":
        raise UnsupportedByRuntimeError(
            f"{name}: the {version.engine_name} scheduler has no control plane (its direct wire has only ADD "
            "and ABORT)",
            runtime="tokenspeed",
        )
    if since is not None and not version.at_least(*since):
        raise UnsupportedByRuntimeError(
            f"{name}: the engine is {version.engine_name}, and vLLM added this in {since[0]}.{since[1]}{hint}",
            runtime="vllm",
        )


# ---------------------------------------------------------------------- result parsers


def _none(name: str) -> Callable[[Any], None]:
    def parse(v: Any) -> None:
        if v is not None:
            raise RemoteProtocolError(f"{name}: expected no result, got {type(v).__name__}")
        return None

    return parse


def _bool(name: str) -> Callable[[Any], bool]:
    def parse(v: Any) -> bool:
        if type(v) is not bool:
            raise RemoteProtocolError(f"{name}: expected a bool result, got {type(v).__name__}")
        return v

    return parse


def _int_set(name: str) -> Callable[[Any], frozenset[int]]:
    def parse(v: Any) -> frozenset[int]:
        if type(v) not in (list, tuple) or not all(_is_int(x) for x in v):
            raise RemoteProtocolError(f"{name}: expected an array of ints, got {v!r:.100}")
        return frozenset(v)

    return parse


def _list(name: str) -> Callable[[Any], list[Any]]:
    def parse(v: Any) -> list[Any]:
        if type(v) not in (list, tuple):
            raise RemoteProtocolError(f"{name}: expected an array (one result per worker), got {type(v).__name__}")
        return list(v)

    return parse


# ---------------------------------------------------------------------- argument checks


def _mode(mode: Any) -> str:
    if mode not in PAUSE_MODES or not isinstance(mode, str):
        raise ValueError(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode


def _flag(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return v


def _lora_id(v: Any) -> int:
    if not _is_int(v):
        raise TypeError(f"lora_id: expected an int, got {type(v).__name__}")
    if not 1 <= v < 2**63:
        raise ValueError(f"lora_id: must be >= 1 (and < 2**63), got {v}")
    return v


def _opt_int(name: str, v: Any, minimum: int) -> int | None:
    if v is None:
        return None
    if not _is_int(v):
        raise TypeError(f"{name}: expected an int or None, got {type(v).__name__}")
    if not minimum <= v < 2**63:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return v


def _trim(args: list[Any]) -> tuple[Any, ...]:
    """Drop trailing ``None`` arguments (the method's defaults), so a call that
    does not use a newer parameter works on the older signature too."""
    while args and args[-1] is None:
        args.pop()
    return tuple(args)


# ---------------------------------------------------------------------- sleep / wake


def sleep(version: EngineVersion, level: int = 1, mode: str = "abort") -> ControlCall[None]:
    """``sleep(level, mode)``: pause scheduling (*mode* decides what running
    requests do) and, at level 1 / 2, release device memory. Result ``None``."""
    _require(version, "sleep")
    if not _is_int(level) or level not in SLEEP_LEVELS:
        raise ValueError(f"level: expected one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r}")
    return ControlCall("sleep", "sleep", (level, _mode(mode)), _none("sleep"))


def wake_up(version: EngineVersion, tags: Sequence[str] | None = None) -> ControlCall[bool]:
    """``wake_up(tags)``: bring back what sleep released (``None``: all;
    ``["weights"]``, ``["kv_cache"]``; ``["scheduling"]`` after a level-0
    sleep). Result: whether the engine is fully awake (``bool``)."""
    _require(version, "wake_up")
    if tags is not None:
        if isinstance(tags, (str, bytes)) or not isinstance(tags, Sequence):
            raise TypeError(f"tags: expected a sequence of str or None, got {type(tags).__name__}")
        for t in tags:
            _check_str("tags[]", t)
        tags = list(tags)
    return ControlCall("wake_up", "wake_up", (tags,), _bool("wake_up"))


def is_sleeping(version: EngineVersion) -> ControlCall[bool]:
    """``is_sleeping()``: paused scheduling or released memory (``bool``)."""
    _require(version, "is_sleeping")
    return ControlCall("is_sleeping", "is_sleeping", (), _bool("is_sleeping"))


# ---------------------------------------------------------------------- pause / resume


def pause_scheduler(version: EngineVersion, mode: str = "abort", clear_cache: bool = True) -> ControlCall[None]:
    """``pause_scheduler(mode, clear_cache)``: stop scheduling; new requests are
    queued until :func:`resume_scheduler`. Result ``None``."""
    _require(version, "pause_scheduler")
    return ControlCall("pause_scheduler", "pause_scheduler", (_mode(mode), _flag("clear_cache", clear_cache)),
                       _none("pause_scheduler"))


def resume_scheduler(version: EngineVersion) -> ControlCall[None]:
    """``resume_scheduler()``: schedule again (and run what was queued). Result ``None``."""
    _require(version, "resume_scheduler")
    return ControlCall("resume_scheduler", "resume_scheduler", (), _none("resume_scheduler"))


def is_scheduler_paused(version: EngineVersion) -> ControlCall[bool]:
    """``is_scheduler_paused()`` (``bool``)."""
    _require(version, "is_scheduler_paused")
    return ControlCall("is_scheduler_paused", "is_scheduler_paused", (), _bool("is_scheduler_paused"))


_PAUSE_HINT = " (pause_scheduler / resume_scheduler exist on every known version)"


def pause_generation(version: EngineVersion, mode: str = "abort", clear_cache: bool = True) -> ControlCall[None]:
    """vLLM >= 0.33 ``pause_generation(mode, clear_cache)``: ``pause_scheduler``
    for a user pause; with ``"abort"`` / ``"wait"`` the engine also *refuses* new
    requests (a retryable ``engine_paused`` error) until
    :func:`resume_generation`, instead of queueing them. Result ``None``."""
    _require(version, "pause_generation", (0, 33), _PAUSE_HINT)
    return ControlCall("pause_generation", "pause_generation", (_mode(mode), _flag("clear_cache", clear_cache)),
                       _none("pause_generation"))


def resume_generation(version: EngineVersion) -> ControlCall[None]:
    """vLLM >= 0.33: end a :func:`pause_generation` (the engine method is
    ``resume_scheduler``, which in 0.33 also lifts the refusal). Result ``None``."""
    _require(version, "resume_generation", (0, 33), _PAUSE_HINT)
    return ControlCall("resume_generation", "resume_scheduler", (), _none("resume_generation"))


# ---------------------------------------------------------------------- caches


def reset_prefix_cache(
    version: EngineVersion, reset_running_requests: bool = False, reset_connector: bool = False
) -> ControlCall[bool]:
    """``reset_prefix_cache(reset_running_requests, reset_connector)``: drop the
    cached prefix blocks. Result: whether it was reset (``False`` when blocks are
    still in use and ``reset_running_requests`` is False)."""
    _require(version, "reset_prefix_cache")
    args = (_flag("reset_running_requests", reset_running_requests), _flag("reset_connector", reset_connector))
    return ControlCall("reset_prefix_cache", "reset_prefix_cache", args, _bool("reset_prefix_cache"))


# ---------------------------------------------------------------------- LoRA


def add_lora(version: EngineVersion, lora: LoRARequest) -> ControlCall[bool]:
    """``add_lora(LoRARequest)``: load an adapter (the engine must run with
    LoRA enabled). Result: whether it was loaded (``bool``)."""
    _require(version, "add_lora")
    if not isinstance(lora, LoRARequest):
        raise TypeError(f"lora: expected a zmqdispatch LoRARequest, got {type(lora).__name__}")
    return ControlCall("add_lora", "add_lora", (lora.to_wire(),), _bool("add_lora"))


def remove_lora(version: EngineVersion, lora_id: int) -> ControlCall[bool]:
    """``remove_lora(lora_int_id)``. Result: whether it was loaded (``bool``)."""
    _require(version, "remove_lora")
    return ControlCall("remove_lora", "remove_lora", (_lora_id(lora_id),), _bool("remove_lora"))


def pin_lora(version: EngineVersion, lora_id: int) -> ControlCall[bool]:
    """``pin_lora(lora_int_id)``: never evict it. Result ``bool``."""
    _require(version, "pin_lora")
    return ControlCall("pin_lora", "pin_lora", (_lora_id(lora_id),), _bool("pin_lora"))


def list_loras(version: EngineVersion) -> ControlCall[frozenset[int]]:
    """``list_loras()``: the loaded adapters' ``lora_int_id`` s (``frozenset[int]``;
    vLLM returns a set, sent as an array)."""
    _require(version, "list_loras")
    return ControlCall("list_loras", "list_loras", (), _int_set("list_loras"))


# ---------------------------------------------------------------------- workers, profiler


def collective_rpc(
    version: EngineVersion,
    method: str,
    *,
    timeout: float | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> ControlCall[list[Any]]:
    """``collective_rpc(method, timeout, args, kwargs)``: run a worker method on
    every worker. *method* must be a name (a function would travel pickled, which
    engines refuse unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` and this client
    never sends); *args* / *kwargs* and the results must be msgpack values.
    *timeout* is the engine's own wait for its workers, in seconds. Result: one
    value per worker (``list``)."""
    _require(version, "collective_rpc")
    if callable(method) or not isinstance(method, str):
        raise TypeError(f"method: expected a worker method name (str), got {type(method).__name__} "
                        "(a callable would have to be pickled)")
    _check_str("method", method)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"rpc_timeout: expected seconds > 0 or None, got {timeout!r}")
        timeout = float(timeout)
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args: expected a sequence, got {type(args).__name__}")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError("kwargs: expected a mapping with str keys or None")
        kwargs = dict(kwargs)
    return ControlCall("collective_rpc", "collective_rpc", (method, timeout, list(args), kwargs),
                       _list("collective_rpc"))


def profile(
    version: EngineVersion,
    is_start: bool = True,
    *,
    profile_prefix: str | None = None,
    delay_iterations: int | None = None,
    max_iterations: int | None = None,
    profiler_kwargs: Mapping[str, Any] | None = None,
) -> ControlCall[None]:
    """``profile(is_start, profile_prefix, delay_iterations, max_iterations[,
    profiler_kwargs])``: start or stop the workers' profiler (the engine must run
    with a profiler configured, e.g. ``--profiler-config``; otherwise the call
    fails with ``UtilityCallError``). ``profiler_kwargs`` needs vLLM >= 0.33.
    Arguments left ``None`` are not sent. Result ``None``."""
    _require(version, "profile")
    args: list[Any] = [
        _flag("is_start", is_start),
        profile_prefix,
        _opt_int("delay_iterations", delay_iterations, 0),
        _opt_int("max_iterations", max_iterations, 1),
    ]
    if profile_prefix is not None:
        _check_str("profile_prefix", profile_prefix)
    if profiler_kwargs is not None:
        _require(version, "profile(profiler_kwargs=...)", (0, 33))
        if not isinstance(profiler_kwargs, Mapping) or not all(isinstance(k, str) for k in profiler_kwargs):
            raise TypeError("profiler_kwargs: expected a mapping with str keys or None")
        args.append(dict(profiler_kwargs))
    return ControlCall("profile", "profile", _trim(args), _none("profile"))


# ---------------------------------------------------------------------- SGLang (CONTROL calls)
#
# An SGLang scheduler answers CONTROL ``[call_id, method, args]`` with
# ``ControlReplySlim(call_id, success, message)``: success gives the message (often
# empty) as the result, failure a UtilityCallError carrying it. The plugin turns
# the three methods below into the scheduler's FlushCacheReqInput and ProfileReq.


def _require_sglang(version: EngineVersion, name: str) -> None:
    if version.runtime != "sglang":
        raise UnsupportedByRuntimeError(
            f"{name}: a control call of SGLang schedulers; the engine is {version.engine_name}",
            runtime=version.runtime,
        )


def _message(name: str) -> Callable[[Any], str | None]:
    def parse(v: Any) -> str | None:
        if v is not None and not isinstance(v, str):
            raise RemoteProtocolError(f"{name}: expected a message str, got {type(v).__name__}")
        return v

    return parse


def flush_cache(version: EngineVersion, timeout_s: float = 0.0) -> ControlCall[str | None]:
    """SGLang ``flush_cache(timeout_s)``: drop the radix (prefix) cache; with
    *timeout_s* > 0 the scheduler waits up to that long for running requests to
    finish first. Result: the scheduler's message (``UtilityCallError`` when it
    could not flush, e.g. requests still running)."""
    _require_sglang(version, "flush_cache")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < float("inf"):
        raise ValueError(f"timeout_s: expected seconds >= 0, got {timeout_s!r}")
    return ControlCall("flush_cache", "flush_cache", (float(timeout_s),), _message("flush_cache"))


def start_profile(
    version: EngineVersion,
    *,
    output_dir: str | None = None,
    start_step: int | None = None,
    num_steps: int | None = None,
    activities: Sequence[str] | None = None,
    with_stack: bool | None = None,
    record_shapes: bool | None = None,
    profile_by_stage: bool = False,
    profile_id: str | None = None,
) -> ControlCall[str | None]:
    """SGLang ``start_profile(options)``: start the torch profiler (``ProfileReq``
    START). Options left ``None`` are not sent (the scheduler's environment defaults
    apply: ``SGLANG_PROFILE_WITH_STACK``, ``SGLANG_PROFILE_RECORD_SHAPES``).
    *activities*: e.g. ``["CPU", "GPU"]``. Result: the scheduler's message."""
    _require_sglang(version, "start_profile")
    options: dict[str, Any] = {}
    for name, value in (("output_dir", output_dir), ("profile_id", profile_id)):
        if value is not None:
            _check_str(name, value)
            options[name] = value
    for name, count, minimum in (("start_step", start_step, 0), ("num_steps", num_steps, 1)):
        if count is not None:
            options[name] = _opt_int(name, count, minimum)
    if activities is not None:
        if isinstance(activities, (str, bytes)) or not isinstance(activities, Sequence):
            raise TypeError(f"activities: expected a sequence of str, got {type(activities).__name__}")
        for a in activities:
            _check_str("activities[]", a)
        options["activities"] = list(activities)
    for name, flag in (("with_stack", with_stack), ("record_shapes", record_shapes)):
        if flag is not None:
            options[name] = _flag(name, flag)
    if profile_by_stage:
        options["profile_by_stage"] = _flag("profile_by_stage", profile_by_stage)
    return ControlCall("start_profile", "start_profile", (options,), _message("start_profile"))


def stop_profile(version: EngineVersion) -> ControlCall[str | None]:
    """SGLang ``stop_profile()``: stop the profiler and write the trace. Result: the message."""
    _require_sglang(version, "stop_profile")
    return ControlCall("stop_profile", "stop_profile", (), _message("stop_profile"))
