"""The smgd command line: serve, check-config, init, status, reload, wire, mock-engine, bench.

Flags for the fixed config sections are generated from the schema in :mod:`smgd.config`
(one schema, no second hand-written copy), and ``--set key.path=value`` reaches any key.
The config file is the first of ``--config``, ``$SMGD_CONFIG``, ``./smgd.toml``; with none of
them, the built-in default (the packaged smgd.toml: mock engine, tiny model) is used.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from smgd import __version__, assets
from smgd.config import Config, check_secrets, load_config, scalar_flags
from smgd.errors import ConfigError, SmgdError
from smgd.logs import announce, flush_logs, setup_logging

DEFAULT_CONFIG = "smgd.toml"
EXIT_CONFIG = 2  # a bad config file / flag: exit 2, like argparse's usage errors


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default=None,
        help=f"config file (default: $SMGD_CONFIG, else ./{DEFAULT_CONFIG}, else the built-in "
        "default)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any key, e.g. --set engines.0.mock.step_ms=5",
    )
    group = parser.add_argument_group("config overrides (generated from the schema)")
    for flag, dotted, _typ in scalar_flags():
        group.add_argument(
            flag, dest=f"cfg:{dotted}", default=None, metavar="VALUE", help=f"sets {dotted}"
        )


def _overrides(args: argparse.Namespace) -> list[str]:
    items = list(args.set)
    for key, value in vars(args).items():
        if key.startswith("cfg:") and value is not None:
            items.append(f"{key[4:]}={value}")
    return items


def _config_path(args: argparse.Namespace, positional: str | None = None) -> tuple[str, bool]:
    """(the config file to read, whether it is the built-in default)."""
    named = positional or args.config or os.environ.get("SMGD_CONFIG")
    if named:
        return named, False
    if Path(DEFAULT_CONFIG).exists():
        return DEFAULT_CONFIG, False
    return str(assets.DEFAULT_CONFIG), True


def load_from_args(args: argparse.Namespace, positional: str | None = None) -> Config:
    path, _ = _config_path(args, positional)
    return load_config(path, overrides=_overrides(args))


_BUILTIN_NOTE = (
    "no config file (no --config, $SMGD_CONFIG or ./smgd.toml): using the built-in default "
    "%s (mock engine, packaged tiny model); `smgd init` writes it out to edit"
)


def _check_startable(config: Config) -> None:
    """What serve checks of a loaded config before it launches anything, for check-config:
    every engine's tokenizer and chat template load (smgd.gateway), and every engine's client
    can be built (a context length known). Nothing is bound, launched or connected."""
    from smgd.gateway import Gateway  # the text and engine layers: only what checks pays for them
    from smgd.supervise import build_engine_client

    gateway = Gateway.from_config(config)
    for engine in config.engines:
        build_engine_client(engine, config, gateway.texts)


def _cmd_check_config(args: argparse.Namespace) -> int:
    path, builtin = _config_path(args, args.path)
    config = load_config(path, overrides=_overrides(args))
    check_secrets(config)  # as serve does: a configured key source without a key is an error
    _check_startable(config)
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(config), indent=2).decode() + "\n")
    if builtin:
        print("smgd: " + _BUILTIN_NOTE % path, file=sys.stderr)
    print(f"ok: {len(config.engines)} engine(s)", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from smgd.daemon import serve_main  # the whole daemon: only `serve` pays for importing it

    path, builtin = _config_path(args)
    overrides = _overrides(args)
    config = load_config(path, overrides=overrides)
    setup_logging(config.logging)  # the config is valid: from here on, lines in its format
    try:
        try:
            check_secrets(config)  # before anything starts or listens
        except ConfigError as exc:
            announce(f"smgd: {exc.one_line()}", level=logging.ERROR)
            return EXIT_CONFIG
        if builtin:
            logging.getLogger("smgd").info(_BUILTIN_NOTE, path)
        return serve_main(config, config_path=path, overrides=overrides)
    finally:
        flush_logs()  # the writer thread's last lines (a fatal error's too), within a bound


def _cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.is_dir():
        target /= DEFAULT_CONFIG
    if target.exists() and not args.force:
        raise SmgdError(f"{target} exists; use --force to overwrite it")
    try:
        target.write_text(assets.DEFAULT_CONFIG.read_text())
    except OSError as exc:
        raise SmgdError(f"cannot write {target}: {exc.strerror}") from None
    start = (
        "smgd serve"
        if target.resolve() == Path(DEFAULT_CONFIG).resolve()
        else f"smgd serve -c {target}"
    )
    print(
        f"wrote {target} (the built-in default, commented); edit it, then: {start}", file=sys.stderr
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from smgd.status import status_main

    if args.watch is not None and args.watch <= 0:
        raise SystemExit("smgd status: --watch needs a positive number of seconds")
    return status_main(load_from_args(args), watch=args.watch, url=args.url)


def _cmd_reload(args: argparse.Namespace) -> int:
    from smgd.status import reload_main

    return reload_main(load_from_args(args))


def _cmd_wire(args: argparse.Namespace) -> int:
    from smgd.wire.command import run_wire_command

    return run_wire_command(args.action, args.engine, sys.stdin.read(), sys.stdout)


def _cmd_mock_engine(args: argparse.Namespace) -> int:
    from smgd.mock.main import mock_engine_main

    return mock_engine_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    module: Any = importlib.import_module("smgd.bench.main")
    result: int = module.bench_main(args)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smgd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"smgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    _add_config_args(serve)
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser("check-config", help="validate a config and print it resolved")
    check.add_argument("path", nargs="?", default=None, help="config file (same as --config)")
    _add_config_args(check)
    check.set_defaults(func=_cmd_check_config)

    init = sub.add_parser("init", help="write the default smgd.toml (commented) to edit")
    init.add_argument(
        "path",
        nargs="?",
        default=DEFAULT_CONFIG,
        help=f"file or directory (default: ./{DEFAULT_CONFIG})",
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_cmd_init)

    status = sub.add_parser("status", help="show a running daemon's engines, load and errors")
    _add_config_args(status)
    status.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS"
    )
    status.add_argument(
        "--url", default=None, help="the daemon's public URL for /metrics (default: from config)"
    )
    status.set_defaults(func=_cmd_status)

    reload = sub.add_parser("reload", help="make a running daemon re-read its config")
    _add_config_args(reload)
    reload.set_defaults(func=_cmd_reload)

    wire = sub.add_parser("wire", help="decode/encode one engine wire message (hex <-> JSON)")
    wire.add_argument("action", choices=["decode", "encode"])
    wire.add_argument("--engine", required=True, choices=["sglang", "vllm", "tokenspeed"])
    wire.set_defaults(func=_cmd_wire)

    mock = sub.add_parser("mock-engine", help="run a mock engine scheduler on a wire")
    from smgd.mock.main import add_mock_args

    add_mock_args(mock)
    mock.set_defaults(func=_cmd_mock_engine)

    try:
        bench_module: Any = importlib.import_module("smgd.bench.main")
    except ImportError:
        bench_module = None
    if bench_module is not None:
        bench = sub.add_parser("bench", help="benchmark smgd against baselines on a mock engine")
        bench_module.add_bench_args(bench)
        bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except ConfigError as exc:
        print(f"smgd: {exc.one_line()}", file=sys.stderr)
        return EXIT_CONFIG
    except SmgdError as exc:
        print(f"smgd: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return result
