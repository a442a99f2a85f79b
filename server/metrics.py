"""Prometheus metrics (one registry per server): llama.cpp-compatible names, so existing scrapers and
dashboards read this server unchanged, plus `ninfer_*` series.

Engine-side counters (tokens prefilled and predicted, their seconds, decode steps) are read from the
scheduler's counters at scrape time; request outcomes and latencies are recorded as requests end.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.s = scheduler

    def collect(self):
        st, snap = self.s.stats, self.s.snapshot()
        c = CounterMetricFamily
        g = GaugeMetricFamily
        yield c("llamacpp:prompt_tokens", "Number of prompt tokens processed.", value=st["prompt_tokens"])
        yield c("llamacpp:prompt_seconds", "Prompt process time.", value=st["prompt_seconds"])
        yield c("llamacpp:tokens_predicted", "Number of generation tokens processed.", value=st["predicted_tokens"])
        yield c("llamacpp:tokens_predicted_seconds", "Predict process time.", value=st["predicted_seconds"])
        yield c("llamacpp:n_decode", "Number of decode steps run.", value=st["decode_steps"])
        yield g("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                value=st["prompt_tokens"] / st["prompt_seconds"] if st["prompt_seconds"] else 0.0)
        yield g("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                value=st["predicted_tokens"] / st["predicted_seconds"] if st["predicted_seconds"] else 0.0)
        yield g("llamacpp:requests_processing", "Number of requests processing.", value=self.s.active)
        yield g("llamacpp:requests_deferred", "Number of requests deferred.", value=self.s.pending)
        yield g("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                value=snap["kv_pages_used"] / max(snap["kv_pages_total"], 1))
        yield g("llamacpp:kv_cache_tokens", "KV-cache tokens (pages in use times the page size).",
                value=snap["kv_pages_used"] * self.s.page_size)
        yield c("ninfer_prefill_chunks", "Prefill chunks run.", value=st["prefill_chunks"])
        yield c("ninfer_prefix_cache_queries", "Prompt tokens of admitted requests (as vLLM's prefix_cache_queries).",
                value=st["prefix_cache_queries"])
        yield c("ninfer_prefix_cache_hits", "Prompt tokens taken from the prefix cache (as vLLM's prefix_cache_hits).",
                value=st["prefix_cache_hits"])
        yield c("ninfer_decode_steps", "Batched decode steps run.", value=st["decode_steps"])
        yield c("ninfer_cancelled_requests", "Requests cancelled (client disconnect or cancel).",
                value=st["cancelled"])
        yield g("ninfer_lanes_busy", "Sequence lanes holding a request.", value=snap["lanes_busy"])
        yield g("ninfer_lanes_total", "Sequence lanes (--max-concurrency).", value=snap["max_seqs"])
        yield g("ninfer_kv_pages_used", "KV pages held by requests.", value=snap["kv_pages_used"])
        yield g("ninfer_kv_pages_total", "KV pages in the pool.", value=snap["kv_pages_total"])
        yield g("ninfer_lanes_retained", "Lanes kept for prefix caching (given back when wanted).",
                value=snap["lanes_retained"])
        yield g("ninfer_kv_pages_retained", "KV pages kept by retained lanes and prefix snapshots (given back when "
                "wanted).", value=snap["kv_pages_retained"])
        yield g("ninfer_prefix_snapshots", "System-turn prefix snapshots kept.", value=snap["prefix_snapshots"])
        yield g("ninfer_cache_ram_lanes", "Retained lanes kept in host memory (--cache-ram).",
                value=snap["cache_ram_lanes"])
        yield g("ninfer_cache_ram_bytes", "Host memory those lanes take.", value=snap["cache_ram_bytes"])
        yield g("ninfer_pending_requests", "Requests waiting for a lane.", value=self.s.pending)
        spec = getattr(self.s.engine, "spec", None)
        if spec is not None:   # speculative decoding, as vLLM's spec_decode_* counters
            yield c("ninfer_spec_decode_num_drafts", "Speculative rounds that verified drafts.",
                    value=spec.stats["num_drafts"])
            yield c("ninfer_spec_decode_num_draft_tokens", "Draft tokens verified.", value=spec.stats["num_draft_tokens"])
            yield c("ninfer_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                    value=spec.stats["num_accepted_tokens"])
            per_pos = c("ninfer_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                        labels=["position"])
            for i, n in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([str(i)], n)
            yield per_pos
        info = g("ninfer_cache_config_info", "The KV cache's configuration (as vLLM's cache_config_info): value 1.",
                 labels=["kv_cache_dtype", "page_size", "num_pages"])
        info.add_metric([self.s.engine.kv_cache_dtype, str(self.s.page_size), str(snap["kv_pages_total"])], 1)
        yield info


class Metrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        r = self.registry
        self.requests = Counter("ninfer_requests", "Finished HTTP generation requests by protocol and outcome.",
                                ["protocol", "outcome"], registry=r)
        self.errors = Counter("ninfer_http_errors", "Error responses by status code.", ["status"], registry=r)
        self.rejects = Counter("ninfer_rejected_requests", "Requests refused by admission.", ["reason"], registry=r)
        self.prompt = Counter("ninfer_prompt_tokens", "Prompt tokens of finished requests.", ["protocol"], registry=r)
        self.completion = Counter("ninfer_completion_tokens", "Completion tokens of finished requests.",
                                  ["protocol"], registry=r)
        self.ttft = Histogram("ninfer_ttft_seconds", "Time to first token (queue included).",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("ninfer_queue_seconds", "Time waiting for a lane.", buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("ninfer_request_seconds", "Request time from submit to the last token.",
                                  buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, protocol: str, done, outcome: str = "ok") -> None:
        self.requests.labels(protocol, outcome).inc()
        self.prompt.labels(protocol).inc(done.prompt_tokens)
        self.completion.labels(protocol).inc(done.completion_tokens)
        if done.ttft_s:
            self.ttft.observe(done.ttft_s)
        self.queue.observe(done.queue_s)
        self.duration.observe(done.total_s)

    def outcome(self, protocol: str, outcome: str) -> None:
        self.requests.labels(protocol, outcome).inc()

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def rejected(self, reason: str) -> None:
        self.rejects.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
