"""Writes specserve.json, the Grafana dashboard (run: python deploy/grafana/make_dashboard.py).

Every expression is PromQL over the metrics of server/metrics.py; the tests run each one against
a real Prometheus scraping a real server.
"""

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "specserve-prometheus"}
I = '{instance=~"$instance"}'
ERRORS = 'status=~"[45].."'


def sel(extra: str = "") -> str:
    return '{instance=~"$instance"' + (", " + extra if extra else "") + "}"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate(specserve:{metric}_bucket{I}[5m])))",
             f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)]


PANELS = [
    ("Generation tokens/s", "short", [
        (f"sum(rate(specserve:generation_tokens_total{I}[1m]))", "generated"),
        (f"sum(rate(specserve:prompt_tokens_total{I}[1m]))", "prompt")]),
    ("Acceptance rate", "percentunit", [
        (f"sum(rate(specserve:spec_decode_num_accepted_tokens_total{I}[5m])) / "
         f"sum(rate(specserve:spec_decode_num_draft_tokens_total{I}[5m]))", "accepted / drafted")]),
    ("Acceptance rate by method", "percentunit", [
        (f"sum by (method) (rate(specserve:spec_decode_num_accepted_tokens_total{I}[5m])) / "
         f"sum by (method) (rate(specserve:spec_decode_num_draft_tokens_total{I}[5m]))",
         "{{method}}")]),
    ("Draft tokens/s by method", "short", [
        (f"sum by (method) (rate(specserve:spec_decode_num_draft_tokens_total{I}[1m]))",
         "{{method}}")]),
    ("Suffix cache size", "short", [
        (f"max(specserve:spec_decode_suffix_cache_tokens{I})", "tokens")]),
    ("Mean accepted length (tokens per verification)", "short", [
        (f"sum(rate(specserve:spec_decode_accepted_length_sum{I}[5m])) / "
         f"sum(rate(specserve:spec_decode_accepted_length_count{I}[5m]))", "tokens")]),
    ("Acceptance by draft position", "percentunit", [
        (f"sum by (position) (rate(specserve:spec_decode_num_accepted_tokens_per_pos_total{I}"
         f"[5m])) / scalar(sum(rate(specserve:spec_decode_num_drafts_total{I}[5m])))",
         "position {{position}}")]),
    ("k chosen (mean)", "short", [(f"avg(specserve:spec_decode_k{I})", "k")]),
    ("Token-tree size (nodes per tree verified); steps drafting chains instead, per second",
     "short", [
        (f"sum(rate(specserve:spec_decode_num_tree_nodes_total{I}[5m])) / "
         f"sum(rate(specserve:spec_decode_num_tree_verifications_total{I}[5m]))", "nodes"),
        (f"sum(rate(specserve:spec_decode_num_chain_steps_chosen_total{I}[5m]))",
         "chain steps/s")]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
    ("End-to-end latency", "s", quantiles("e2e_request_latency_seconds")),
    ("Queue time", "s", quantiles("request_queue_time_seconds")),
    ("Requests running / waiting", "short", [
        (f"sum(specserve:num_requests_running{I})", "running"),
        (f"sum(specserve:num_requests_waiting{I})", "waiting")]),
    ("KV cache usage", "percentunit", [
        (f"max by (model) (specserve:kv_cache_usage_perc{I})", "{{model}}")]),
    ("Preemptions/s", "short", [(f"sum(rate(specserve:num_preemptions_total{I}[5m]))",
                                 "preemptions")]),
    ("Prefix-cache hit rate", "percentunit", [
        (f"sum(rate(specserve:prefix_cache_hits_total{I}[5m])) / "
         f"sum(rate(specserve:prefix_cache_queries_total{I}[5m]))", "hits / queried tokens")]),
    ("HTTP error rate", "percentunit", [
        ("(sum(rate(specserve:http_requests_total" + sel(ERRORS) + "[5m])) or vector(0))"
         f" / sum(rate(specserve:http_requests_total{I}[5m]))", "4xx + 5xx share")]),
    ("Finished requests/s by reason", "reqps", [
        (f"sum by (finish_reason) (rate(specserve:request_success_total{I}[1m]))",
         "{{finish_reason}}")]),
]


def panel(pid: int, title: str, unit: str, targets) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DS,
        "gridPos": {"h": 8, "w": 8, "x": ((pid - 1) % 3) * 8, "y": ((pid - 1) // 3) * 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                     "legendFormat": legend} for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "uid": "specserve", "title": "specserve", "schemaVersion": 39, "version": 1,
        "editable": True, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "tags": ["specserve", "llm"],
        "templating": {"list": [{
            "name": "instance", "label": "instance", "type": "query", "datasource": DS,
            "query": {"query": "label_values(specserve:num_requests_running, instance)",
                      "refId": "instances"},
            "definition": "label_values(specserve:num_requests_running, instance)",
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}]},
        "panels": [panel(i + 1, *p) for i, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("specserve.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
