"""Prometheus metrics, in a registry of the app's own (no global state). Names follow vLLM's
where they mean the same thing, so existing dashboards and routers work; loraplex's own are
prefixed `loraplex:`. Labels: `model_name` (the base model) and, for per-tenant counters,
`tenant` (bounded by the number of tenants; adapters are never labels: see the usage API).

The Gateway API Inference Extension's endpoint picker (its model-server protocol, proposal 003)
reads `vllm:num_requests_waiting`, `vllm:num_requests_running`, the KV cache use
(`vllm:gpu_cache_usage_perc`, and `vllm:kv_cache_usage_perc` as newer vLLM names it) and the
gauge `vllm:lora_requests_info`, whose value is the time it was sampled and whose labels are
`max_lora` (the adapters resident on the device now: without fixed slots, the number that
memory holds moves with the KV cache's demand), `running_lora_adapters` (adapters in device slots, ready to
serve) and `waiting_lora_adapters` (adapters that waiting requests ask for and that are not in a
slot), each a comma-separated list of the adapter names requests use (`model`). The names of
these metrics are in `EPP_METRICS`, which deploy/ and its test are checked against."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from loraplex.engine.async_engine import ENGINE_THREAD_NAME
from loraplex.engine.stats import EngineStats
from loraplex.engine.stats import Histogram as CountHistogram
from loraplex.server.monitor import EngineMonitor

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
QUEUE_METRIC = "vllm:num_requests_waiting"
RUNNING_METRIC = "vllm:num_requests_running"
KV_CACHE_METRIC = "vllm:gpu_cache_usage_perc"
KV_CACHE_METRIC_V1 = "vllm:kv_cache_usage_perc"
LORA_INFO_METRIC = "vllm:lora_requests_info"
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
EPP_METRICS = {QUEUE_METRIC: "gauge", RUNNING_METRIC: "gauge", KV_CACHE_METRIC: "gauge",
               KV_CACHE_METRIC_V1: "gauge", LORA_INFO_METRIC: "gauge"}
"""The metrics the endpoint picker reads, with their Prometheus types."""
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class Metrics:
    def __init__(self, model_name: str, monitor: EngineMonitor, in_flight: Callable[[], int],
                 adapter_names: Callable[[str], Iterable[str]] = lambda digest: (digest,),
                 engine_pid: int | None = None) -> None:
        """`adapter_names`: the names requests give an adapter digest (for the LoRA gauge);
        `engine_pid`: the engine-core process, where the engine runs in one of its own."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between generated tokens of a request.",
            labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the end of a request.",
            labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", labels,
            buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", labels,
            buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "max_tokens per request.", labels,
            buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.rejected = Counter("loraplex:requests_rejected", "Requests refused before the engine, "
                                "by reason (rate_limit, overloaded).", [*labels, "reason"], registry=r)
        self.aborted = Counter("loraplex:requests_aborted", "Requests whose client left before "
                               "the end (engine work stopped).", labels, registry=r).labels(model_name)
        self.tenant_requests = Counter("loraplex:tenant_requests", "Finished requests per tenant.",
                                       [*labels, "tenant"], registry=r)
        self.tenant_tokens = Counter("loraplex:tenant_tokens", "Prompt plus generated tokens per "
                                     "tenant.", [*labels, "tenant"], registry=r)
        self.lora_requests = Counter("loraplex:lora_requests", "Engine requests that named an adapter "
                                     "(slot hits over a run: these less the slot loads).", labels,
                                     registry=r).labels(model_name)
        r.register(_EngineCollector(model_name, monitor, in_flight, adapter_names))
        ProcessCollector(registry=r)  # process_cpu_seconds_total: server CPU time per token
        r.register(_ThreadCpuCollector(threading.get_ident(), engine_pid))

    def finished(self, tenant: str, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        name = self.model_name
        self.prompt_tokens.inc(prompt_tokens)
        self.request_success.labels(name, reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)
        self.tenant_requests.labels(name, tenant).inc()
        self.tenant_tokens.labels(name, tenant).inc(prompt_tokens + completion_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Gauges read from the monitor's latest engine snapshot at scrape time."""

    def __init__(self, model_name: str, monitor: EngineMonitor, in_flight: Callable[[], int],
                 adapter_names: Callable[[str], Iterable[str]]) -> None:
        self._model_name = model_name
        self._monitor = monitor
        self._in_flight = in_flight
        self._adapter_names = adapter_names

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        labels = [self._model_name]
        in_flight = GaugeMetricFamily("loraplex:requests_in_flight", "Requests admitted and not "
                                      "finished (the server's queue).", labels=["model_name"])
        in_flight.add_metric(labels, self._in_flight())
        yield in_flight
        snapshot = self._monitor.latest
        if snapshot is None:
            return
        stats = snapshot.stats
        gauges = {
            RUNNING_METRIC: ("Requests in the running batch.", stats.num_running),
            QUEUE_METRIC: ("Requests waiting for the engine.", stats.num_waiting),
            KV_CACHE_METRIC: ("KV cache use, 0 to 1 (vLLM v0's name).", stats.kv_cache_usage),
            KV_CACHE_METRIC_V1: ("KV cache use, 0 to 1.", stats.kv_cache_usage),
            "loraplex:kv_blocks_used": ("KV blocks in use.", stats.num_kv_blocks_used),
            "loraplex:kv_blocks_total": ("KV blocks allocated.", stats.num_kv_blocks),
            "loraplex:lora_adapters_resident": ("Adapters in device slots.", len(stats.adapters_in_slots)),
            "loraplex:lora_adapter_slots": ("Adapter slots the device pool has room for (the most "
                                            "adapters resident at once).", stats.num_lora_slots),
            "loraplex:pool_page_bytes": ("Bytes of a page of the device pool (a KV block).",
                                         stats.pool_page_bytes),
            "loraplex:lora_adapters_host": ("Adapters in the engine's host tier.",
                                            len(stats.adapters_on_host)),
            "loraplex:lora_host_tier_bytes": ("Bytes of the adapters in the host tier.",
                                              stats.host_tier_bytes),
            "loraplex:generation_tokens_per_second": ("Generated tokens per second, last interval.",
                                                      snapshot.tokens_per_second),
            "loraplex:kv_blocks_shared": ("KV blocks held by more than one request or pin (a shared "
                                          "prefix, counted once).", stats.num_shared_kv_blocks),
        }
        for name, (documentation, value) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        yield self._lora_info(snapshot.stats, snapshot.sampled_wall)
        counters = {
            "vllm:num_preemptions": ("Requests preempted by the scheduler.", stats.num_preemptions),
            "loraplex:lora_host_loads": ("Adapters read into the host tier.", stats.num_adapter_host_loads),
            "loraplex:lora_slot_loads": ("Adapters copied into device slots.", stats.num_adapter_slot_loads),
            "loraplex:lora_evictions": ("Adapters evicted from the device (for KV, for another "
                                        "adapter, or removed).", stats.num_adapter_evictions),
            "loraplex:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                              stats.prefix_queried_tokens),
            "loraplex:prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                                           stats.prefix_hit_tokens),
            "loraplex:prefix_cache_evicted_blocks": ("Cached KV blocks evicted (handed out again).",
                                                     stats.prefix_evicted_blocks),
            # vLLM v1's names for the same two counters (its hit rate is hits over queries).
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                          stats.prefix_queried_tokens),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens),
            "loraplex:relay_steps": ("Decode steps that read shared prefixes once per relay group.",
                                     stats.num_relay_steps),
            "loraplex:relay_groups": ("Relay groups, summed over relay steps.", stats.num_relay_groups),
            "loraplex:relay_members": ("Requests in relay groups, summed over relay steps.",
                                       stats.num_relay_members),
        }
        for name, (documentation, value) in counters.items():
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        yield from _per_tenant(labels, stats)
        yield from _swapping(labels, stats)
        yield from _pool(labels, stats)
        yield from _disaggregated(labels, stats)

    def _lora_info(self, stats: EngineStats, sampled_at: float) -> GaugeMetricFamily:
        """vLLM's `vllm:lora_requests_info`: the value is when it was sampled (the endpoint
        picker takes the latest sample); the labels carry the adapters."""
        resident = set(stats.adapters_in_slots)
        waiting = [d for d in stats.waiting_by_adapter if d not in resident]
        family = GaugeMetricFamily(LORA_INFO_METRIC, "Adapters in device slots and adapters that "
                                   "waiting requests ask for (as labels); the value is a timestamp.",
                                   labels=list(LORA_INFO_LABELS))
        family.add_metric([self._names(stats.adapters_in_slots), self._names(waiting),
                           str(stats.num_lora_resident)], sampled_at)
        return family

    def _names(self, digests: Iterable[str]) -> str:
        return ",".join(sorted({name for d in digests for name in self._adapter_names(d)}))


THREAD_CPU_METRIC = "loraplex:thread_cpu_seconds"


class _ThreadCpuCollector(Collector):
    """The process's CPU time split by thread (`thread`: engine, event_loop, other), so that a
    benchmark can say how much of the server's CPU per generated token the event loop spends
    beside the engine. `other` (tokenizer and worker threads, and threads that have ended) is
    the process's time less the two. With the engine in a process of its own (`engine_pid`),
    `engine` is that process's CPU time (all its threads) and `other` the server process's time
    less its event loop's."""

    def __init__(self, event_loop_thread: int, engine_pid: int | None = None) -> None:
        self._event_loop_thread = event_loop_thread
        self._engine_pid = engine_pid
        self._engine_process_s = 0.0  # the last reading (a counter must not drop when it exits)

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        family = CounterMetricFamily(THREAD_CPU_METRIC, "CPU time of the server's threads.",
                                     labels=["thread"])
        event_loop = _thread_cpu_s(self._event_loop_thread)
        if self._engine_pid is None:
            engine = sum(_thread_cpu_s(t.ident) for t in threading.enumerate()
                         if t.name == ENGINE_THREAD_NAME and t.ident is not None)
            other = time.process_time() - engine - event_loop
        else:
            self._engine_process_s = max(self._engine_process_s, _process_cpu_s(self._engine_pid))
            engine, other = self._engine_process_s, time.process_time() - event_loop
        family.add_metric(["engine"], engine)
        family.add_metric(["event_loop"], event_loop)
        family.add_metric(["other"], max(0.0, other))
        yield family


def _thread_cpu_s(ident: int) -> float:
    """A live thread's CPU seconds (0 where the platform cannot tell or the thread has ended)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return 0.0


def _process_cpu_s(pid: int) -> float:
    """A live process's CPU seconds, user and system (Linux; 0 elsewhere or once it has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _per_tenant(labels: list[str], stats: EngineStats) -> Iterator:
    tenants = sorted(set(stats.running_by_tenant) | set(stats.waiting_by_tenant) | set(stats.tenant_service))
    gauges = {
        "loraplex:tenant_requests_running": ("Requests of the tenant in the running batch.",
                                             stats.running_by_tenant),
        "loraplex:tenant_requests_waiting": ("Requests of the tenant waiting, the swapped ones "
                                             "included.", stats.waiting_by_tenant),
        "loraplex:tenant_requests_swapped": ("Waiting requests of the tenant whose KV is in the "
                                             "host pool.", stats.swapped_by_tenant),
        "loraplex:tenant_service": ("The tenant's virtual token counter: prompt tokens + 2 x "
                                    "generated tokens, over its weight.", stats.tenant_service),
    }
    for name, (documentation, values) in gauges.items():
        family = GaugeMetricFamily(name, documentation, labels=["model_name", "tenant"])
        for tenant in tenants:
            family.add_metric([*labels, tenant], values.get(tenant, 0))
        yield family


def _pool(labels: list[str], stats: EngineStats) -> Iterator:
    """The device pool's pages by kind, and the adapter-wait histogram."""
    pages = GaugeMetricFamily("loraplex:pool_pages", "Pages of the device pool by kind: kv (held by "
                              "requests and pinned prompts), adapters (lent to adapter slots), free "
                              "(cached KV nobody holds among them).", labels=["model_name", "kind"])
    for kind, count in (stats.pool_pages or {}).items():
        pages.add_metric([*labels, kind], count)
    yield pages
    if stats.adapter_wait is not None:
        yield _histogram("loraplex:lora_adapter_wait_seconds", "Each ended request's time in the queue "
                         "waiting for its adapter (host load, slot copy or a slot); requests with an "
                         "adapter.", labels, stats.adapter_wait)


def _disaggregated(labels: list[str], stats: EngineStats) -> Iterator:
    """Disaggregated serving only: each side's queue and KV blocks (`side` prefill or decode; the
    vllm: gauges above are both sides' together), and the KV sent between them."""
    if stats.sides is not None:
        for name, documentation, value in (
                ("loraplex:side_requests_running", "Requests running on the side.", lambda s: s.num_running),
                ("loraplex:side_requests_waiting", "Requests waiting for the side (on the decode side, "
                 "the prefilled ones its KV has not reached).", lambda s: s.num_waiting),
                ("loraplex:side_kv_blocks_used", "KV blocks in use on the side.",
                 lambda s: s.num_kv_blocks_used),
                ("loraplex:side_kv_blocks_total", "KV blocks the side's pool holds.",
                 lambda s: s.num_kv_blocks)):
            family = GaugeMetricFamily(name, documentation, labels=["model_name", "side"])
            for side, figures in stats.sides.items():
                family.add_metric([*labels, side], value(figures))
            yield family
    transfers = stats.kv_transfers
    if transfers is None:
        return
    for name, documentation, total in (
            ("loraplex:kv_transfer_bytes", "KV bytes sent from the prefill side to the decode side.",
             transfers.num_bytes),
            ("loraplex:kv_transfer_blocks", "KV blocks sent from the prefill side to the decode side.",
             transfers.num_blocks)):
        family = CounterMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric(labels, total)
        yield family
    yield _histogram("loraplex:kv_transfer_seconds", "Each KV transfer's time, from its first copy "
                     "queued to its last byte (a request's prompt blocks, or a pinned prompt's).",
                     labels, transfers.durations)


def _histogram(name: str, documentation: str, labels: list[str],
               histogram: CountHistogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, histogram.bounds), "+Inf"], histogram.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, histogram.total)
    return family


def _swapping(labels: list[str], stats: EngineStats) -> Iterator:
    preemptions = CounterMetricFamily("loraplex:preemptions", "Preemptions by cause (kv, fairness, "
                                      "asked) and mode (swap, recompute).",
                                      labels=["model_name", "cause", "mode"])
    for kind, count in sorted(stats.preemptions.items()):
        preemptions.add_metric([*labels, *kind.split(":")], count)
    yield preemptions
    for name, documentation, out, back in (
            ("loraplex:kv_swap_bytes", "KV bytes copied to (out) and from (in) the host pool.",
             stats.swap_bytes_out, stats.swap_bytes_in),
            ("loraplex:kv_swap_seconds", "Time the KV swap copies took.",
             stats.swap_seconds_out, stats.swap_seconds_in)):
        family = CounterMetricFamily(name, documentation, labels=["model_name", "direction"])
        family.add_metric([*labels, "out"], out)
        family.add_metric([*labels, "in"], back)
        yield family
    stalled = CounterMetricFamily("loraplex:kv_swap_stall_seconds", "Time steps waited for KV swap "
                                  "copies (the device idle time swapping caused).", labels=["model_name"])
    stalled.add_metric(labels, stats.swap_seconds_stalled)
    yield stalled
    for name, documentation, value in (
            ("loraplex:kv_host_pool_blocks_used", "Host pool blocks holding swapped KV.",
             stats.num_host_pool_blocks_used),
            ("loraplex:kv_host_pool_blocks", "Host pool blocks (swap_space).", stats.num_host_pool_blocks)):
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric(labels, value)
        yield family
