from pathlib import Path

import pytest

from ext_proc.config import ConfigError, load_config, parse_config
from ext_proc.identity import hash_key

KEY = hash_key("k")


def test_defaults_are_usable() -> None:
    cfg = parse_config({})
    assert cfg.mode == "enforce"
    assert cfg.identity.unknown_keys == "reject"
    assert cfg.identity.trusted_header is None
    assert cfg.estimation.chars_per_token == 4.0


def test_error_names_the_field_by_path() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"tenants": [{"name": "a"}, {"name": "b", "max_concurrent": 0}]}, "f.yaml")
    msg = str(e.value)
    assert "f.yaml" in msg
    assert "tenants[1].max_concurrent" in msg
    assert "greater than or equal to 1" in msg


def test_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.max_concurency: unknown setting"):
        parse_config({"tenants": [{"name": "a", "max_concurency": 3}]})


def test_duplicate_tenant_and_shared_key_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.name: tenant 'a' is defined twice"):
        parse_config({"tenants": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.api_key_sha256: a key is already given to tenant 'a'"):
        parse_config({"tenants": [{"name": "a", "api_key_sha256": [KEY]}, {"name": "b", "api_key_sha256": [KEY]}]})


def test_plaintext_key_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="kvgate hash-key"):
        parse_config({"tenants": [{"name": "a", "api_key_sha256": ["sk-live-plaintext"]}]})


def test_default_tenant_must_exist() -> None:
    with pytest.raises(ConfigError, match=r"identity\.default_tenant: required"):
        parse_config({"identity": {"unknown_keys": "default"}})
    with pytest.raises(ConfigError, match="no tenant named 'free'"):
        parse_config({"identity": {"unknown_keys": "default", "default_tenant": "free"}})
    cfg = parse_config({"identity": {"unknown_keys": "default", "default_tenant": "free"},
                        "tenants": [{"name": "free"}]})
    assert cfg.identity.default_tenant == "free"


def test_trusted_header_cannot_be_an_internal_header() -> None:
    with pytest.raises(ConfigError, match=r"identity\.trusted_header"):
        parse_config({"identity": {"trusted_header": "x-kvgate-tenant"}})


def test_tokenizer_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"estimation.tokenizer_json: .*does not exist"):
        parse_config({"estimation": {"tokenizer_json": str(tmp_path / "nope.json")}})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_shipped_example_config_is_valid() -> None:
    cfg = load_config(Path(__file__).parent.parent / "examples" / "kvgate.yaml")
    assert [t.name for t in cfg.tenants] == ["chatbot", "rag-pipeline"]
    assert cfg.tenant("rag-pipeline").mode == "shadow"  # type: ignore[union-attr]
    assert cfg.nodes is not None and cfg.nodes.static[1].kv_admit_threshold == 0.85


def test_nodes_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"nodes: list nodes under nodes\.static or set nodes\.dns"):
        parse_config({"nodes": {}})
    with pytest.raises(ConfigError, match="dead_after_seconds: must be longer"):
        parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://a:2"}], "stale_after_seconds": 5,
                                "dead_after_seconds": 3}})
    with pytest.raises(ConfigError, match=r"nodes\.static\[0\]\.address"):
        parse_config({"nodes": {"static": [{"address": "no-port", "probe": "http://a:2"}]}})


@pytest.mark.parametrize(("cfg", "error"), [
    ({"tenants": [{"name": "a", "tier": "gold"}]},
     r"tenants\[0\]\.tier: no tier named 'gold'; tiers are: batch, interactive, standard"),
    ({"tiers": {"a": {"priority": 0, "max_queue_wait_ms": 10}, "b": {"priority": 0, "max_queue_wait_ms": 10}}},
     r"tiers\.b\.priority: tier 'a' already has priority 0"),
    ({"tiers": {"a": {"priority": 0, "max_queue_wait_ms": 60_000}}},
     r"tiers\.a\.max_queue_wait_ms: Input should be less than or equal to 55000"),
    ({"tiers": {"a": {"priority": 0}}}, r"tiers\.a\.max_queue_wait_ms: Field required"),
    ({"tiers": {}}, r"tiers: define at least one tier"),
    ({"queue": {"max_size": 0}}, r"queue\.max_size: Input should be greater than or equal to 1"),
    ({"tenants": [{"name": "a", "weight": 0}]}, r"tenants\[0\]\.weight: Input should be greater than 0"),
])
def test_tier_and_queue_settings_are_checked(cfg: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config(cfg)


def test_default_tiers_and_queue() -> None:
    cfg = parse_config({"tenants": [{"name": "a"}]})
    assert [cfg.tiers[n].priority for n in ("interactive", "standard", "batch")] == [0, 1, 2]
    assert cfg.tenants[0].tier == "standard" and cfg.queue.enabled and cfg.top_tier == "interactive"
    assert cfg.lowest_tier == "batch"


def test_limits_defaults_and_new_keys() -> None:
    cfg = parse_config({})
    assert (cfg.limits.max_n, cfg.limits.max_output_tokens, cfg.limits.model_context_tokens) == (16, None, None)
    cfg = parse_config({"limits": {"max_n": 4, "max_output_tokens": 2048, "model_context_tokens": 8192}})
    assert (cfg.limits.max_n, cfg.limits.max_output_tokens, cfg.limits.model_context_tokens) == (4, 2048, 8192)
    for key in ("max_n", "max_output_tokens", "model_context_tokens"):
        with pytest.raises(ConfigError, match=rf"limits\.{key}: Input should be greater than or equal to 1"):
            parse_config({"limits": {key: 0}})


@pytest.mark.parametrize("text", [
    "tenants:\n  - name: a\n    max_concurrent: 1\n    max_concurrent: 2\n",
    "mode: enforce\nmode: shadow\n",
    "tenants:\n  - name: a\n    name: b\n",
])
def test_duplicate_yaml_keys_are_an_error_naming_key_and_line(tmp_path: Path, text: str) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    key = text.splitlines()[-1].strip().lstrip("- ").split(":")[0]
    line = len(text.splitlines())
    assert f"duplicate key '{key}' on line {line}" in str(e.value) and str(f) in str(e.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    f = tmp_path / "merge.yaml"
    f.write_text("tiers:\n  a: &t {priority: 0, max_queue_wait_ms: 10}\n  b:\n    <<: *t\n    priority: 1\n")
    assert load_config(f).tiers["b"].priority == 1


@pytest.mark.parametrize("text", ["", "\n\n", "# all commented out\n#tenants: []\n", "   \n", "~\n", "---\n"])
def test_an_empty_config_file_is_an_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "empty.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match="config file is empty"):
        load_config(f)


@pytest.mark.parametrize("text", ["just a string\n", "42\n", "- a\n"])
def test_a_top_level_that_is_not_a_mapping_is_an_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "scalar.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f)


def _node(address: str) -> object:
    return parse_config({"nodes": {"static": [{"address": address, "probe": "http://p:9102"}]}})


@pytest.mark.parametrize("address", ["[::1]:8000", "[2001:db8::1]:8000", "[fe80::1%eth0]:80", "vllm-0.vllm:8000",
                                     "10.0.0.7:1", "h:65535"])
def test_node_addresses_accept_host_port_and_bracketed_ipv6(address: str) -> None:
    _node(address)


@pytest.mark.parametrize("address", ["::1:8000", "2001:db8::1:8000", "[::1]", "[nope]:80", "h:0", "h:65536",
                                     "h:99999", "h", "http://h:80", "[::1]8000", "h :80"])
def test_node_addresses_refuse_unbracketed_ipv6_and_bad_ports(address: str) -> None:
    with pytest.raises(ConfigError, match=r"nodes\.static\[0\]\.address"):
        _node(address)


def test_trusted_header_overrides_key_defaults_off() -> None:
    assert parse_config({}).identity.trusted_header_overrides_key is False
    cfg = parse_config({"identity": {"trusted_header": "x-tenant", "trusted_header_overrides_key": True}})
    assert cfg.identity.trusted_header_overrides_key


def test_a_tenant_may_be_named_unknown() -> None:
    cfg = parse_config({"tenants": [{"name": "unknown", "api_key_sha256": [KEY]}]})
    assert cfg.tenant("unknown") is not None
