"""``--metrics`` on an address other hosts can reach: the daemon says so at start, and how to keep it local."""

from __future__ import annotations

import socket

import pytest


def free_port(family: int = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ipv6_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        free_port(socket.AF_INET6, "::")
    except OSError:
        return False
    return True


def exposure_warnings(daemon) -> list[str]:
    return [line for line in daemon.log().splitlines() if " WARNING " in line and "--metrics" in line]


def started_with(daemon_factory, *extra: str):
    daemon = daemon_factory(dram="8M", extra=list(extra)).start()
    assert daemon.stop() == 0
    return daemon


def test_every_address_is_warned_about(daemon_factory):
    port = free_port()
    daemon = started_with(daemon_factory, "--metrics", f"0.0.0.0:{port}")
    [line] = exposure_warnings(daemon)
    assert "other hosts" in line and "0.0.0.0 is every address" in line, line
    assert f"--metrics 127.0.0.1:{port}" in line, line


@pytest.mark.skipif(not ipv6_works(), reason="no IPv6 on this host")
def test_every_ipv6_address_is_warned_about(daemon_factory):
    port = free_port(socket.AF_INET6, "::")
    daemon = started_with(daemon_factory, "--metrics", f"[::]:{port}")
    [line] = exposure_warnings(daemon)
    assert "other hosts" in line and ":: is every address" in line, line


def test_an_address_from_the_config_file_is_warned_about(daemon_factory, tmp_path):
    port = free_port()
    config = tmp_path / "kvstored.toml"
    config.write_text(f'metrics = "0.0.0.0:{port}"\n')
    daemon = started_with(daemon_factory, "--config", str(config))
    [line] = exposure_warnings(daemon)
    assert "other hosts" in line and "loopback" in line, line


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_is_not_warned_about(daemon_factory, host):
    daemon = started_with(daemon_factory, "--metrics", f"{host}:{free_port()}")
    assert exposure_warnings(daemon) == []
    assert "metrics on http://" in daemon.log()
