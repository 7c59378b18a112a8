"""What the servicer's metadata RPCs answer, sans-IO: ``GetModelInfo``,
``GetServerInfo`` and ``GetLoads`` of both proto packages, built from the
engines' handshake facts (``max_model_len``), the command's flags and a model
folder's ``config.json`` (:class:`ModelFacts`), and the engines' own load
reports and counters (:class:`EngineLoadRow`).

The engines do not report their model over the wire (EngineCore's ready
response carries only ``max_model_len``), so the model facts are the
operator's: ``--served-model-name``, ``--model-path`` (a local Hugging Face
folder: ``config.json`` gives ``vocab_size``, ``eos_token_id``,
``bos_token_id``, ``pad_token_id``, ``architectures``, ``model_type``;
``generation_config.json`` its ``eos_token_id`` list), ``--vocab-size``,
``--eos-token-id`` (flags win over the folder).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg_pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts_pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from ..protocol.checks import TOKENSPEED_CONTEXT_RESERVE

__all__ = [
    "EngineLoadRow",
    "ModelFacts",
    "load_rows",
    "read_model_dir",
    "tokenspeed_loads",
    "tokenspeed_model_info",
    "tokenspeed_server_info",
    "vllm_loads",
    "vllm_model_info",
    "vllm_server_info",
]

_I32_MAX = 2**31 - 1
_U32_MAX = 2**32 - 1


def _ids(value: Any) -> tuple[int, ...]:
    """An ``eos_token_id`` entry of a Hugging Face config: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _int_tuple(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)


def _str_tuple(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@attrs.frozen(kw_only=True)
class ModelFacts:
    """The model the servicer announces (the engines cannot tell it).

    Attributes:
        served_model_name: the name clients send as ``model``.
        model_path: a local folder or a hub id; reported as-is.
        tokenizer_path: what GetTokenizer zips (``None``: it answers
            ``FAILED_PRECONDITION``); reported as ``tokenizer_path``.
        vocab_size: token ids at or past it are refused (``None``: not checked).
        eos_token_ids: primary first; the vLLM translation gives them to the
            engine (which has no tokenizer).
        bos_token_id / pad_token_id: reported (0 when unknown).
        architectures / model_type: reported.
    """

    served_model_name: str
    model_path: str = ""
    tokenizer_path: str | None = None
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    architectures: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    model_type: str = ""


def facts_from_config(config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The :class:`ModelFacts` fields a Hugging Face ``config.json`` (and
    ``generation_config.json``, whose ``eos_token_id`` wins) give; keys absent
    or malformed are left out."""
    out: dict[str, Any] = {}
    vocab = _opt_int(config.get("vocab_size"))
    if vocab is not None and vocab > 0:
        out["vocab_size"] = vocab
    eos = _ids((generation_config or {}).get("eos_token_id")) or _ids(config.get("eos_token_id"))
    if eos:
        out["eos_token_ids"] = eos
    for key in ("bos_token_id", "pad_token_id"):
        v = _opt_int(config.get(key))
        if v is not None:
            out[key] = v
    arch = config.get("architectures")
    if isinstance(arch, list):
        out["architectures"] = tuple(a for a in arch if isinstance(a, str))
    if isinstance(config.get("model_type"), str):
        out["model_type"] = config["model_type"]
    return out


def read_model_dir(path: str) -> dict[str, Any]:
    """:func:`facts_from_config` of the ``config.json`` / ``generation_config.json``
    in folder *path* (``{}`` when it has neither: a hub id, a tokenizer-only folder).

    Raises:
        ValueError: a file there that is not a JSON object (names the file).
    """
    docs: list[dict[str, Any] | None] = []
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            docs.append(None)
            continue
        try:
            with open(file, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{file}: cannot read it as JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{file}: not a JSON object")
        docs.append(doc)
    config, generation = docs
    if config is None and generation is None:
        return {}
    return facts_from_config(config or {}, generation)


def vllm_model_info(facts: ModelFacts, max_model_len: int) -> vllm_pb.GetModelInfoResponse:
    """``vllm.grpc.engine.GetModelInfoResponse``: *max_model_len* is the
    smallest of the engines' (saturated to the field's range)."""
    ctx = min(max_model_len, _U32_MAX)
    return vllm_pb.GetModelInfoResponse(
        model_path=facts.model_path or facts.served_model_name,
        is_generation=True,
        max_context_length=ctx,
        vocab_size=min(facts.vocab_size or 0, _U32_MAX),
        supports_vision=False,
        served_model_name=facts.served_model_name,
        tokenizer_path=facts.tokenizer_path or "",
        model_type=facts.model_type,
        architectures=facts.architectures,
        eos_token_ids=[i for i in facts.eos_token_ids if i <= _I32_MAX],
        pad_token_id=min(facts.pad_token_id or 0, _I32_MAX),
        bos_token_id=min(facts.bos_token_id or 0, _I32_MAX),
        max_req_input_len=min(max(max_model_len - 1, 0), _I32_MAX),  # the prompt must leave room for a token
    )


def tokenspeed_model_info(facts: ModelFacts, max_model_len: int) -> ts_pb.GetModelInfoResponse:
    """``tokenspeed.grpc.scheduler.GetModelInfoResponse`` (int32 lengths)."""
    ctx = min(max_model_len, _I32_MAX)
    return ts_pb.GetModelInfoResponse(
        model_path=facts.model_path or facts.served_model_name,
        tokenizer_path=facts.tokenizer_path or "",
        served_model_name=facts.served_model_name,
        model_type=facts.model_type,
        architectures=facts.architectures,
        max_context_length=ctx,
        max_req_input_len=max(ctx - TOKENSPEED_CONTEXT_RESERVE, 0),  # the longest prompt TokenSpeed takes
        vocab_size=min(facts.vocab_size or 0, _I32_MAX),
        eos_token_ids=[i for i in facts.eos_token_ids if i <= _I32_MAX],
        pad_token_id=min(facts.pad_token_id or 0, _I32_MAX),
        bos_token_id=min(facts.bos_token_id or 0, _I32_MAX),
    )


def vllm_server_info(*, active_requests: int, uptime_seconds: float, data_parallel_size: int,
                     last_receive_timestamp: float) -> vllm_pb.GetServerInfoResponse:
    """``vllm.grpc.engine.GetServerInfoResponse``: ``server_type`` ``"vllm-grpc"``,
    the servicer's open requests, its uptime, the engines it serves; the PD, KV
    and multimodal fields stay empty (none of it runs behind this servicer)."""
    return vllm_pb.GetServerInfoResponse(
        active_requests=min(active_requests, _U32_MAX),
        is_paused=False,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type="vllm-grpc",
        data_parallel_size=min(data_parallel_size, _I32_MAX),
    )


def tokenspeed_server_info(*, active_requests: int, uptime_seconds: float, data_parallel_size: int,
                           start_time: float, facts: ModelFacts, max_model_len: int) -> ts_pb.GetServerInfoResponse:
    """``tokenspeed.grpc.scheduler.GetServerInfoResponse``: ``server_args``
    carries what the servicer was started with."""
    resp = ts_pb.GetServerInfoResponse(
        active_requests=min(active_requests, _I32_MAX),
        is_paused=False,
        uptime_seconds=uptime_seconds,
    )
    resp.server_args.update({
        "served_model_name": facts.served_model_name,
        "model_path": facts.model_path or facts.served_model_name,
        "context_length": max_model_len,
        "dp_size": data_parallel_size,
        "frontend": "zmqdispatch",
    })
    resp.start_time.FromNanoseconds(int(start_time * 1e9))
    return resp


@attrs.frozen(kw_only=True)
class EngineLoadRow:
    """One engine's load as GetLoads reports it.

    Attributes:
        dp_rank: the engine's ``engine_index``.
        num_running_reqs / num_waiting_reqs: the engine's last report
            (vLLM ``SchedulerStats``, TokenSpeed's load snapshot); without a
            report, running = this servicer's requests on it, waiting 0.
        num_total_reqs: running + waiting.
        token_usage: the engine's reported KV-cache usage (0..1), 0.0 without one.
        reported: whether the counts are the engine's own.
    """

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    token_usage: float
    reported: bool

    @property
    def num_total_reqs(self) -> int:
        return self.num_running_reqs + self.num_waiting_reqs


def load_rows(loads: Iterable[Any], in_flight: Mapping[int, int]) -> list[EngineLoadRow]:
    """One :class:`EngineLoadRow` per engine, by ``engine_index``.

    Args:
        loads: ``EngineClient.loads()`` (``EngineLoad``: ``reported_running``,
            ``reported_waiting``, ``kv_cache_usage``, None without a live report).
        in_flight: ``engine_index`` -> requests of this client on it
            (``EngineStats.in_flight``).
    """
    rows = []
    for load in sorted(loads, key=lambda x: x.engine_index):
        reported = load.reported_running is not None and load.reported_waiting is not None
        running = load.reported_running if reported else in_flight.get(load.engine_index, 0)
        waiting = load.reported_waiting if reported else 0
        rows.append(EngineLoadRow(
            dp_rank=load.engine_index,
            num_running_reqs=min(max(int(running), 0), _I32_MAX),
            num_waiting_reqs=min(max(int(waiting), 0), _I32_MAX),
            token_usage=float(load.kv_cache_usage) if load.kv_cache_usage is not None else 0.0,
            reported=reported,
        ))
    return rows


def _timestamp(now: float | None) -> str:
    t = time.time() if now is None else now
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def _selected(rows: Sequence[EngineLoadRow], dp_rank: int | None) -> Sequence[EngineLoadRow]:
    if dp_rank is None:
        return rows
    return [r for r in rows if r.dp_rank == dp_rank]


def _loads(pb: Any, rows: Sequence[EngineLoadRow], version: str, dp_rank: int | None, now: float | None, *,
           aggregate: bool) -> Any:
    """``GetLoadsResponse`` of the proto module *pb* (the three gateway protos
    share these messages' fields): a ``SchedulerLoad`` per chosen engine, and
    with *aggregate* their ``AggregateMetrics``."""
    chosen = _selected(rows, dp_rank)
    resp = pb.GetLoadsResponse(
        timestamp=_timestamp(now),
        version=version,
        dp_rank_count=len(chosen),
        loads=[pb.SchedulerLoad(
            dp_rank=r.dp_rank, num_running_reqs=r.num_running_reqs, num_waiting_reqs=r.num_waiting_reqs,
            num_total_reqs=min(r.num_total_reqs, _I32_MAX), token_usage=r.token_usage,
        ) for r in chosen],
    )
    if aggregate and chosen:
        resp.aggregate.CopyFrom(pb.AggregateMetrics(
            total_running_reqs=min(sum(r.num_running_reqs for r in chosen), _I32_MAX),
            total_waiting_reqs=min(sum(r.num_waiting_reqs for r in chosen), _I32_MAX),
            total_reqs=min(sum(r.num_total_reqs for r in chosen), _I32_MAX),
            avg_token_usage=sum(r.token_usage for r in chosen) / len(chosen),
        ))
    return resp


def vllm_loads(rows: Sequence[EngineLoadRow], *, version: str, dp_rank: int | None = None,
               now: float | None = None) -> vllm_pb.GetLoadsResponse:
    """``vllm.grpc.engine.GetLoadsResponse``: one ``SchedulerLoad`` per engine
    (only *dp_rank*'s when given; ``include`` sections other than the core are
    not known here and add nothing). An engine without a report yet is there,
    zero-filled but for this servicer's running requests."""
    resp: vllm_pb.GetLoadsResponse = _loads(vllm_pb, rows, version, dp_rank, now, aggregate=False)
    return resp


def tokenspeed_loads(rows: Sequence[EngineLoadRow], *, version: str, dp_rank: int | None = None,
                     now: float | None = None) -> ts_pb.GetLoadsResponse:
    """``tokenspeed.grpc.scheduler.GetLoadsResponse``: as :func:`vllm_loads`,
    plus the aggregate over the reported engines."""
    resp: ts_pb.GetLoadsResponse = _loads(ts_pb, rows, version, dp_rank, now, aggregate=True)
    return resp


# --------------------------------------------------------------------------- sglang.grpc.scheduler


def sglang_model_info(facts: ModelFacts, max_model_len: int) -> sg_pb.GetModelInfoResponse:
    """``sglang.grpc.scheduler.GetModelInfoResponse`` (int32 lengths; a generation model)."""
    ctx = min(max_model_len, _I32_MAX)
    return sg_pb.GetModelInfoResponse(
        model_path=facts.model_path or facts.served_model_name,
        tokenizer_path=facts.tokenizer_path or "",
        is_generation=True,
        served_model_name=facts.served_model_name,
        max_context_length=ctx,
        vocab_size=min(facts.vocab_size or 0, _I32_MAX),
        model_type=facts.model_type,
        eos_token_ids=[i for i in facts.eos_token_ids if i <= _I32_MAX],
        pad_token_id=min(facts.pad_token_id or 0, _I32_MAX),
        bos_token_id=min(facts.bos_token_id or 0, _I32_MAX),
        max_req_input_len=max(ctx - 1, 0),  # as SGLang's scheduler: context_len - 1
        architectures=facts.architectures,
    )


def sglang_server_info(*, active_requests: int, uptime_seconds: float, data_parallel_size: int, start_time: float,
                       facts: ModelFacts, max_model_len: int, engine_version: str,
                       last_receive_timestamp: float) -> sg_pb.GetServerInfoResponse:
    """``sglang.grpc.scheduler.GetServerInfoResponse``: ``server_args`` carries what the
    servicer was started with, ``sglang_version`` the schedulers' release."""
    resp = sg_pb.GetServerInfoResponse(
        active_requests=min(active_requests, _I32_MAX),
        is_paused=False,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        sglang_version=engine_version.removeprefix("sglang-"),
        server_type="grpc",
    )
    resp.server_args.update({
        "served_model_name": facts.served_model_name,
        "model_path": facts.model_path or facts.served_model_name,
        "context_length": max_model_len,
        "dp_size": data_parallel_size,
        "frontend": "zmqdispatch",
    })
    resp.start_time.FromNanoseconds(int(start_time * 1e9))
    return resp


def sglang_loads(rows: Sequence[EngineLoadRow], *, version: str, dp_rank: int | None = None,
                 now: float | None = None) -> sg_pb.GetLoadsResponse:
    """``sglang.grpc.scheduler.GetLoadsResponse``: as :func:`tokenspeed_loads` (the
    token counts, ``num_used_tokens`` / ``max_total_num_tokens``, stay 0: the load
    rows carry the usage fraction only)."""
    resp: sg_pb.GetLoadsResponse = _loads(sg_pb, rows, version, dp_rank, now, aggregate=True)
    return resp
