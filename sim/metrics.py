"""vLLM's Prometheus metrics for the simulated node: same names, types, labels and buckets as
vLLM's v1 ``PrometheusStatLogger`` (see ``../shared/reference/vllm-metrics-sample.txt``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import Engine
from .scheduler import Plan, Request, TokenEvent

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class NodeMetrics:
    def __init__(self, engine: Engine, model_name: str, legacy_kv_name: bool = False,
                 gpu_memory_utilization: float = 0.9) -> None:
        self.registry = r = CollectorRegistry()
        names, values = ["model_name", "engine"], [model_name, "0"]
        sched = engine.scheduler

        def gauge(name: str, doc: str, fn: object) -> None:
            Gauge(name, doc, names, registry=r).labels(*values).set_function(fn)  # type: ignore[arg-type]

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lambda: len(sched.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: sched.num_waiting)
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.",
                          [*names, "reason"], registry=r)
        by_reason.labels(*values, "capacity").set_function(lambda: sched.num_waiting)
        by_reason.labels(*values, "deferred").set(0)
        if legacy_kv_name:  # vLLM before 0.10
            gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                  lambda: sched.kv_usage)
        else:
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: sched.kv_usage)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*values)

        if legacy_kv_name:  # the older names (renamed in 0.9.2, hidden from 0.10, removed in 0.12)
            self.prefix_queries = counter("vllm:gpu_prefix_cache_queries",
                                          "GPU prefix cache queries, in terms of number of queried tokens.")
            self.prefix_hits = counter("vllm:gpu_prefix_cache_hits",
                                       "GPU prefix cache hits, in terms of number of cached tokens.")
        else:
            self.prefix_queries = counter("vllm:prefix_cache_queries",
                                          "Prefix cache queries, in terms of number of queried tokens.")
            self.prefix_hits = counter("vllm:prefix_cache_hits",
                                       "Prefix cache hits, in terms of number of cached tokens.")
        self._sched = sched
        self._queried = self._hit = 0
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                   TOKEN_BUCKETS)
        self.request_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                       TOKEN_BUCKETS)
        self.iteration = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                              ITERATION_BUCKETS)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ["block_size", "cache_dtype", "enable_prefix_caching", "engine", "gpu_memory_utilization",
               "num_gpu_blocks"], registry=r).labels(
            str(sched.cfg.block_size), "auto", str(sched.caching), "0", str(gpu_memory_utilization),
            str(sched.cfg.num_gpu_blocks)).set(1)
        self.lora: Gauge | None = None
        if engine.options.max_loras is not None:  # vLLM with --enable-lora; no model_name label, as vLLM's
            self.lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                              ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._max_lora = str(engine.options.max_loras)
        engine.on_step = self.step
        engine.on_tokens = self.tokens

    def step(self, plan: Plan, at: float) -> None:
        self.iteration.observe(plan.tokens)
        sched = self._sched
        if sched.prefix_queries != self._queried:  # counted at admission, published per step as vLLM does
            self.prefix_queries.inc(sched.prefix_queries - self._queried)
            self.prefix_hits.inc(sched.prefix_hits - self._hit)
            self._queried, self._hit = sched.prefix_queries, sched.prefix_hits
        if plan.preempted:
            self.preemptions.inc(len(plan.preempted))
        if self.lora is not None:
            # as vLLM's logger each iteration: the label set of now, valued at the time (the label sets of
            # earlier states stay in the exposition)
            running, waiting = sched.lora_requests()
            self.lora.labels(self._max_lora, ",".join(waiting), ",".join(running)).set(at)

    def tokens(self, events: list[TokenEvent], at: float) -> None:
        self.generation_tokens.inc(len(events))
        for ev in events:
            r = ev.request
            if ev.previous_token_at is None:
                self.prompt_tokens.inc(r.prompt_tokens)
                self.ttft.observe(at - r.arrival)
            else:
                self.itl.observe(at - ev.previous_token_at)
            if ev.finished:
                self.finished(r, r.finish_reason)

    def finished(self, r: Request, reason: str) -> None:
        self.success[reason].inc()
        end = r.finished_at if r.finished_at is not None else r.last_token
        if end is None:
            return
        self.e2e.observe(end - r.arrival)
        self.request_prompt.observe(r.prompt_tokens)
        self.request_generation.observe(r.output_tokens)
        if r.first_scheduled is not None:
            self.queue.observe(r.first_scheduled - r.arrival)
            self.inference.observe(end - r.first_scheduled)
            if r.prefill_done_at is not None:
                self.prefill.observe(r.prefill_done_at - r.first_scheduled)
                self.decode.observe(end - r.prefill_done_at)
        if r.first_token is not None and r.output_tokens > 1:
            self.tpot.observe((end - r.first_token) / (r.output_tokens - 1))
