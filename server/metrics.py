"""Prometheus metrics: the only module that imports prometheus_client.

Engine numbers arrive as plain stats (the engine thread calls `observe_step` after each step);
HTTP numbers from the routes. Gauges are refreshed after every step and every second when
idle, so they are current even with no traffic.

PromQL:
- generation tokens/s:        rate(specserve:generation_tokens_total[1m])
- acceptance rate:            rate(specserve:spec_decode_num_accepted_tokens_total[5m])
                              / rate(specserve:spec_decode_num_draft_tokens_total[5m])
- requests/s by status:       sum by (status) (rate(specserve:http_requests_total[1m]))
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

P = "specserve:"


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests",
                                       ["finish_reason"], registry=r)
        self.http_requests = Counter(P + "http_requests", "HTTP requests", ["route", "status"],
                                     registry=r)
        self.num_running = Gauge(P + "num_requests_running", "Requests running", registry=r)
        self.num_waiting = Gauge(P + "num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "KV cache blocks in use (0-1)",
                              ["model"], registry=r)
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "Verifications with drafts",
                                   registry=r)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens",
                                         registry=r)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Accepted tokens",
                                     registry=r)
        self._last_spec = (0, 0, 0)

    def observe_step(self, engine, outputs) -> None:
        """Engine thread, after each step (and once a second when idle)."""
        self.num_running.set(engine.num_running)
        self.num_waiting.set(engine.num_waiting)
        self.kv_usage.labels("target").set(engine.block_manager.usage)
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self.request_success.labels(out.finish_reason or "unknown").inc()
            if len(out.output_token_ids) == len(out.new_token_ids) and out.new_token_ids:
                self.prompt_tokens.inc(len(out.prompt_token_ids))  # first tokens: prompt done
        spec = engine.speculator
        if spec is not None:
            st = spec.stats
            now = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
            for counter, new, old in zip((self.spec_drafts, self.spec_draft_tokens,
                                          self.spec_accepted), now, self._last_spec):
                counter.inc(new - old)
            self._last_spec = now

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
