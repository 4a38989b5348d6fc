"""``kvgate bench``: the benchmarks, kept apart from the product they measure.

* ``overhead``  — ``bench overhead`` (plain Envoy vs Envoy + kvgate on the full path, CPU per request)
  and the per-part costs ``bench sim``, ``bench nodes``, ``bench prefix``, ``bench queue``;
* ``scale``     — ``bench scale``: decision time and probe-following CPU against the fleet's size
  (``python -m kvgate.bench.scale --serve-probes`` is its probe-serving child);
* ``bare``      — the transport floor (``python -m kvgate.bench.bare``): the same gRPC stack deciding
  nothing, run by ``bench overhead`` where kvgate would run;
* ``scenarios/`` — ``bench scenarios``, ``bench families``, ``bench trace``, ``bench live``: workloads in
  virtual time through kvgate's own decision core (``ext_proc/core.py``) and the simulated nodes (``sim/``).
"""
