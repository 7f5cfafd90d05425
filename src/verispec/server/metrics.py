"""Prometheus metrics of one app, in the app's own CollectorRegistry (never the global one), and
the ASGI middleware that counts every HTTP request.

    verispec_requests_total{endpoint, status}          every HTTP response, errors included
    verispec_request_latency_seconds{endpoint}          request start to last byte (streams too)
    verispec_time_to_first_token_seconds{endpoint}      request start to the first text delta
    verispec_generations_total{outcome}                 completed / cancelled / failed
    verispec_prompt_tokens_total, verispec_generated_tokens_total
    verispec_drafted_tokens_total, verispec_accepted_tokens_total
    verispec_acceptance_rate                            accepted / drafted since start
    verispec_position_acceptance_rate{position}         P(accept draft position i | reached i),
                                                        i = 1..k, since start
    verispec_queue_depth                                requests waiting for the worker
    verispec_running_requests                           requests in the running batch, and long
                                                        prompts being prefilled before they join
    verispec_rounds_total{draft_tokens}                 the batch's rounds by depth (0: plain)
    verispec_round_rows_total{draft_tokens}             rows over those rounds: / rounds_total is
                                                        the mean batch size at each depth
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from ..text.batch import GenerationMetrics, TextRow

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
UNMATCHED = "unmatched"  # endpoint label of requests no route matched (keeps labels bounded)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("verispec_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("verispec_request_latency_seconds", "Request latency",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("verispec_time_to_first_token_seconds", "Time to first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.generations = Counter("verispec_generations", "Generations by outcome",
                                   ["outcome"], registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens", registry=r)
        self.generated = Counter("verispec_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("verispec_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("verispec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Gauge("verispec_acceptance_rate", "Accepted / drafted since start",
                                registry=r)
        self.position_acceptance = Gauge(
            "verispec_position_acceptance_rate",
            "Acceptance rate of draft position i (1-based) among rounds that reached it",
            ["position"], registry=r)
        self.queue_depth = Gauge("verispec_queue_depth", "Requests waiting for the worker",
                                 registry=r)
        self.running = Gauge("verispec_running_requests",
                             "Requests in the running batch, and long prompts being prefilled "
                             "before they join", registry=r)
        self.rounds = Counter("verispec_rounds", "The batch's rounds by depth (0: plain)",
                              ["draft_tokens"], registry=r)
        self.round_rows = Counter("verispec_round_rows", "Rows over the batch's rounds, by depth",
                                  ["draft_tokens"], registry=r)
        self.drafting = Info("verispec_drafting", "How requests are drafted: the rule of a "
                             "draft of another tokenizer (cross_vocab_rule; none: the target's "
                             "own vocabulary or no draft model)", registry=r)
        self._lock = threading.Lock()
        self._total = GenerationMetrics()

    def track_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def track_running(self, running: Callable[[], int]) -> None:
        self.running.set_function(running)

    def record_round(self, num_rows: int, num_draft_tokens: int) -> None:
        """The worker's round hook: one round of ``num_rows`` rows at this depth."""
        label = str(num_draft_tokens)
        self.rounds.labels(label).inc()
        self.round_rows.labels(label).inc(num_rows)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def observe_first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)

    def record_generation(self, row: TextRow, outcome: str) -> None:
        """The worker's finish hook: add one generation's counters (partial if cancelled)."""
        metrics = row.row.metrics
        self.generations.labels(outcome).inc()
        self.prompt_tokens.inc(row.num_prompt_tokens)
        self.generated.inc(len(row.token_ids))
        self.drafted.inc(metrics.num_drafted)
        self.accepted.inc(metrics.num_accepted)
        with self._lock:
            self._total = self._total + metrics
            total = self._total
        if total.num_drafted:
            self.acceptance.set(total.acceptance_rate)
        for index, rate in enumerate(total.per_position_acceptance):
            self.position_acceptance.labels(str(index + 1)).set(rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Pure ASGI (so streamed bodies are timed to their last byte): count and time each request
    under its route's path template."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app raises before responding

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            endpoint = getattr(scope.get("route"), "path", UNMATCHED)
            self.metrics.observe_request(endpoint, status, time.perf_counter() - started)
