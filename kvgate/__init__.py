"""kvgate: KV-cache-aware admission control for multi-tenant LLM serving.

This package is the command line and what ships beside the admission service (``ext_proc/``); the
tooling that only runs on a developer's machine or in CI sits in two subpackages, so a reader (and a
packager) sees at a glance which is which:

* product — ``cli`` (the ``kvgate`` command: one subcommand per component), ``envoy_config`` (the Envoy
  bootstrap and filter pieces, rendered into ``envoy/`` and the Helm chart), ``top`` (``kvgate top``, the
  operator's live view of running replicas from their ``/metrics``);
* ``dev/`` — the local stack as real processes and what drives it: ``kvgate up``, ``kvgate demo``, the
  load generator and the stand-in upstream (used by the demo, the benchmarks and the end-to-end tests);
* ``bench/`` — ``kvgate bench``: the request-path overhead and per-part costs, the scale benchmark, the
  transport floor, and the virtual-time scenarios and families.

``cli`` imports ``dev`` and ``bench`` lazily, per subcommand; the one product module that imports
tooling is ``top``, for ``dev.stack.http_get`` (a plain urllib GET).
"""

__version__ = "0.1.0"
