"""The probe: a sidecar on each vLLM node that turns vLLM's /metrics and NVML into a compact snapshot.

* ``parse``    — vLLM's Prometheus exposition → per-engine readings (new and pre-0.10 names);
* ``snapshot`` — readings over time → a snapshot with recent latencies from histogram deltas;
* ``nvml``     — GPU memory and utilisation, or nulls where there is no driver or GPU;
* ``server``   — ``kvgate probe``: polls vLLM, serves ``GET /snapshot`` and streams its changes
  (``GET /snapshot/stream``).
"""
