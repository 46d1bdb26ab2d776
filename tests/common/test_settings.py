"""The typed settings: flags, parsing and command lines all come from one declaration."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cleave.common.quantity import format_bytes, parse_bytes
from cleave.common.settings import (
    EngineSettings,
    HttpSettings,
    RedisSettings,
    RouterSettings,
    RoutingSettings,
    ServedSettings,
    StoreSettings,
    WorkerSettings,
)


def _parse(cls: type[WorkerSettings] | type[RouterSettings], argv: list[str]) -> object:
    parser = argparse.ArgumentParser(exit_on_error=False)
    cls.add_arguments(parser)
    return cls.from_args(parser.parse_args(argv))


def test_kubernetes_quantities_and_the_older_spellings_parse_to_bytes() -> None:
    assert parse_bytes("256Mi") == 256 << 20
    assert parse_bytes("2Gi") == 2 << 30
    assert parse_bytes("1.5G") == 1_500_000_000  # decimal suffix: 10^9, as in Kubernetes
    assert parse_bytes("500M") == 500_000_000
    assert parse_bytes("1000") == 1000
    assert parse_bytes("2GiB") == 2 << 30  # the spelling `cleave` took before
    assert parse_bytes("512MiB") == 512 << 20


@pytest.mark.parametrize("bad", ["", "abc", "-1Gi", "0", "1.5", "100m", "2Gx"])
def test_a_size_that_is_not_a_positive_whole_byte_count_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)


@given(st.integers(min_value=1, max_value=1 << 50))
def test_format_bytes_round_trips(value: int) -> None:
    assert parse_bytes(format_bytes(value)) == value


def test_format_bytes_is_the_shortest_binary_quantity() -> None:
    assert format_bytes(256 << 20) == "256Mi"
    assert format_bytes(3 << 30) == "3Gi"
    assert format_bytes(1000) == "1000"


WORKER = WorkerSettings(
    role="prefill", host="0.0.0.0", port=9001, listen_fd=3, grace_period=12.5,
    internal_token_file="/etc/token", served=ServedSettings(("chat",)),
    max_open_requests=5,
    store=StoreSettings(redis=RedisSettings(
                            redis_url="rediss://cleave-worker@r:6379/0",
                            redis_password_file="/etc/pw", redis_tls_ca_file="/etc/ca.pem",
                            redis_tls_server_name="redis.infra"),
                        namespace="svc", kv_ttl_seconds=77, kv_salt_file="/etc/salt",
                        store_timeout=0.5),
    engine=EngineSettings(model="/models/x", revision="v2", dtype="bfloat16", device="cuda",
                          kv_cache_memory=256 << 20, max_num_seqs=3, max_batched_tokens=99,
                          max_model_len=1024, threads=2, tensor_parallel_size=2),
    http=HttpSettings(header_read_timeout=7.5))
ROUTER = RouterSettings(
    model="m", revision="abc", served=ServedSettings(("-chat", "chat-v2", "chat")),
    prefill=("dns+http://p:8100",),
    decode=("http://a:1", "http://b:2"), workers_file="/w.json", host="0.0.0.0", port=8080,
    listen_fd=4,
    max_model_len=77, redis=RedisSettings(redis_url="rediss://r:1/0", redis_password_file="/pw",
                                          redis_tls_ca_file="/ca", redis_tls_server_name="n"),
    routing=RoutingSettings(disaggregate_min_tokens=0, kv_load_failure_policy="fail",
                            request_timeout=9.0, max_concurrent_requests=7, hold_timeout=0.0,
                            api_key_file="/key", ttft_target=0.5),
    http=HttpSettings(header_read_timeout=3.0))


@pytest.mark.parametrize("settings", [WORKER, WorkerSettings(), ROUTER, RouterSettings(),
                                      RouterSettings(served=ServedSettings(("",)))])
def test_to_args_then_from_args_gives_the_same_settings(settings: object) -> None:
    assert _parse(type(settings), settings.to_args()) == settings  # type: ignore[attr-defined]


def test_every_non_default_field_reaches_the_command_line() -> None:
    """A field to_args left out would silently fall back to its default in the process."""
    def leaves(s: object) -> list[str]:
        out = []
        for f in fields(s):  # type: ignore[arg-type]
            value = getattr(s, f.name)
            out += leaves(value) if hasattr(value, "to_args") else [f.name]
        return out
    flags = {arg.split("=", 1)[0] for arg in WORKER.to_args()}
    for name in leaves(WORKER):
        assert "--" + name.replace("_", "-") in flags


def test_defaults_are_left_off_the_command_line() -> None:
    assert WorkerSettings().to_args() == []
    assert WorkerSettings(port=1).to_args() == ["--port=1"]


def test_the_real_cli_parses_what_to_args_writes() -> None:
    """The `cleave worker` and `cleave router` parsers read back every value to_args wrote."""
    from cleave.common.cli import build_parser

    for command, settings in (("worker", WORKER), ("router", ROUTER)):
        args = build_parser(load=[command]).parse_args([command, *settings.to_args()])
        assert type(settings).from_args(args) == settings


def test_several_served_names_parse_as_vllm_writes_them_and_as_to_args_writes_them() -> None:
    """vLLM's spelling (one flag, several names) and to_args' (the flag once per name) read
    back the same names, in order: the first is the one responses and metrics carry."""
    from cleave.common.cli import build_parser

    names = ("tiny-v2", "tiny", "-dash")
    written = RouterSettings(served=ServedSettings(names)).to_args()
    assert written == [f"--served-model-name={n}" for n in names]
    for argv in (["--served-model-name", "tiny-v2", "tiny", "--port", "1"], written):
        args = build_parser(load=["router"]).parse_args(["router", *argv])
        assert RouterSettings.from_args(args).served.served_model_name[:2] == names[:2]
    assert ServedSettings(names).names("m") == names
    assert ServedSettings().names("m") == ServedSettings(("",)).names("m") == ("m",)


def test_a_bad_quantity_flag_is_a_usage_error() -> None:
    with pytest.raises(argparse.ArgumentError, match="kv-cache-memory"):
        _parse(WorkerSettings, ["--kv-cache-memory", "lots"])
