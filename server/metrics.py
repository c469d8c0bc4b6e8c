"""Prometheus metrics: the only module that imports prometheus_client.

The engine sends a plain snapshot of its stats (engine/engine_stats.py) with every step's
outputs, and once a second when idle, so gauges are current with no traffic; `observe_step`
runs in the thread that receives it (the engine thread, or the engine process's reader).
Counters mirror engine counters by their increase since the previous observation. One server
process serves one model pair (no worker processes), so the default registry mode is right;
scale out with replicas behind a load balancer, each scraped on its own.

Buckets cover both CPUs (seconds per token) and GPUs (milliseconds).

PromQL (the Grafana dashboard uses these):
- generation tokens/s:      sum(rate(specserve:generation_tokens_total[1m]))
- acceptance rate:          sum(rate(specserve:spec_decode_num_accepted_tokens_total[5m]))
                            / sum(rate(specserve:spec_decode_num_draft_tokens_total[5m]))
  by method (draft_model, suffix, ngram): the same with `sum by (method)`
- mean accepted length:     sum(rate(specserve:spec_decode_accepted_length_sum[5m]))
                            / sum(rate(specserve:spec_decode_accepted_length_count[5m]))
  (tokens emitted per verification that had drafts: accepted drafts + 1)
- acceptance by position j: sum by (position) (rate(
                              specserve:spec_decode_num_accepted_tokens_per_pos_total[5m]))
                            / scalar(sum(rate(specserve:spec_decode_num_drafts_total[5m])))
- mean token-tree size:     rate(specserve:spec_decode_num_tree_nodes_total[5m])
                            / rate(specserve:spec_decode_num_tree_verifications_total[5m])
  (trees on, the guard drafts chains where trees realized less: the rate of
  specserve:spec_decode_num_chain_steps_chosen_total counts those steps)
- p50/p95/p99 latencies:    histogram_quantile(0.95, sum by (le) (rate(
                              specserve:time_to_first_token_seconds_bucket[5m])))
                            (likewise inter_token_latency_seconds, e2e_request_latency_seconds,
                            request_queue_time_seconds)
- prefix-cache hit rate:    rate(specserve:prefix_cache_hits_total[5m])
                            / rate(specserve:prefix_cache_queries_total[5m])
- HTTP error rate:          sum(rate(specserve:http_requests_total{status=~"[45].."}[5m]))
                            / sum(rate(specserve:http_requests_total[5m]))
"""

from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,  # noqa
                               Histogram, Info, generate_latest)

P = "specserve:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def counter(name, doc, labels=()):
            return Counter(P + name, doc, list(labels), registry=r)

        def gauge(name, doc, labels=()):
            return Gauge(P + name, doc, list(labels), registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter("request_success", "Finished requests",
                                       ["finish_reason"])
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications with drafts")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified",
                                         ["method"])
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     ["method"])
        self.spec_tree_verifications = counter("spec_decode_num_tree_verifications",
                                               "Verifications whose drafts were a token tree")
        self.spec_tree_nodes = counter("spec_decode_num_tree_nodes",
                                       "Draft tokens verified in token trees (their nodes)")
        self.spec_chain_steps = counter(
            "spec_decode_num_chain_steps_chosen",
            "Steps whose drafts were chains though trees were on: trees realized less there")
        self.spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position",
                                         ["position"])
        self.http_requests = counter("http_requests", "HTTP requests", ["route", "status"])
        self.grammar_requests = counter("structured_output_requests",
                                        "Requests with a grammar (response_format, tools)")
        self.grammar_mask_seconds = counter("structured_output_mask_seconds",
                                            "Time spent computing grammar token masks")
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time per output token after "
                             "the first", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Arrival to first "
                                    "scheduled", buckets=REQUEST_BUCKETS, registry=r)
        self.accepted_length = Histogram(P + "spec_decode_accepted_length", "Tokens emitted per "
                                         "verification step with drafts",
                                         buckets=tuple(range(1, 18)), registry=r)
        self.num_running = gauge("num_requests_running", "Requests running")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache blocks in use (0-1)", ["model"])
        self.spec_k = gauge("spec_decode_k", "Mean k chosen in the latest decoding step")
        self.suffix_cache_tokens = gauge("spec_decode_suffix_cache_tokens", "Finished "
                                         "requests' tokens held by the suffix cache")
        self.rank_up = gauge("tensor_parallel_rank_up", "1 while a tensor-parallel rank is "
                             "alive (one series per rank)", ["rank"])
        self.rank_bytes = gauge("tensor_parallel_rank_memory_bytes", "A tensor-parallel "
                                "rank's share of the target's weights and its KV pool",
                                ["rank", "kind"])
        self.info = Info(P + "model", "Served model and configuration", registry=r)
        self._last: dict[str, int] = {}
        self._last_mask_seconds = 0.0
        self._last_token_time: dict[str, float] = {}

    def set_info(self, **labels: str) -> None:
        self.info.info({k: str(v) for k, v in labels.items()})

    # -- engine thread -----------------------------------------------------------------------
    def observe_step(self, stats, outputs) -> None:
        """One engine step: `stats` its EngineStats snapshot (engine/engine_stats.py),
        `outputs` the RequestOutputs it produced."""
        now = time.monotonic()
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.labels("target").set(stats.kv_usage)
        for out in outputs:
            self._observe_output(out, now)
        self._mirror("preemptions", self.preemptions, stats.num_preemptions)
        self._mirror("prefix_queries", self.prefix_queries, stats.prefix_queries)
        self._mirror("prefix_hits", self.prefix_hits, stats.prefix_hits)
        self._mirror("grammar_requests", self.grammar_requests, stats.grammar_requests)
        for rank, alive, weight_bytes, kv_bytes in stats.ranks:
            self.rank_up.labels(str(rank)).set(1 if alive else 0)
            self.rank_bytes.labels(str(rank), "weights").set(weight_bytes)
            self.rank_bytes.labels(str(rank), "kv_cache").set(kv_bytes)
        seconds = stats.grammar_mask_seconds
        if seconds > self._last_mask_seconds:
            self.grammar_mask_seconds.inc(seconds - self._last_mask_seconds)
            self._last_mask_seconds = seconds
        if not stats.speculating:
            return
        self.kv_usage.labels("draft").set(stats.draft_kv_usage)
        self.spec_k.set(stats.mean_k)
        self._mirror("drafts", self.spec_drafts, stats.num_drafts)
        for method, (drafted, accepted) in stats.by_method.items():
            self._mirror(f"draft_tokens:{method}", self.spec_draft_tokens.labels(method), drafted)
            self._mirror(f"accepted:{method}", self.spec_accepted.labels(method), accepted)
        self.suffix_cache_tokens.set(stats.suffix_cache_tokens)
        self._mirror("tree_verifications", self.spec_tree_verifications,
                     stats.tree_verifications)
        self._mirror("tree_nodes", self.spec_tree_nodes, stats.tree_nodes)
        self._mirror("chain_steps", self.spec_chain_steps, stats.chain_steps_chosen)
        for pos, count in enumerate(stats.accepted_per_pos):
            self._mirror(f"pos{pos}", self.spec_accepted_pos.labels(str(pos)), count)
        for length in stats.recent_lengths:
            self.accepted_length.observe(length)

    def _mirror(self, key: str, counter, total: int) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def _observe_output(self, out, now: float) -> None:
        m, rid, new = out.metrics, out.request_id, len(out.new_token_ids)
        if new:
            self.generation_tokens.inc(new)
            last = self._last_token_time.get(rid)
            if last is None:  # the request's first tokens
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.ttft.observe(max(now - m["arrival_time"], 0.0))
                self.queue_time.observe(max(m["first_scheduled_time"] - m["arrival_time"], 0.0))
                new -= 1  # the first token's latency is the TTFT
            per_token = (now - (last or now)) / max(new, 1)
            for _ in range(new):
                self.itl.observe(per_token)
            self._last_token_time[rid] = now
        if out.finished:
            self._last_token_time.pop(rid, None)
            self.request_success.labels(out.finish_reason or "unknown").inc()
            self.e2e.observe(max(now - m["arrival_time"], 0.0))

    # -- event loop ----------------------------------------------------------------------------
    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
