"""Developer tooling: the local stack as real processes, and the traffic that drives it.

Not part of the admission service; the demo, the benchmarks and the end-to-end tests all start the
same binaries and configs a user would, through ``stack``:

* ``stack``    — starts/stops stand-in upstreams or simulated vLLM nodes, kvgate (one or more replicas,
  optionally with Redis) and Envoy; ports, waits, logs;
* ``demo``     — ``kvgate up`` (the stack in the foreground) and ``kvgate demo`` (shadow vs enforce);
* ``loadgen``  — an open-loop multi-tenant load generator recording every request;
* ``upstream`` — a small OpenAI-compatible stand-in upstream (``kvgate upstream``).
"""
