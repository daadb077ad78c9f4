"""``kvstored --config FILE``: a daemon started from a TOML file, flags over it, and files it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdrive_client import StoreClient
from kvstored.cli import build_parser, config_from_args, main, parse_args
from kvstored.options import ConfigFileError, load_config_file


class Started:
    """A kvstored started with exactly ``args`` (no --ssd/--dram added), stopped at the end."""

    def __init__(self, root: Path, args: list[str], address: str) -> None:
        self.address = address
        self.log_path = root / "kvstored.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstored", *args], stdout=log, stderr=subprocess.STDOUT)
        self.client = StoreClient(address, timeout=30)
        deadline = time.monotonic() + 60
        while not self.client.ping(timeout=0.5):
            assert self.proc.poll() is None, f"kvstored exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"kvstored did not answer:\n{self.log_path.read_text()}"

    def stop(self) -> int:
        self.client.close()
        self.proc.terminate()
        return self.proc.wait(30)


@pytest.fixture
def started():
    made: list[Started] = []

    def start(root: Path, args: list[str], address: str) -> Started:
        made.append(Started(root, args, address))
        return made[-1]

    yield start
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_daemon_starts_from_the_file_alone(tmp_path, started):
    address = f"ipc://{tmp_path / 'kvstored.sock'}"
    config = write(tmp_path / "kvstored.toml", f"""
ssd = "{tmp_path / 'ssd'}"
dram = "8M"
ssd_max = "2G"          # underscores work as well as dashes
listen = "{address}"
socket-mode = "0600"
no-direct = true
get-workers = 2
""")
    d = started(tmp_path, ["--config", str(config)], address)
    stats = d.client.stats()
    assert stats["dram_bytes"] == 8 << 20 and stats["ssd_max_bytes"] == 2 << 30
    assert stats["ssd_dir"] == str(tmp_path / "ssd") and stats["direct_io"] is False
    assert os.stat(tmp_path / "kvstored.sock").st_mode & 0o777 == 0o600
    assert d.stop() == 0


def test_a_flag_wins_over_the_file(tmp_path, started):
    address = f"ipc://{tmp_path / 'kvstored.sock'}"
    config = write(tmp_path / "kvstored.toml", f'ssd = "{tmp_path / "ssd"}"\ndram = "8M"\nlisten = "{address}"\n'
                                               'ssd-max = "2G"\n')
    d = started(tmp_path, ["--config", str(config), "--dram", "12M"], address)
    stats = d.client.stats()
    assert stats["dram_bytes"] == 12 << 20  # the flag
    assert stats["ssd_max_bytes"] == 2 << 30  # the file, where no flag says otherwise
    assert d.stop() == 0


def test_sizes_may_be_numbers_of_bytes(tmp_path):
    config = write(tmp_path / "k.toml", 'ssd = "/x"\ndram = 1048576\nio-threads = 3\n')
    args = parse_args(build_parser(), ["--config", str(config)])
    assert (args.dram, args.io_threads, args.ssd) == (1048576, 3, "/x")


@pytest.mark.parametrize("text, words", [
    ('ssd = "/x"\ndram = "1G"\ndrams = "2G"\n', ["unknown key 'drams'", "kvstored --help"]),
    ('ssd = "/x"\ndram = "1G"\nio-threads = "8"\n', ["key 'io-threads' must be an integer, got a string"]),
    ('ssd = "/x"\ndram = true\n', ["key 'dram' must be a size"]),
    ('ssd = "/x"\ndram = "1G"\nno-direct = "yes"\n', ["key 'no-direct' must be true or false"]),
    ('ssd = "/x"\ndram = "1G"\nsync = "sometimes"\n', ["key 'sync' must be one of durable, write-behind"]),
    ('ssd = "/x"\ndram = "1G"\nssd-max = "1T"\nssd_max = "2T"\n', ["given twice"]),
    ('ssd = "/x"\nconfig = "/etc/other.toml"\n', ["unknown key 'config'"]),
    ('ssd = /x\n', ["is not valid TOML"]),
])
def test_a_file_it_cannot_use_is_one_line_naming_key_and_file(tmp_path, capsys, text, words):
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigFileError) as info:
        load_config_file(config, build_parser())
    assert str(config) in str(info.value)
    for w in words:
        assert w in str(info.value)
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(config) in err and "Traceback" not in err


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvstored: --config {tmp_path / 'absent.toml'}: cannot read it (No such file or directory)"


def test_ssd_and_dram_are_required_from_somewhere(tmp_path, capsys):
    config = write(tmp_path / "k.toml", 'ssd = "/x"\n')
    with pytest.raises(SystemExit) as info:
        parse_args(build_parser(), ["--config", str(config)])
    assert info.value.code == 2
    assert "--dram is required: give it on the command line or in the --config file" in capsys.readouterr().err
    assert parse_args(build_parser(), ["--config", str(config), "--dram", "1G"]).dram == "1G"


def test_the_readme_example_loads(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## kvstored"):]
    example = section[section.index("```toml\n") + len("```toml\n"):]
    config = write(tmp_path / "readme.toml", example[:example.index("```")])
    args = parse_args(build_parser(), ["--config", str(config)])
    assert (args.ssd, args.dram, args.metrics, args.io_threads) == ("/var/lib/kvstored", "96G", "127.0.0.1:9464", 8)


@pytest.mark.parametrize("text, value", [('dram = 64\n', "64"), ('dram = "12"\n', "'12'")])
def test_a_size_under_a_page_must_say_it_means_bytes(tmp_path, capsys, text, value):
    config = write(tmp_path / "k.toml", f'ssd = "{tmp_path / "s"}"\n' + text)
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"--dram {value} is" in err and "less than a 4 KiB page" in err and "B' if you mean bytes" in err
    assert not (tmp_path / "s").exists()
    sizes = [config_from_args(parse_args(build_parser(), ["--ssd", "/x", "--dram", d])).dram_bytes for d in ("64B", "0", "1G")]
    assert sizes == [64, 0, 1 << 30]


def test_a_refused_start_leaves_no_new_directory(tmp_path):
    """The preflight makes --ssd (and its parents) to try them; a refusal takes them back."""
    ssd = tmp_path / "new" / "store"
    assert main(["--ssd", str(ssd), "--dram", "1024T", "--listen", f"ipc://{tmp_path}/k.sock"]) == 1
    assert not (tmp_path / "new").exists()


def test_dram_0_is_an_ssd_only_tier_and_says_so(daemon_factory):
    d = daemon_factory(dram="0").start()
    assert d.client().stats()["dram_bytes"] == 0
    assert "--dram 0: no DRAM tier; every get reads the SSD" in d.log()
