"""The ``kvgate`` command: one entry point, a subcommand per component."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _emit(a: argparse.Namespace, result: object) -> int:
    """A benchmark's result as JSON on stdout with ``--json`` (it printed its table itself otherwise)."""
    if a.json:
        print(json.dumps(result, indent=2))
    return 0


def _extproc(a: argparse.Namespace) -> int:
    from ext_proc.server import run

    overrides = {k: v for k, v in (("grpc_address", a.grpc_address), ("metrics_address", a.metrics_address)) if v}
    return run(a.config, a.log_level, overrides)


def _check_config(a: argparse.Namespace) -> int:
    from ext_proc.config import load_config

    cfg = load_config(a.config)
    print(f"{a.config}: ok ({len(cfg.tenants)} tenants, mode {cfg.mode})")
    return 0


def _hash_key(a: argparse.Namespace) -> int:
    from ext_proc.identity import hash_key

    key = sys.stdin.readline().strip() if a.key == "-" else a.key
    print(hash_key(key))
    return 0


def _envoy_config(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from ext_proc.addresses import split_hostport

    from .envoy_config import EnvoyParams, bootstrap, dump, params_for, shipped

    def _route(spec: str) -> tuple[str, str]:
        method, _, path = spec.partition(":") if not spec.startswith("/") else ("", "", spec)
        method = (method or "POST").upper()
        if method not in ("POST", "GET") or not path.startswith("/"):
            raise SystemExit(f"--route {spec!r}: want [POST:|GET:]/path")
        return method, path

    if a.write or a.check:
        stale = []
        for path, text in shipped().items():
            if a.write:
                path.write_text(text)
                print(f"wrote {path}")
            elif not path.exists() or path.read_text() != text:
                stale.append(str(path))
        if stale:
            print("out of date (run: kvgate envoy-config --write): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    ups = [split_hostport(u, default_host="") for u in a.upstream] or [("127.0.0.1", 8000)]
    params = EnvoyParams(
        listen_address=a.listen_address, listen_port=a.listen_port, admin_port=a.admin_port,
        extproc_host=a.extproc_host.strip("[]"), extproc_port=a.extproc_port, upstreams=ups, fail_open=a.fail_open,
        trusted_header=a.trusted_header, original_dst=a.original_dst,
        access_log_buffer_bytes=getattr(a, "access_log_batch", 0),
    )
    if a.config:
        from ext_proc.config import load_config

        params = params_for(load_config(a.config), params)
    if a.route:
        post = tuple(r for m, r in (_route(x) for x in a.route) if m == "POST")
        get = tuple(r for m, r in (_route(x) for x in a.route) if m == "GET")
        params = replace(params, inference_paths=post, bodyless_paths=get, bodyless_prefixes=())
    sys.stdout.write(dump(bootstrap(params)))
    return 0


def _upstream(a: argparse.Namespace) -> int:
    from .dev.upstream import run

    run(a.host, a.port, a.token_ms)
    return 0


def _sim(a: argparse.Namespace) -> int:
    from ext_proc.profiles import get_profile
    from sim.engine import EngineOptions
    from sim.server import SimOptions, run

    try:
        profile = get_profile(a.profile)
    except ValueError as e:
        print(f"kvgate sim: --profile: {e}", file=sys.stderr)
        return 2
    engine = EngineOptions(policy=a.scheduling_policy, max_num_queued_reqs=a.max_num_queued_reqs, noise=a.noise,
                           seed=a.seed, num_gpu_blocks=a.num_gpu_blocks, max_num_seqs=a.max_num_seqs,
                           max_num_batched_tokens=a.max_num_batched_tokens,
                           prefix_caching=a.enable_prefix_caching,
                           max_loras=a.max_loras if a.lora_modules else None, max_cpu_loras=a.max_cpu_loras,
                           long_prefill_token_threshold=a.long_prefill_token_threshold)
    opts = SimOptions(served_model_name=a.served_model_name, mean_output_tokens=a.mean_output_tokens,
                      legacy_kv_metric=a.legacy_kv_metric, load_seconds=a.load_seconds,
                      lora_modules=tuple(a.lora_modules or ()))
    run(profile, engine, opts, a.host, a.port)
    return 0


def _probe(a: argparse.Namespace) -> int:
    from gpu_probe.server import run

    run(a.vllm, a.host, a.port, a.interval, a.timeout)
    return 0


def _scaler(a: argparse.Namespace) -> int:
    from scaler.server import run

    return run(a.config, a.log_level)


POOL_FORM_TEXT = "NAME=PROFILE:N"


class _PoolAction(argparse.Action):
    """``--pool NAME=PROFILE:N``, repeatable: each value parsed into a :class:`kvgate.dev.stack.SimPool` (its
    ``type``), a pool name given twice refused here, so every --pool mistake reads as argparse's own."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from .dev.stack import SimPool

        assert isinstance(values, SimPool)
        pools: list[SimPool] = list(getattr(namespace, self.dest) or [])
        for p in pools:
            if p.name == values.name:
                raise argparse.ArgumentError(self, f"{values.spec!r}: pool {values.name!r} is already given by "
                                             f"{p.spec!r} (a pool is named after its model, lower-cased and "
                                             "sanitised)")
        setattr(namespace, self.dest, [*pools, values])


def _pool_spec(spec: str) -> object:
    from .dev.stack import SimPool

    try:
        return SimPool.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


POOL_HELP = ("start N simulated vLLM nodes (kvgate sim --profile PROFILE --served-model-name NAME) as a pool "
             "serving model NAME, and add it to kvgate's config (repeatable; the config's own pools are kept, its "
             "top-level nodes settings other than the node list become each pool's). The pool is named after NAME "
             "lower-cased, every run of characters outside [a-z0-9_.-] made '-', at most 63 characters (the pool-name "
             "pattern [a-z0-9][a-z0-9_.-]{0,62}): meta-llama/Llama-3.1-8B is pool meta-llama-llama-3.1-8b. Not with "
             "--nodes, --profile, --vllm or --standin")


def _check_pool_args(a: argparse.Namespace) -> None:
    """--pool replaces the single fleet --nodes/--profile/--vllm/--standin describe: refuse the mix the
    way argparse refuses a bad value (usage, the flag, exit 2) rather than ignore one of them."""
    if not getattr(a, "pool", None):
        return
    for flag, given in (("--nodes", a.nodes is not None), ("--profile", a.profile is not None),
                        ("--vllm", bool(a.vllm)), ("--standin", a.standin)):
        if given:
            a.subparser.error(f"argument --pool: not with {flag}: each --pool {POOL_FORM_TEXT} names its own "
                              "profile and node count, and pools replace the single fleet of simulated nodes")


def _up(a: argparse.Namespace) -> int:
    from .dev.demo import up

    return up(a)


def _demo(a: argparse.Namespace) -> int:
    from .dev.demo import demo

    return demo(a)


def _spend(a: argparse.Namespace) -> int:
    import asyncio
    import time
    from datetime import UTC, date, datetime

    import redis.asyncio as aioredis

    from ext_proc.config import load_config
    from ext_proc.spendreport import read, render
    from ext_proc.spendstore import SpendStore

    cfg = load_config(a.config)
    rs = cfg.store.redis
    url = a.redis or (rs.url if rs is not None else None)
    if url is None:
        print("kvgate spend: the config has no store.redis and no --redis URL was given: the ledger is in Redis",
              file=sys.stderr)
        return 2
    today = datetime.now(UTC).date()
    try:
        since = date.fromisoformat(a.since) if a.since else today.replace(day=1)
        until = date.fromisoformat(a.until) if a.until else today
    except ValueError as e:
        print(f"kvgate spend: --since/--until: {e} (use YYYY-MM-DD)", file=sys.stderr)
        return 2
    kw: dict[str, object] = {}
    if rs is not None and rs.password_file is not None and not a.redis:
        kw["password"] = rs.password_file.read_text().strip()
    if rs is not None and rs.tls_ca_file is not None and not a.redis:
        kw["ssl_ca_certs"] = str(rs.tls_ca_file)

    async def go() -> str:
        client = aioredis.Redis.from_url(url, **kw)  # type: ignore[arg-type]
        try:
            store = SpendStore(client, "kvgate-spend", cfg.prices, {t.name: t.budgets for t in cfg.tenants},
                               key_prefix=rs.key_prefix if rs is not None else "kvgate")
            rows, budgets = await read(store, cfg, since, until, time.time())
            return render(rows, budgets, "json" if a.json else "csv" if a.csv else "table")
        finally:
            await client.aclose()

    print(asyncio.run(go()))
    return 0


def _demo_budgets(a: argparse.Namespace) -> int:
    from .dev.budgetdemo import main

    return main(a)


def _top(a: argparse.Namespace) -> int:
    from .top import main

    return main(a)


def _bench(a: argparse.Namespace) -> int:
    from .bench.overhead import overhead

    if a.replicas < 1:
        print("kvgate: --replicas must be at least 1", file=sys.stderr)
        return 2
    if a.replicas > 1:
        from .dev.stack import RedisMissing, redis_binary

        try:
            redis_binary()
        except RedisMissing as e:
            print(f"kvgate: --replicas {a.replicas}: {e}", file=sys.stderr)
            return 2
    result = overhead(seconds=a.seconds, connections=a.connections, stream=a.stream, quiet=a.json,
                      replicas=a.replicas, breakdown=not a.no_breakdown, access_log_batch=a.access_log_batch)
    return _emit(a, result)


def _bench_sim(a: argparse.Namespace) -> int:
    from .bench.overhead import sim_speed

    result = sim_speed(a.seconds, a.nodes, a.rate, a.profile, quiet=a.json)
    return _emit(a, result)


def _bench_nodes(a: argparse.Namespace) -> int:
    from .bench.overhead import node_choice

    rows = node_choice(tuple(a.sizes), a.ops, quiet=a.json)
    return _emit(a, rows)


def _bench_prefix(a: argparse.Namespace) -> int:
    from .bench.overhead import prefix_index

    result = prefix_index(a.entries, a.nodes, a.ops, quiet=a.json)
    return _emit(a, result)


def _bench_intake(a: argparse.Namespace) -> int:
    from .bench.intake import intake_bench

    return _emit(a, intake_bench(a.reps, a.seconds, quiet=a.json, pure_python=a.pure_python))


def _bench_queue(a: argparse.Namespace) -> int:
    from .bench.overhead import queue_scaling

    rows = queue_scaling(tuple(a.sizes), a.ops, quiet=a.json)
    return _emit(a, rows)


def _bench_budgets(a: argparse.Namespace) -> int:
    from .bench.budgets import budgets

    return _emit(a, budgets(a.requests, quiet=a.json))


def _bench_scale(a: argparse.Namespace) -> int:
    from .bench.scale import scale

    result = scale(tuple(a.nodes), tuple(a.tenants), a.ops, tuple(a.follow_nodes), a.period, a.seconds,
                   tuple(a.modes), quiet=a.json, waiting_nodes=a.waiting_nodes, waiting=a.waiting)
    return _emit(a, result)


def _bench_scenarios(a: argparse.Namespace) -> int:
    from .bench.scenarios.runner import from_trace, load_bench_config, run, scenario_names, write_report
    from .bench.scenarios.trace import TraceError, TraceRequest
    from .bench.scenarios.workloads import Scenario

    try:
        if a.trace is not None:
            if a.config is None:
                print("kvgate: --trace needs --config (a bench config: profile, nodes, kvgate, policies)",
                      file=sys.stderr)
                return 2
            sc, given = from_trace(a.trace, load_bench_config(a.config))
            jobs: list[tuple[Scenario, list[TraceRequest] | None]] = [(sc, given)]
        else:
            jobs = [(sc, None) for sc in scenario_names(a.scenario)]
    except (TraceError, ValueError) as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    results = []
    for sc, trace in jobs:
        r = run(sc, trace, a.scale)
        results.append(r)
        if not a.json:
            print(r.markdown(), flush=True)
    if a.out is not None:
        from .bench.scenarios.report import PLOTS_HINT, plots_available

        md = write_report(results, a.out, plots=not a.no_plots)
        if not a.no_plots and not plots_available():
            print(f"kvgate: matplotlib is not installed, so no PNG plots were written to {a.out} "
                  f"(get them with: {PLOTS_HINT})", file=sys.stderr)
        if not a.json:
            print(f"report: {md}")
    if a.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    return 1 if any(s.result.lost for r in results for s in r.summaries) else 0


def _family_options(b: argparse.ArgumentParser, seeds_help: str) -> None:
    """The workload-family options ``bench families`` and ``bench ablation`` share."""
    from .bench.scenarios.families import FAMILIES

    b.add_argument("--family", action="append", choices=list(FAMILIES), help="default: all of them (repeatable)")
    b.add_argument("--seeds", type=int, default=3, help=seeds_help)
    b.add_argument("--scale", type=float, default=1.0, help="shorten the runs (0.1 = the first tenth of each)")


def _bench_families(a: argparse.Namespace) -> int:
    import time

    from .bench.scenarios.families import FAMILIES, POLICIES, SeedRun, heading, run_family, to_json

    if a.seeds < 1 or not a.scale > 0:
        print("kvgate: --seeds must be at least 1 and --scale above 0", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(a.family or FAMILIES))
    policies = tuple(dict.fromkeys(a.policies or POLICIES))
    seeds = list(range(1, a.seeds + 1))

    def progress(r: SeedRun) -> None:
        if not a.json:
            print(r.markdown(), flush=True)

    t0 = time.perf_counter()
    results = []
    for name in names:
        if not a.json:
            print(heading(name), flush=True)
        r = run_family(name, seeds, a.scale, policies, on_run=progress)
        results.append(r)
        if not a.json:
            print(r.table(), flush=True)
    wall = time.perf_counter() - t0
    if a.json:
        print(json.dumps(to_json(results, seeds, a.scale, policies, wall), indent=2))
    else:
        print(f"wall time: {wall:.1f} s ({len(names)} families x {len(seeds)} seeds x {len(policies)} policies, "
              f"scale {a.scale:g})")
    return 1 if any(s.result.lost for fr in results for sr in fr.runs for s in sr.result.summaries) else 0


def _bench_ablation(a: argparse.Namespace) -> int:
    import time

    from .bench.scenarios.ablation import AblationSeed, run_ablation, to_json
    from .bench.scenarios.families import FAMILIES, heading

    if a.seeds < 1 or not a.scale > 0:
        print("kvgate: --seeds must be at least 1 and --scale above 0", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(a.family or FAMILIES))
    switches = list(dict.fromkeys(a.off)) if a.off else None
    seeds = list(range(1, a.seeds + 1))

    def progress(s: AblationSeed) -> None:
        if not a.json:
            print(s.run.markdown() + "\n" + s.table() + "\n", flush=True)

    t0 = time.perf_counter()
    results = []
    for name in names:
        if not a.json:
            print(heading(name), flush=True)
        r = run_ablation(name, seeds, a.scale, **({"switches": switches} if switches else {}), on_seed=progress)
        results.append(r)
        if not a.json:
            print(r.closing(), flush=True)
    wall = time.perf_counter() - t0
    from .bench.scenarios.switches import SWITCHES

    if a.json:
        print(json.dumps(to_json(results, seeds, a.scale, switches or list(SWITCHES), wall), indent=2))
    else:
        print(f"wall time: {wall:.1f} s ({len(names)} families x {len(seeds)} seeds, scale {a.scale:g})")
    return 1 if any(x.result.lost for fr in results for s in fr.seeds for x in s.run.result.summaries) else 0


def _bench_trace(a: argparse.Namespace) -> int:
    from .bench.scenarios.trace import write_trace
    from .bench.scenarios.workloads import get_scenario

    try:
        sc = get_scenario(a.scenario)
    except ValueError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    n = write_trace(a.out, sc.trace(a.scale))
    print(f"{n} requests of scenario {sc.name} written to {a.out}")
    return 0


def _bench_live(a: argparse.Namespace) -> int:
    from .bench.scenarios.live import live

    return live(a)


def parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The whole CLI; ``benchmarks=False`` leaves out the benchmark subcommands that need the simulator's
    and the scenarios' modules to list their choices (a production command never loads them)."""
    p = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("extproc", help="serve Envoy's ext_proc + access-log gRPC APIs")
    s.add_argument("--config", required=True, help="kvgate YAML config")
    s.add_argument("--log-level", default="info")
    s.add_argument("--grpc-address", default=None, metavar="HOST:PORT",
                   help="overrides server.grpc_address (several replicas sharing one config file)")
    s.add_argument("--metrics-address", default=None, metavar="HOST:PORT",
                   help="overrides server.metrics_address")
    s.set_defaults(fn=_extproc)

    s = sub.add_parser("check-config", help="validate a config file and exit")
    s.add_argument("config")
    s.set_defaults(fn=_check_config)

    s = sub.add_parser("hash-key", help="print the SHA-256 to put in api_key_sha256 ('-' reads stdin)")
    s.add_argument("key")
    s.set_defaults(fn=_hash_key)

    s = sub.add_parser("envoy-config", help="render an Envoy bootstrap for kvgate")
    s.add_argument("--listen-address", default="0.0.0.0", help="'::' listens on IPv6 and IPv4")
    s.add_argument("--listen-port", type=int, default=10000)
    s.add_argument("--admin-port", type=int, default=9901)
    s.add_argument("--extproc-host", default="127.0.0.1")
    s.add_argument("--extproc-port", type=int, default=9001)
    s.add_argument("--upstream", action="append", default=[], metavar="HOST:PORT")
    s.add_argument("--fail-open", action="store_true", help="let requests through when kvgate is down")
    s.add_argument("--trusted-header", default=None,
                   help="the tenant header your authn filter sets; the client's copy is stripped first")
    s.add_argument("--original-dst", action="store_true", help="kvgate picks the node (ORIGINAL_DST cluster)")
    s.add_argument("--access-log-batch", type=int, default=0, metavar="BYTES",
                   help="batch completions to kvgate up to BYTES or 50 ms (e.g. 16384): less CPU per request, but "
                        "a slot frees up to 50 ms after its response ends (default 0: at once)")
    s.add_argument("--config", default=None, metavar="KVGATE_YAML",
                   help="derive circuit breakers, timeouts, body limit and trusted header from kvgate's config")
    s.add_argument("--route", action="append", default=[], metavar="[POST:|GET:]PATH",
                   help="allowlisted route (repeatable; replaces the defaults): POST = inference, buffered body "
                        "to kvgate; GET = headers only; every other path is a 404")
    s.add_argument("--write", action="store_true", help="regenerate the files shipped in envoy/")
    s.add_argument("--check", action="store_true", help="fail if the files in envoy/ are stale")
    s.set_defaults(fn=_envoy_config)

    s = sub.add_parser("upstream", help="a stand-in OpenAI-compatible upstream")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--token-ms", type=float, default=2.0)
    s.set_defaults(fn=_upstream)

    from ext_proc.profiles import PROFILES

    s = sub.add_parser("sim", help="a simulated vLLM node (same API and metrics)")
    s.add_argument("--profile", default="8b-h100", help=f"one of: {', '.join(PROFILES)}")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    s.add_argument("--max-num-queued-reqs", type=int, default=None, help="503 beyond this many waiting")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--num-gpu-blocks", type=int, default=None, help="override the profile's KV capacity")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="vLLM's: the most prompt tokens one request prefills per step (0: off)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--mean-output-tokens", type=int, default=256)
    s.add_argument("--noise", type=float, default=0.0, help="relative std-dev of step time")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--legacy-kv-metric", action="store_true", help="export vllm:gpu_cache_usage_perc (pre-0.10)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's automatic prefix caching (on by default, as in vLLM)")
    s.add_argument("--load-seconds", type=float, default=0.0, help="simulated model load before listening")
    s.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME",
                   help="LoRA adapters it serves (as vLLM's --enable-lora --lora-modules): requests naming one run "
                        "with it, and vllm:lora_requests_info is exported")
    s.add_argument("--max-loras", type=int, default=1, help="adapters one batch may hold (vLLM's default 1)")
    s.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default max-loras)")
    s.set_defaults(fn=_sim)

    s = sub.add_parser("probe", help="the per-node probe: vLLM /metrics + NVML -> GET /snapshot and /snapshot/stream")
    s.add_argument("--vllm", required=True, help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9102)
    s.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    s.add_argument("--timeout", type=float, default=1.0, help="seconds before a poll counts as failed")
    s.set_defaults(fn=_probe)

    s = sub.add_parser("scaler", help="the KEDA external scaler: kvgate's capacity rejections -> vLLM replicas")
    s.add_argument("--config", required=True, help="scaler YAML config (see examples/scaler.yaml)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(fn=_scaler)

    for name, fn, helptext in (("up", _up, "run the local stack in the foreground"),
                               ("demo", _demo, "run the local stack under a multi-tenant load")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--config", type=Path, default=None, help="kvgate config (default: the demo tenants)")
        s.add_argument("--port", type=int, default=None, help="Envoy's listen port (default: a free port, printed)")
        s.add_argument("--nodes", type=int, default=None, help="simulated vLLM nodes to start (default 2)")
        s.add_argument("--profile", default=None, help="profile of the simulated vLLM nodes (default 8b-h100)")
        s.add_argument("--pool", action=_PoolAction, type=_pool_spec, default=[], metavar=POOL_FORM_TEXT,
                       help=POOL_HELP + (" (the demo: the chatbot, batch and intruder clients ask for the first "
                                         "pool's model, the RAG flood for the last pool's)" if name == "demo" else ""))
        s.add_argument("--kv-blocks", type=int, default=3000 if name == "demo" else None,
                       help="KV blocks per simulated node (the demo's small cache shows KV pressure)")
        s.add_argument("--vllm", action="append", default=[], metavar="URL",
                       help="real vLLM servers to put behind kvgate instead of simulated nodes")
        s.add_argument("--standin", action="store_true", help="use the stand-in upstream instead of kvgate sim")
        s.add_argument("--token-ms", type=float, default=4.0, help="stand-in upstream only: ms per token")
        s.add_argument("--workdir", type=Path, default=Path(".kvgate-run"))
        if name == "up":
            s.add_argument("--replicas", type=int, default=1,
                           help="kvgate replicas sharing one config file; above 1 they share their state in a "
                                "local redis-server (apt-get install redis-server)")
        if name == "demo":
            s.add_argument("--seconds", type=float, default=25.0,
                           help="seconds of load in each of the two runs (without and with kvgate)")
            s.add_argument("--request-timeout", type=float, default=60.0,
                           help="seconds a client waits on a silent connection before giving up")
            s.add_argument("--json", action="store_true",
                           help="print only the before/after summary, as one JSON document on stdout")
        s.set_defaults(fn=fn, subparser=s)

    s = sub.add_parser("spend", help="spend per tenant, model and day, and each budget's window, from the ledger")
    s.add_argument("--config", required=True, help="kvgate YAML config (its store.redis, prices and budgets)")
    s.add_argument("--redis", default=None, metavar="URL", help="read this Redis instead of store.redis.url")
    s.add_argument("--since", default=None, metavar="YYYY-MM-DD",
                   help="first day (UTC); default: the 1st of this month")
    s.add_argument("--until", default=None, metavar="YYYY-MM-DD", help="last day (UTC), included; default: today")
    fmt = s.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    s.set_defaults(fn=_spend)

    s = sub.add_parser("demo-budgets", help="a tenant runs into a small daily spend budget (2 replicas, Redis)")
    s.add_argument("--workdir", type=Path, default=Path(".kvgate-demo-budgets"))
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_demo_budgets)

    s = sub.add_parser("top", help="a live view of running kvgate replicas from their /metrics")
    s.add_argument("--metrics", action="append", required=True, metavar="URL",
                   help="a kvgate /metrics URL (repeatable: several replicas add up)")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    s.add_argument("--once", action="store_true", help="print one frame (two scrapes a second apart) and exit")
    s.set_defaults(fn=_top)

    s = sub.add_parser("bench", help="benchmarks")
    bsub = s.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("overhead", help="plain Envoy vs Envoy + kvgate on the full request path")
    b.add_argument("--seconds", type=float, default=10.0)
    b.add_argument("--connections", type=int, default=16)
    b.add_argument("--stream", action="store_true", help="streaming responses (SSE) instead of JSON")
    b.add_argument("--replicas", type=int, default=1,
                   help="above 1, also: kvgate's CPU per request with the Redis store vs the in-process one, and "
                        "req/s of 1 vs this many replicas sharing Redis (needs redis-server)")
    b.add_argument("--access-log-batch", type=int, default=0, metavar="BYTES",
                   help="Envoy batches completions to kvgate (kvgate envoy-config --access-log-batch)")
    b.add_argument("--no-breakdown", action="store_true",
                   help="only the two headline runs: not the transport floor (a server that decides nothing), "
                        "the CPU breakdown by part, nor the latency added at half kvgate's maximum rate")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench)
    b = bsub.add_parser("sim", help="virtual-time speed of a simulated fleet")
    b.add_argument("--seconds", type=float, default=600.0)
    b.add_argument("--nodes", type=int, default=8)
    b.add_argument("--rate", type=float, default=200.0)
    b.add_argument("--profile", default="8b-h100")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_sim)
    b = bsub.add_parser("nodes", help="cost of one node choice (filters, TTFT predictions, pick) at 8, 64 and "
                        "1,000 nodes")
    b.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 1_000])
    b.add_argument("--ops", type=int, default=5000)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_nodes)
    b = bsub.add_parser("prefix", help="cost of prefix affinity: the index's memory, hashing and matching a "
                        "prompt, a node choice with and without it")
    b.add_argument("--entries", type=int, default=100_000, help="distinct prompt blocks in the index")
    b.add_argument("--nodes", type=int, default=8)
    b.add_argument("--ops", type=int, default=2000)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_prefix)
    b = bsub.add_parser("intake", help="kvgate CPU per decision for hostile bodies at max_body_bytes, and a "
                        "victim tenant's decision latency beside a hostile tenant at its limits")
    b.add_argument("--reps", type=int, default=5, help="decisions per body kind")
    b.add_argument("--seconds", type=float, default=30.0, help="virtual seconds of the victim run")
    b.add_argument("--pure-python", action="store_true",
                   help="as an install without the C extension (ext_proc/_jsonscan.c) runs: its Python loops")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_intake)
    b = bsub.add_parser("queue", help="cost of queue operations with 0, 1k and 10k requests queued")
    b.add_argument("--sizes", type=int, nargs="+", default=[0, 1_000, 10_000])
    b.add_argument("--ops", type=int, default=3000)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_queue)
    b = bsub.add_parser("budgets", help="what spend budgets (reserve the worst case, settle the real cost) add to "
                        "a decision that pays no store round trip")
    b.add_argument("--requests", type=int, default=20_000)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_budgets)
    b = bsub.add_parser("scale", help="decision time against nodes and tenants, and the CPU of following 10, 100 "
                        "and 1,000 simulated probes (streamed, and polled as older probes are)")
    b.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1_000], help="fleet sizes for decision time")
    b.add_argument("--tenants", type=int, nargs="+", default=[10, 10_000])
    b.add_argument("--ops", type=int, default=20_000, help="decisions per figure (0: skip decision time)")
    b.add_argument("--follow-nodes", type=int, nargs="+", default=[10, 100, 1_000],
                   help="simulated probes to follow (one port each, in a separate process)")
    b.add_argument("--period", type=float, default=0.25, help="the probes' read and kvgate's poll interval")
    b.add_argument("--seconds", type=float, default=10.0, help="measured seconds per follow figure")
    b.add_argument("--modes", nargs="*", choices=["poll", "stream"], default=["poll", "stream"],
                   help="poll: probes without the stream (kvgate polls GET /snapshot); stream: GET /snapshot/stream")
    b.add_argument("--waiting-nodes", type=int, default=1_000,
                   help="full nodes for the figure with requests waiting (0: skip it)")
    b.add_argument("--waiting", type=int, default=15, help="requests the gateway queue holds in that figure")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_scale)
    if not benchmarks:
        return p  # (the scenario and family names below come from the benchmarks' own modules)
    from .bench.scenarios.workloads import SCENARIOS

    b = bsub.add_parser("scenarios", help="the pinned scenarios in virtual time, policies side by side")
    b.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all of them")
    b.add_argument("--trace", type=Path, default=None, help="replay a JSONL trace instead (needs --config)")
    b.add_argument("--config", type=Path, default=None, help="bench config for --trace: profile, nodes, kvgate, "
                   "policies")
    b.add_argument("--scale", type=float, default=1.0, help="shorten the scenarios (0.1 = a tenth of the time)")
    b.add_argument("--out", type=Path, default=None, help="write report.md, results.json and PNG plots here")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench_scenarios)
    from .bench.scenarios.families import POLICIES

    b = bsub.add_parser("families", help="generated workload families (bursty, diurnal, shifting mixes, shared "
                        "prefixes) over several seeds: median and worst seed per policy")
    _family_options(b, "seeds 1..N per family (default 3)")
    b.add_argument("--policies", nargs="+", choices=list(POLICIES), default=None,
                   help=f"default: {' '.join(POLICIES)}")
    b.add_argument("--json", action="store_true", help="one JSON document on stdout (stable field names)")
    b.set_defaults(fn=_bench_families)
    from .bench.scenarios.switches import SWITCHES

    b = bsub.add_parser("ablation", help="kvgate with each mechanism off in turn (quotas, queue, priority, "
                        "breakers, predictions, prefix) and all off, beside none, kv-shed and kvgate, on the families")
    _family_options(b, "seeds 1..N per family (default 3, as families)")
    b.add_argument("--off", nargs="+", choices=list(SWITCHES), default=None,
                   help=f"the mechanisms to switch off in turn (default: {' '.join(SWITCHES)}; with more than "
                   "one, also all of them at once)")
    b.add_argument("--json", action="store_true", help="one JSON document on stdout (stable field names)")
    b.set_defaults(fn=_bench_ablation)
    b = bsub.add_parser("trace", help="write a built-in scenario's trace (JSONL)")
    b.add_argument("--scenario", required=True, choices=list(SCENARIOS))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--scale", type=float, default=1.0)
    b.set_defaults(fn=_bench_trace)
    b = bsub.add_parser("live", help="a short scenario through the real stack, beside the same in virtual time")
    # the live stack runs one fleet of simulated nodes: a scenario with model pools is virtual time only
    b.add_argument("--scenario", default="noisy-neighbour",
                   choices=[n for n, make in SCENARIOS.items() if not make().config.get("pools")])
    b.add_argument("--seconds", type=float, default=30.0, help="length of the replayed trace")
    b.add_argument("--json", action="store_true")
    b.add_argument("--workdir", type=Path, default=Path(".kvgate-run/live"))
    b.set_defaults(fn=_bench_live)
    return p


def main(argv: list[str] | None = None) -> int:
    from ext_proc.config import ConfigError

    args = sys.argv[1:] if argv is None else argv
    a = parser(benchmarks=not args or args[0] in ("bench", "-h", "--help")).parse_args(argv)
    _check_pool_args(a)
    try:
        return int(a.fn(a))
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
