"""Engine metrics: counters, gauges, latency histograms, and the Prometheus text exposition (docs/inference.md).

`EngineMetrics` lives inside the engine; `Engine.metrics()` returns a plain snapshot dict (numbers, and
`{"buckets": [(le, cumulative count)], "sum", "count"}` for histograms) that is safe to hand to another
thread; `render_prometheus(snapshot)` turns it into the text format served on `/metrics`. Every name
gets the `k3_` prefix; METRICS below is the one list of what is exported and what it means.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

# name -> (Prometheus type, help)
METRICS: dict[str, tuple[str, str]] = {
    "requests_running": ("gauge", "Requests in the running batch"),
    "requests_waiting": ("gauge", "Requests waiting for admission to the running batch (incl. preempted)"),
    "kv_pages_total": ("gauge", "Pages in the device KV arena"),
    "kv_pages_used": ("gauge", "Pages held by running requests"),
    "kv_pages_cached": ("gauge", "Pages held only by the prefix cache (evictable)"),
    "kv_pages_free": ("gauge", "Pages on the free list"),
    "kv_utilization": ("gauge", "Fraction of device pages held by running requests (not reclaimable)"),
    "kda_slots_used": ("gauge", "Private KDA states in use (one per running request)"),
    "kda_slots_total": ("gauge", "Private KDA states available (max running requests)"),
    "prefix_queries_total": ("counter", "Prompt tokens looked up in the prefix cache"),
    "prefix_hits_total": ("counter", "Prompt tokens served by the prefix cache (device and CPU pool)"),
    "prefix_query_requests_total": ("counter", "Requests looked up in the prefix cache"),
    "prefix_hit_requests_total": ("counter", "Requests with a prefix-cache hit"),
    "prefix_evictions_total": ("counter", "Prefix blocks evicted from the device pool"),
    "cpu_pool_hits_total": ("counter", "Bundles loaded back from the CPU pool"),
    "cpu_pool_hit_tokens_total": ("counter", "Prompt tokens of hits that needed the CPU pool"),
    "cpu_pool_bytes_out_total": ("counter", "Bytes written back (offloaded) to the CPU pool"),
    "cpu_pool_bytes_in_total": ("counter", "Bytes loaded from the CPU pool"),
    "cpu_pool_slots_used": ("gauge", "CPU pool slots in use"),
    "cpu_pool_slots_total": ("gauge", "CPU pool slots"),
    "media_items_encoded_total": ("counter", "Images run through the vision tower (a cache miss each)"),
    "media_cache_hits_total": ("counter", "Images whose projector rows came from the media cache"),
    "media_cache_bytes": ("gauge", "Bytes of image rows held by the media cache"),
    "transfers_total": ("counter", "Requests prefilled by the peer instance and decoded here (--role decode)"),
    "transfer_fallbacks_total": ("counter", "Requests prefilled here because the transfer from the peer failed"),
    "preemptions_total": ("counter", "Requests preempted (freed and queued for recompute)"),
    "admission_rejections_total": ("counter", "Requests refused by admission budgets (429/503)"),
    "requests_finished_total": ("counter", "Requests finished (stop, length or abort)"),
    "prompt_tokens_total": ("counter", "Prompt tokens of finished and running requests"),
    "generation_tokens_total": ("counter", "Tokens generated"),
    "forward_tokens_total": ("counter", "Tokens run through the model (prefill, recompute and decode)"),
    "steps_total": ("counter", "Engine steps with a forward"),
    "spec_verifies_total": ("counter", "Speculative verifications (one sequence's drafts checked by one target pass)"),
    "spec_draft_tokens_total": ("counter", "Tokens drafted and verified"),
    "spec_accepted_tokens_total": ("counter", "Drafted tokens the target accepted"),
    "spec_emitted_tokens_total": ("counter", "Tokens emitted by verifications (accepted plus corrected or bonus)"),
    "spec_acceptance_rate": ("gauge", "Accepted / drafted tokens since start (speculative decoding)"),
    "spec_tokens_per_verify": ("gauge", "Emitted tokens per verification since start (speculative decoding)"),
    "tokens_per_second": ("gauge", "Generated tokens per second over the last 10 s"),
    "forward_tokens_per_second": ("gauge", "Model tokens per second over the last 10 s"),
    "time_to_first_token_seconds": ("histogram", "Time from arrival to the first generated token"),
    "inter_token_latency_seconds": ("histogram", "Time between consecutive generated tokens of a request"),
    "queue_time_seconds": ("histogram", "Time from arrival to first admission"),
    "e2e_request_latency_seconds": ("histogram", "Time from arrival to finish"),
}

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def snapshot(self) -> dict:
        cum, out = 0, []
        for le, c in zip(self.bounds + [float("inf")], self.counts):
            cum += c
            out.append((le, cum))
        return {"buckets": out, "sum": self.sum, "count": self.count}


class EngineMetrics:
    """Counters the engine bumps; gauges are filled in by `Engine.metrics()`."""

    WINDOW = 10.0  # seconds of the tokens/s rates

    def __init__(self):
        self.counters = {name: 0 for name, (kind, _) in METRICS.items() if kind == "counter"}
        self.histograms = {name: Histogram() for name, (kind, _) in METRICS.items() if kind == "histogram"}
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, generated, forward tokens)

    def inc(self, name: str, n: int | float = 1) -> None:
        self.counters[name] += n

    def observe(self, name: str, x: float) -> None:
        self.histograms[name].observe(x)

    def record_step(self, generated: int, forward: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._recent.append((now, generated, forward))
        while self._recent and self._recent[0][0] < now - self.WINDOW:
            self._recent.popleft()

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(generated tokens/s, forward tokens/s) over the window."""
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - self.WINDOW:
            self._recent.popleft()
        if not self._recent:
            return 0.0, 0.0
        span = max(now - self._recent[0][0], 1e-3)
        return sum(g for _, g, _ in self._recent) / span, sum(f for _, _, f in self._recent) / span

    def snapshot(self) -> dict:
        out: dict = dict(self.counters)
        out.update({name: h.snapshot() for name, h in self.histograms.items()})
        out["tokens_per_second"], out["forward_tokens_per_second"] = self.rates()
        return out


def _fmt(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


def render_prometheus(metrics: dict, prefix: str = "k3_") -> str:
    """A metrics snapshot -> Prometheus text exposition format 0.0.4 (one HELP/TYPE block per metric)."""
    lines = []
    for name, (kind, help_text) in METRICS.items():
        if name not in metrics:
            continue
        value = metrics[name]
        full = prefix + name
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        if kind == "histogram":
            for le, c in value["buckets"]:
                lines.append(f'{full}_bucket{{le="{_fmt(le)}"}} {c}')
            lines.append(f"{full}_sum {_fmt(value['sum'])}")
            lines.append(f"{full}_count {value['count']}")
        else:
            lines.append(f"{full} {_fmt(value)}")
    return "\n".join(lines) + "\n"
