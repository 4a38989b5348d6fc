"""``kvgate up --pool NAME=PROFILE:N`` without starting anything: how a spec is read (and each mistake
refused the way argparse refuses a bad value), the pool name a model gets, and the kvgate config the
stack runs with — checked against kvgate's own config schema, so a pool the stack adds is one kvgate
accepts. The processes themselves are exercised in test_pools_e2e.py."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ext_proc.config import ConfigError, load_config, parse_config
from ext_proc.identity import hash_key
from kvgate import cli
from kvgate.dev.demo import CLIENTS, _stack, demo_config, demo_traffic
from kvgate.dev.stack import SimPool, Stack, pool_name, with_pools

SMALL, BIG = SimPool.parse("llama-8b=8b-h100:2"), SimPool.parse("Meta/Llama-3.1-70B=70b-h100x4:1")


def addresses(n: int, first: int = 31000) -> list[tuple[str, str]]:
    """Stand-ins for the (address, probe URL) of ``n`` started nodes."""
    return [(f"127.0.0.1:{first + i}", f"http://127.0.0.1:{first + 100 + i}") for i in range(n)]


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command line refused like a bad argparse value (exit 2)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: kvgate ")
    return err.strip().splitlines()[-1]


# -- the spec -------------------------------------------------------------------------------------

def test_a_spec_names_the_model_the_profile_and_the_node_count() -> None:
    assert (SMALL.model, SMALL.profile, SMALL.nodes, SMALL.name) == ("llama-8b", "8b-h100", 2, "llama-8b")
    assert BIG.name == "meta-llama-3.1-70b" and BIG.model == "Meta/Llama-3.1-70B"
    # the last '=' and ':' split it: a model name may hold either
    odd = SimPool.parse("llama3:8b=8b-a100:3")
    assert (odd.model, odd.profile, odd.nodes, odd.name) == ("llama3:8b", "8b-a100", 3, "llama3-8b")
    assert SimPool.parse(SMALL.spec) == SMALL


@pytest.mark.parametrize(("model", "name"), [
    ("llama-8b", "llama-8b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama-llama-3.1-8b-instruct"),
    ("  Qwen2.5 // 72B  ", "qwen2.5-72b"),
    ("_private.model_", "private.model"),
    ("x" * 70 + "-y", "x" * 63),
    ("a" * 62 + "/b", "a" * 62),  # cut at 63 characters, then no trailing '-'
])
def test_the_pool_name_is_the_model_name_sanitised_to_the_pool_name_pattern(model: str, name: str) -> None:
    assert pool_name(model) == name
    assert parse_config({"pools": [{"name": name, "models": ["m"], "nodes": {"static": [
        {"address": "127.0.0.1:1", "probe": "http://127.0.0.1:2"}]}}]}).pools[0].name == name


@pytest.mark.parametrize(("spec", "says"), [
    ("llama-8b", "'llama-8b': want NAME=PROFILE:N (a model name, a kvgate sim profile, a node count), "
                 "e.g. llama-8b=8b-h100:2"),
    ("llama-8b=8b-h100", "want NAME=PROFILE:N"),
    ("=8b-h100:2", "want NAME=PROFILE:N"),
    ("llama-8b=:2", "want NAME=PROFILE:N"),
    ("llama-8b=8b-h100:", "want NAME=PROFILE:N"),
    ("llama-8b=8b-h100:two", "N must be a whole number of nodes, got 'two'"),
    ("llama-8b=8b-h100:0", "N must be at least 1 (a pool needs a node), got 0"),
    ("llama-8b=8b-h100:-3", "N must be at least 1 (a pool needs a node), got -3"),
    ("llama-8b=gpt-9:1", "unknown profile 'gpt-9'; known: 8b-h100, "),
    ("llama-*=8b-h100:1", "serves one exact name (no '*', '?' or '[')"),
    ("has space=8b-h100:1", "1 to 256 printable characters, no spaces"),
    ("///=8b-h100:1", "no pool name can be made from model name '///'"),
    ("None=8b-h100:1", "pool name 'none' is reserved"),
])
def test_a_bad_spec_is_an_argparse_error_naming_the_flag_and_the_form(
        spec: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as e:
        SimPool.parse(spec)
    assert str(e.value).startswith(f"{spec!r}: ") and says in str(e.value)
    line = usage_error(["up", "--pool", spec], capsys)
    assert line.startswith(f"kvgate up: error: argument --pool: {spec!r}: ") and says in line


def test_the_same_pool_twice_on_the_command_line_is_refused_naming_both(capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(["demo", "--pool", "llama-8b=8b-h100:1", "--pool", "LLaMA-8B=8b-a100:2"], capsys)
    assert line == ("kvgate demo: error: argument --pool: 'LLaMA-8B=8b-a100:2': pool 'llama-8b' is already given "
                    "by 'llama-8b=8b-h100:1' (a pool is named after its model, lower-cased and sanitised)")


@pytest.mark.parametrize("other", [["--nodes", "3"], ["--profile", "34b-h100"], ["--vllm", "http://127.0.0.1:1"],
                                   ["--standin"]])
def test_pools_do_not_mix_with_the_single_fleet_flags(other: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(["up", "--pool", "llama-8b=8b-h100:1", *other], capsys)
    assert line.startswith(f"kvgate up: error: argument --pool: not with {other[0]}: ")


def test_help_says_how_a_pool_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("up", "demo"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert "--pool NAME=PROFILE:N" in text and "[a-z0-9][a-z0-9_.-]{0,62}" in text
        assert "meta-llama/Llama-3.1-8B is pool meta-llama-llama-3.1-8b" in text


# -- the config the stack runs with ---------------------------------------------------------------

def test_the_stack_adds_a_pool_per_spec_and_drops_the_top_level_nodes(tmp_path: Path) -> None:
    st = Stack(tmp_path, demo_config(), pools=[SMALL, BIG], sim_args=["--num-gpu-blocks", "3000"])
    assert st.pooled
    st.kvgate_config = st.pooled_config(addresses(3))
    st.write_config()
    doc = yaml.safe_load(st.config_path.read_text())
    assert "nodes" not in doc
    small, big = doc["pools"]
    assert small == {"name": "llama-8b", "models": ["llama-8b"], "nodes": {
        # the demo's breaker tuning carried over from its top-level nodes
        "breaker": {"recovery_window_seconds": 5, "half_open_requests": 3}, "poll_interval_seconds": 0.2,
        "static": [{"address": "127.0.0.1:31000", "probe": "http://127.0.0.1:31100"},
                   {"address": "127.0.0.1:31001", "probe": "http://127.0.0.1:31101"}],
        "performance": {"profile": "8b-h100"}}}
    assert big["name"] == "meta-llama-3.1-70b" and big["models"] == ["Meta/Llama-3.1-70B"]
    assert big["nodes"]["static"] == [{"address": "127.0.0.1:31002", "probe": "http://127.0.0.1:31102"}]
    assert big["nodes"]["performance"] == {"profile": "70b-h100x4"}
    assert doc["tenants"] == demo_config()["tenants"] and doc["server"]["drain_seconds"] == 5
    cfg = load_config(st.config_path)  # kvgate's own schema takes it
    assert [(p.name, p.models, p.nodes.performance.profile, len(p.nodes.static)) for p in cfg.pools] == [
        ("llama-8b", ["llama-8b"], "8b-h100", 2), ("meta-llama-3.1-70b", ["Meta/Llama-3.1-70B"], "70b-h100x4", 1)]
    assert cfg.nodes is None and cfg.pools[1].nodes.breaker.recovery_window_seconds == 5
    # a second start adds the pools to the config as given, not to the one already extended
    assert st.pooled_config(addresses(3, 32000))["pools"][0]["nodes"]["static"][0]["address"] == "127.0.0.1:32000"


def test_the_configs_own_pools_are_kept_first(tmp_path: Path) -> None:
    own = {"name": "gpu-box", "models": ["mistral-7b", "mistral-7b-*"], "adapters": ["sql-lora"],
           "nodes": {"static": [{"address": "10.0.0.5:8000", "probe": "http://10.0.0.5:9102"}]},
           "queue": {"max_size": 16}}
    cfg = {"pools": [own], "tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-t")],
                                        "models": ["mistral-7b", "llama-8b"]}]}
    st = Stack(tmp_path, cfg, pools=[SMALL])
    st.check_pools()
    out = st.pooled_config(addresses(2))
    assert out["pools"][0] == own and [p["name"] for p in out["pools"]] == ["gpu-box", "llama-8b"]
    assert parse_config(out).pools[1].models == ["llama-8b"]
    assert cfg["pools"] == [own]  # the caller's config is left as it was


def test_a_pool_name_the_config_has_already_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg = {"pools": [{"name": "llama-8b", "models": ["llama-8b-instruct"],
                      "nodes": {"static": [{"address": "10.0.0.5:8000", "probe": "http://10.0.0.5:9102"}]}}]}
    st = Stack(tmp_path, cfg, pools=[SMALL])
    with pytest.raises(ConfigError, match=r"^--pool llama-8b=8b-h100:2: pool 'llama-8b' is already defined "
                                          r"\(pools\[0\] of kvgate's config\)"):
        st.start()
    assert st.procs == {} and not st.config_path.exists()


def test_a_config_that_cannot_take_the_pools_names_the_field_before_anything_starts(tmp_path: Path) -> None:
    # the tenant may use a model no pool serves once the pools are these
    cfg = {"tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-t")], "models": ["gpt-4o"]}]}
    st = Stack(tmp_path, cfg, pools=[SMALL])
    with pytest.raises(ConfigError) as e:
        st.start()
    assert "tenants[0].models: no pool serves a model 'gpt-4o'; pools serve: llama-8b" in str(e.value)
    assert st.procs == {}


def test_the_cli_reports_a_pool_the_config_has_already_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "kvgate.yaml"
    conf.write_text(yaml.safe_dump({"pools": [{"name": "llama-8b", "models": ["x"], "nodes": {
        "static": [{"address": "10.0.0.5:8000", "probe": "http://10.0.0.5:9102"}]}}]}))
    assert cli.main(["up", "--config", str(conf), "--pool", "llama-8b=8b-h100:1",
                     "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate: --pool llama-8b=8b-h100:1: pool 'llama-8b' is already defined")
    assert not list((tmp_path / "run").glob("*.log"))  # nothing was started


def test_each_pools_nodes_get_its_profile_and_model_name_over_the_shared_sim_args(tmp_path: Path) -> None:
    st = Stack(tmp_path, {}, pools=[SMALL, BIG],
               sim_args=["--profile", "34b-h100", "--num-gpu-blocks", "3000", "--served-model-name=x",
                         "--scheduling-policy", "priority"])
    assert st.pool_sim_args(BIG) == ["--num-gpu-blocks", "3000", "--scheduling-policy", "priority",
                                     "--profile", "70b-h100x4", "--served-model-name", "Meta/Llama-3.1-70B"]
    assert Stack(tmp_path, {}, pools=[SMALL]).pool_sim_args(SMALL) == [
        "--profile", "8b-h100", "--served-model-name", "llama-8b"]


def test_pools_and_external_vllm_servers_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vllm_urls: with pools"):
        Stack(tmp_path, {}, pools=[SMALL], vllm_urls=["http://127.0.0.1:8000"])
    with pytest.raises(ValueError, match="a pool name given twice"):
        Stack(tmp_path, {}, pools=[SMALL, SimPool("LLAMA-8B", "8b-a100", 1)])


# -- the demo and up keep their defaults ----------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    a = cli.parser().parse_args(list(argv))
    cli._check_pool_args(a)
    return a


def test_without_pool_the_demo_stack_is_what_it_was(tmp_path: Path) -> None:
    st = _stack(_args("demo", "--workdir", str(tmp_path)), demo_config("enforce"), tmp_path)
    assert st.pools == [] and not st.pooled and st.upstreams == 2 and st.nodes
    assert st.sim_args == ["--profile", "8b-h100", "--num-gpu-blocks", "3000", "--scheduling-policy", "priority"]
    assert demo_traffic([]) == [c.traffic for c in CLIENTS] and all(c.traffic.model is None for c in CLIENTS)
    st = _stack(_args("up", "--nodes", "3", "--profile", "34b-h100", "--workdir", str(tmp_path)))
    assert st.upstreams == 3 and st.sim_args is not None and st.sim_args[:2] == ["--profile", "34b-h100"]


def test_with_two_pools_the_demo_floods_the_last_and_keeps_the_rest_on_the_first(tmp_path: Path) -> None:
    a = _args("demo", "--pool", "llama-8b=8b-h100:1", "--pool", "llama-70b=70b-h100x4:1", "--workdir", str(tmp_path))
    st = _stack(a, demo_config("shadow"), tmp_path)
    assert [p.name for p in st.pools] == ["llama-8b", "llama-70b"] and st.pooled
    models = {t.tenant: t.model for t in demo_traffic(st.pools)}
    assert models == {"chatbot": "llama-8b", "rag": "llama-70b", "batch": "llama-8b", "intruder": "llama-8b"}
    # the same rates and sizes as without pools: only the model differs
    assert [replace(t, model=None) for t in demo_traffic(st.pools)] == demo_traffic([])


def test_added_pools_never_share_a_mapping() -> None:
    """with_pools copies what it keeps: two pools never share one nodes mapping (the YAML would carry
    anchors, and a later edit to one pool would change the other)."""
    out = with_pools({"nodes": {"breaker": {"recovery_window_seconds": 5}}},
                     [(SMALL, [{"address": "127.0.0.1:1", "probe": "http://127.0.0.1:2"}]),
                      (BIG, [{"address": "127.0.0.1:3", "probe": "http://127.0.0.1:4"}])])
    a, b = (p["nodes"] for p in out["pools"])
    assert a["breaker"] == b["breaker"] and a["breaker"] is not b["breaker"]
    assert "&id" not in yaml.safe_dump(out)


def test_a_config_whose_tenant_uses_a_pool_model_is_taken_with_that_pool(tmp_path: Path) -> None:
    """``kvgate up --config c --pool llama-8b=...`` with a config of its own pools and a tenant entitled
    to llama-8b: the config was checked before the --pool pools were added ("no pool serves")."""
    conf = tmp_path / "kvgate.yaml"
    conf.write_text(yaml.safe_dump({
        "pools": [{"name": "gpu-box", "models": ["mistral-7b"],
                   "nodes": {"static": [{"address": "10.0.0.5:8000", "probe": "http://10.0.0.5:9102"}]}}],
        "tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-t")], "models": ["mistral-7b", "llama-8b"]}]}))
    a = cli.parser().parse_args(["up", "--config", str(conf), "--pool", "llama-8b=8b-h100:1",
                                 "--workdir", str(tmp_path / "run")])
    st = _stack(a)
    st.check_pools()
    cfg = parse_config(st.pooled_config(addresses(1)))
    assert [p.name for p in cfg.pools] == ["gpu-box", "llama-8b"]
    assert cfg.tenant("t") is not None


def test_kvgate_up_listens_on_the_port_asked_for_even_10000(tmp_path: Path) -> None:
    for port in (10000, 12345):
        a = cli.parser().parse_args(["up", "--port", str(port), "--workdir", str(tmp_path / "run")])
        assert _stack(a).listen_port == port
    a = cli.parser().parse_args(["up", "--workdir", str(tmp_path / "run")])
    assert _stack(a).listen_port is None  # a free port, printed in the banner


def test_a_stack_given_a_port_listens_there(tmp_path: Path) -> None:
    from kvgate.dev.stack import free_port

    port = free_port()
    with Stack(tmp_path, {"tenants": []}, listen_port=port) as st:
        assert st.url == f"http://127.0.0.1:{port}"
