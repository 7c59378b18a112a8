"""Metrics: a typed snapshot per engine link, and an optional Prometheus exporter.

``EngineClient.stats()`` returns an :class:`EngineStats` per engine, by
``engine_index`` (``Engine.stats()`` one engine's): immutable, cheap to take
(a few small copies), safe to keep. The counters behind it are plain
integer increments on paths that already run per request or per output
message (``zmqdispatch.protocol.stats``), so they are always on.

Prometheus (``pip install 'zmqdispatch[prometheus]'``): :class:`StatsCollector`
is a ``prometheus_client`` custom collector that reads the snapshots of the
clients it was given at every scrape (nothing runs between scrapes)::

    from prometheus_client import REGISTRY, start_http_server
    from zmqdispatch.metrics import StatsCollector

    collector = StatsCollector()
    REGISTRY.register(collector)
    start_http_server(9400)
    async with connect(...) as client:
        collector.add(client)
        ...
        collector.remove(client)       # or keep it: a closed client reports state "dead"

Metric names (``engine_index`` label on all; full list in ``docs/operations.md``):
``zmqdispatch_requests_total``, ``zmqdispatch_requests_finished_total{finish_reason}``,
``zmqdispatch_aborts_total``, ``zmqdispatch_decode_errors_total``,
``zmqdispatch_engine_deaths_total{reason}``, ``zmqdispatch_output_drops_total``,
``zmqdispatch_slow_consumers_total``, ``zmqdispatch_renamed_requests_total``,
``zmqdispatch_unknown_outputs_total``, ``zmqdispatch_deadlines_exceeded_total{limit}``,
``zmqdispatch_output_messages_total``, ``zmqdispatch_requests_in_flight``,
``zmqdispatch_engine_up``, ``zmqdispatch_time_to_first_token_seconds``,
``zmqdispatch_inter_token_latency_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from .protocol.stats import ITL_BUCKETS, TTFT_BUCKETS, Histogram

__all__ = ["EngineStats", "HistogramSnapshot", "StatsCollector", "TTFT_BUCKETS", "ITL_BUCKETS"]


def _frozen_map(value: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class HistogramSnapshot:
    """A histogram with fixed buckets, in seconds.

    Attributes:
        bounds: upper bounds of the buckets (inclusive), increasing.
        counts: observations per bucket (not cumulative); one more entry than
            ``bounds``: the last counts values above every bound.
        sum: sum of the observed values (seconds).
        count: number of observations.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    @classmethod
    def of(cls, h: Histogram) -> HistogramSnapshot:
        return cls(bounds=h.bounds, counts=tuple(h.counts), sum=h.sum, count=h.count)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` pairs, ``inf`` last (Prometheus' ``le`` buckets)."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float | None:
        """An upper bound of the *q*-quantile (the bound of the bucket it falls
        in; ``inf`` above the last), ``None`` without observations."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        rank = q * self.count
        for bound, total in self.cumulative():
            if total >= rank and total > 0:
                return bound
        return float("inf")


@attrs.frozen(kw_only=True)
class EngineStats:
    """One engine link's counters at one moment (``Engine.stats()``; ``EngineClient.stats()`` has one per engine).

    Attributes:
        engine_index: the engine's DP rank (``data_parallel_rank``).
        runtime: ``"vllm"``, ``"tokenspeed"`` or ``"sglang"``.
        state: ``"ready"``; ``"draining"`` (a death sign seen, the engine's
            last outputs being routed; new requests refused); ``"dead"``
            (including a closed client).
        death_reason: ``EngineDeadError.reason`` once dead or draining, else ``None``.
        in_flight: live requests (ADD queued or sent, no end yet).
        pending_utility_calls: utility calls awaiting their reply.
        requests: requests submitted (ADD queued).
        finishes: ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``) ->
            requests the engine finished with it.
        aborts: requests the client aborted before their end (a stream left
            early, ``abort()``, a deadline, the client closing).
        abort_ids_sent: request ids sent to the engine in ABORT frames.
        decode_errors: output messages that did not decode.
        deaths: ``EngineDeadError.reason`` -> count (at most one per link).
        output_drops: output connections lost with requests possibly on them.
        slow_consumers: requests failed with ``SlowConsumerError``.
        renamed_requests: requests sent under a fresh engine-side id.
        unknown_outputs: output rows for requests no longer live (dropped;
            normal after an abort).
        deadlines_exceeded: limit (``"first_token"``, ``"total"``, ``"stall"``) -> requests failed.
        output_messages: output messages received.
        time_to_first_token / inter_token_latency: :class:`HistogramSnapshot`,
            seconds (how they are measured: :mod:`zmqdispatch.protocol.stats`).
    """

    engine_index: int
    runtime: str
    state: str
    death_reason: str | None
    in_flight: int
    pending_utility_calls: int
    requests: int
    finishes: Mapping[str, int] = attrs.field(converter=_frozen_map)
    aborts: int
    abort_ids_sent: int
    decode_errors: int
    deaths: Mapping[str, int] = attrs.field(converter=_frozen_map)
    output_drops: int
    slow_consumers: int
    renamed_requests: int
    unknown_outputs: int
    deadlines_exceeded: Mapping[str, int] = attrs.field(converter=_frozen_map)
    output_messages: int
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot

    @classmethod
    def of(cls, client: Any) -> EngineStats:
        """The snapshot of *client* (an :class:`~zmqdispatch.Engine`) now."""
        p = client.protocol
        st = p.stats
        death = p.death or p.gone
        if p.death is not None:
            state = "dead"
        elif p.gone is not None:
            state = "draining"
        else:
            state = "ready"
        return cls(
            engine_index=p.engine_index,
            runtime=p.runtime.value,
            state=state,
            death_reason=None if death is None else death.reason,
            in_flight=p.inflight,
            pending_utility_calls=p.pending_utility_calls,
            requests=st.requests,
            finishes=st.finishes,
            aborts=st.aborts,
            abort_ids_sent=p.aborts_sent,
            decode_errors=p.decode_errors,
            deaths=st.deaths,
            output_drops=p.output_drops,
            slow_consumers=st.slow_consumers,
            renamed_requests=p.renamed_requests,
            unknown_outputs=p.unknown_outputs,
            deadlines_exceeded=st.deadlines_exceeded,
            output_messages=p.messages_received,
            time_to_first_token=HistogramSnapshot.of(st.ttft),
            inter_token_latency=HistogramSnapshot.of(st.itl),
        )


#: (metric name without ``_total``, EngineStats attribute, help) of the plain counters
_COUNTERS = (
    ("zmqdispatch_requests", "requests", "Requests submitted to the engine (ADD queued)."),
    ("zmqdispatch_aborts", "aborts", "Requests the client aborted before their end."),
    ("zmqdispatch_abort_ids_sent", "abort_ids_sent", "Request ids sent to the engine in ABORT frames."),
    ("zmqdispatch_decode_errors", "decode_errors", "Engine output messages that did not decode."),
    ("zmqdispatch_output_drops", "output_drops", "Engine output connections lost (outputs on them lost)."),
    ("zmqdispatch_slow_consumers", "slow_consumers", "Requests failed because their consumer fell behind."),
    ("zmqdispatch_renamed_requests", "renamed_requests", "Requests sent under a fresh engine-side id."),
    ("zmqdispatch_unknown_outputs", "unknown_outputs", "Output rows for requests no longer live (dropped)."),
    ("zmqdispatch_output_messages", "output_messages", "Engine output messages received."),
)

#: (metric name without ``_total``, EngineStats attribute, label, help) of the labelled counters
_LABELLED = (
    ("zmqdispatch_requests_finished", "finishes", "finish_reason", "Requests the engine finished, by finish_reason."),
    ("zmqdispatch_engine_deaths", "deaths", "reason", "Engine deaths, by EngineDeadError.reason."),
    ("zmqdispatch_deadlines_exceeded", "deadlines_exceeded", "limit", "Requests failed past a deadline, by limit."),
)


class StatsCollector:
    """A ``prometheus_client`` collector of :class:`EngineStats` (the
    ``prometheus`` extra). Register it once; :meth:`add` / :meth:`remove`
    clients (anything with ``stats() -> EngineStats``) as they come and go.
    A scrape calls ``stats()`` on each: no cost between scrapes.

    Every sample is labelled ``engine_index``; clients whose engines share an
    index (separate engines that are each DP rank 0) need a label of their
    own: ``add(client, engine="gpu-a")``.

    Raises:
        ImportError: ``prometheus_client`` is not installed (on construction).
    """

    def __init__(self, clients: Iterable[Any] = ()) -> None:
        import prometheus_client.core  # noqa: F401  (fail early without the extra)

        self._clients: list[tuple[Any, dict[str, str]]] = []
        for c in clients:
            self.add(c)

    def add(self, client: Any, **labels: str) -> None:
        """Report *client* from the next scrape on, with these extra labels.

        Raises:
            ValueError: the extra label names differ from those of the clients
                already added (one metric family has one set of label names).
        """
        if any(c is client for c, _ in self._clients):
            return
        if self._clients and sorted(labels) != sorted(self._clients[0][1]):
            raise ValueError(
                f"labels {sorted(labels)} differ from those of the clients already added "
                f"({sorted(self._clients[0][1])})"
            )
        self._clients.append((client, {k: str(v) for k, v in labels.items()}))

    def remove(self, client: Any) -> None:
        """Stop reporting *client* (idempotent)."""
        self._clients = [(c, lab) for c, lab in self._clients if c is not client]

    def describe(self) -> list[Any]:
        # Metric names are fixed, but their samples depend on the clients: an
        # empty description keeps register() from calling collect() early.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        clients = list(self._clients)
        extra = sorted(clients[0][1]) if clients else []
        label = ["engine_index", *extra]
        rows = [(s, lab) for c, lab in clients for s in c.stats().values()]
        keyed = [(s, [str(s.engine_index), *(lab[k] for k in extra)]) for s, lab in rows]
        for name, attr, help_text in _COUNTERS:
            fam = CounterMetricFamily(name, help_text, labels=label)
            for s, values in keyed:
                fam.add_metric(values, getattr(s, attr))
            yield fam
        for name, attr, key, help_text in _LABELLED:
            fam = CounterMetricFamily(name, help_text, labels=[*label, key])
            for s, values in keyed:
                for value, n in sorted(getattr(s, attr).items()):
                    fam.add_metric([*values, value], n)
            yield fam
        inflight = GaugeMetricFamily("zmqdispatch_requests_in_flight", "Live requests.", labels=label)
        up = GaugeMetricFamily("zmqdispatch_engine_up", "1 while the engine accepts requests, else 0.", labels=label)
        for s, values in keyed:
            inflight.add_metric(values, s.in_flight)
            up.add_metric(values, 1 if s.state == "ready" else 0)
        yield inflight
        yield up
        for name, attr, help_text in (
            ("zmqdispatch_time_to_first_token_seconds", "time_to_first_token",
             "Seconds from a request's submit to the receipt of its first token."),
            ("zmqdispatch_inter_token_latency_seconds", "inter_token_latency",
             "Seconds between receipts of a request's consecutive token outputs."),
        ):
            hist = HistogramMetricFamily(name, help_text, labels=label)
            for s, values in keyed:
                h: HistogramSnapshot = getattr(s, attr)
                buckets = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in h.cumulative()]
                hist.add_metric(values, buckets, sum_value=h.sum)
            yield hist
