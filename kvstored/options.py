"""``kvstored --config FILE``: the command line's options, read from a TOML file.

A key is an option's long name without the dashes, spelt with dashes or underscores
(``ssd-max`` or ``ssd_max``); its value has the type the option takes: a string, an
integer for counts (``io-threads = 8``), a boolean for a flag (``no-direct = true``),
an array of strings for a repeatable option (``quota = ["vllm/*=200G"]``), and for a
size either a string with a unit (``dram = "96G"``) or a number of bytes.
The file's values become the parser's defaults, so a flag on the command line wins.
Anything else (a key no option has, a value of the wrong type, a choice not offered)
is a :class:`ConfigFileError` naming the key and the file.

The connection limits' options are declared here too (:func:`add_connection_options`).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from kvstored.limits import ConnectionLimits

# Options a file may not set: they are about this invocation, not the daemon.
_NOT_IN_FILE = {"help", "config"}


class ConfigFileError(ValueError):
    """A config file kvstored cannot use; the message names the file and the key."""


def file_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name (``ssd-max``) -> its action, for every option a file may set."""
    out = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its options
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in _NOT_IN_FILE:
            out[longs[0][2:]] = action
    return out


def load_config_file(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, object]:
    """The options ``path`` sets, as ``{dest: value}`` ready for ``parser.set_defaults``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"--config {path} is not valid TOML: {exc}") from None
    options = file_options(parser)
    values: dict[str, object] = {}
    seen: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        action = options.get(name)
        if action is None:
            known = ", ".join(sorted(options))
            raise ConfigFileError(f"{path}: unknown key {key!r}; the keys are the long options of kvstored --help: {known}")
        if name in seen:
            raise ConfigFileError(f"{path}: key {key!r} is given twice (also as {seen[name]!r}); keep one")
        seen[name] = key
        values[action.dest] = _checked(path, key, value, action)
    return values


def _checked(path: Path, key: str, value: object, action: argparse.Action) -> object:
    def wrong(expected: str) -> ConfigFileError:
        return ConfigFileError(f"{path}: key {key!r} must be {expected}, got {_type_name(value)} {value!r:.60}")

    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - a repeatable option such as --quota
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong(f"an array of strings such as [\"{action.metavar}\"]")
        return value
    if action.nargs == 0:  # a flag such as --no-direct
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if action.type is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong("an integer")
        return value
    if action.metavar == "SIZE":
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise wrong('a size: a string such as "96G" or a number of bytes')
        return value
    if not isinstance(value, str):
        raise wrong("a string")
    if action.choices is not None and value not in action.choices:
        raise ConfigFileError(f"{path}: key {key!r} must be one of {', '.join(map(str, action.choices))}, got {value!r:.60}")
    return value


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- connection limits

_FITTED = "; lowered to fit the descriptor limit (kvstored raises its soft RLIMIT_NOFILE to the hard one at start)"
CONNECTION_OPTIONS = (
    ("--max-connections", "max_connections",
     "ZeroMQ connections held at once; past it a new one is shut down or refused in its handshake" + _FITTED),
    ("--max-connections-per-uid", "max_connections_per_uid",
     "ZeroMQ connections one uid may hold (ipc); at most half of --max-connections, so other users "
     "always have room" + _FITTED),
    ("--max-session-connections", "max_session_connections",
     "session-socket connections held at once; past it a new one gets 'busy' and is closed" + _FITTED),
    ("--max-session-connections-per-uid", "max_session_connections_per_uid",
     "session-socket connections one uid may hold; less than --max-session-connections, so other users "
     "always have room"),
    ("--session-open-timeout", "session_open_timeout",
     "seconds a session-socket connection may stay open without opening a session"),
)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """The options of :class:`~kvstored.limits.ConnectionLimits`, each defaulting to its field."""
    defaults = ConnectionLimits()
    for flag, name, text in CONNECTION_OPTIONS:
        default = getattr(defaults, name)
        parser.add_argument(flag, dest=name, type=int, default=default, metavar="N", help=f"{text} (default: {default})")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The parsed options as limits; ValueError naming the option for a value kvstored cannot use."""
    return ConnectionLimits(**{name: getattr(args, name) for _, name, _ in CONNECTION_OPTIONS})
