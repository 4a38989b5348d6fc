"""A simulated vLLM node: the v1 scheduler's behaviour, a step-time model, vLLM's API and metrics.

The model/GPU profiles (step-time coefficients, KV capacity, limits, cold start) are the product's
performance priors and live in ``ext_proc.profiles``; the simulator imports them from there.

* ``scheduler`` — a pure mirror of vLLM v1's scheduling step (token budget, chunked prefill,
  paged KV blocks, automatic prefix caching, preemption with recompute, FCFS / priority);
* ``prefix_cache`` — what a request's prompt holds (stand-in token ids) and vLLM's chained block hashes;
* ``engine``    — runs the scheduler against a clock: virtual time (a library, for benchmarks) or
  real time (behind the HTTP server);
* ``metrics``   — vLLM's Prometheus metric families, same names, labels and buckets;
* ``server``    — vLLM's OpenAI-compatible HTTP surface (``kvgate sim``).
"""
