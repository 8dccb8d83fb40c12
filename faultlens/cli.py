"""The ``faultlens`` command.

Each subcommand lives in ``faultlens/commands/<name>.py`` and exposes ``HELP``
(one line), ``EXAMPLE`` (shown in ``--help``), ``add_arguments(parser)`` and
``run(args, config) -> int``. Modules are imported only when their command
runs, so ``faultlens agent`` never imports the UI or the models.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from faultlens import __version__, lifeline, logsafe
from faultlens.config import load_config
from faultlens.decode import TimeBounds, set_time_bounds
from faultlens.errors import FaultlensError

COMMANDS = {
    "demo": "run the whole pipeline on a simulated cluster with injected faults",
    "agent": "node agent: stream NVML, kernel, NCCL, step and stack signals to Kafka",
    "stream": "stream processor: Kafka topics -> Parquet lake with DuckDB views",
    "diagnose": "diagnose online (from Kafka) or a batch input directory",
    "explain": "classify every line of raw logs and say what to do",
    "runner": "execute actions through an adapter (dry-run, slurm, kubernetes, command)",
    "guard": "guard rails: breakers and eviction counts (status), a person's reset",
    "keys": "make the signing key of actions and agent commands",
    "ui": "Streamlit incident explorer over the lake",
    "report": "render a root-cause report (HTML or Markdown) for a job",
    "train": "train the fault classifier on simulator suites or labelled incidents",
    "simulate": "simulated training cluster with fault injection and ground truth",
    "bench": "run the benchmarks in benchmarks/",
}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written; each default said once: not where the help text already
    says it ("default: lake.path"), nor for None (no default) or a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def _common(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE", help="TOML configuration file (default: ./faultlens.toml if present)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one configuration key; repeatable")
    g.add_argument("--bootstrap-servers", dest="bootstrap_servers", metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers (env FAULTLENS_BOOTSTRAP); none: the embedded broker")
    g.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser(names: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``names``, only those commands' modules are imported."""
    parser = argparse.ArgumentParser(
        prog="faultlens",
        description="Find the faulty machine in a GPU training job, say why, and tell the runner what to do.",
        epilog="example:\n  faultlens explain /var/log/kern.log\n  faultlens diagnose ./run-dir --out ./diag",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"faultlens {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in names or list(COMMANDS):
        help_text = COMMANDS[name]
        module = _module(name) if names else None
        example = getattr(module, "EXAMPLE", f"faultlens {name} --help")
        p = sub.add_parser(
            name,
            help=help_text,
            description=getattr(module, "HELP", help_text) if module or not names else f"{help_text} (not built yet)",
            epilog=f"example:\n  {example}",
            formatter_class=_Formatter,
        )
        _common(p)
        if module is not None:
            module.add_arguments(p)
    return parser


def command_name() -> str:
    """How to run faultlens again from a new shell in this directory: ``faultlens`` when that is on
    PATH and is this installation, else this installation's script (``.venv/bin/faultlens``)."""
    import os
    import shutil
    from pathlib import Path

    here = Path(sys.executable).with_name("faultlens")
    found = shutil.which("faultlens")
    if found and here.exists() and Path(found).resolve() == here.resolve():
        return "faultlens"
    if here.exists():
        try:
            rel = os.path.relpath(here)
        except ValueError:  # another drive
            rel = str(here)
        return rel if not rel.startswith("..") else str(here)
    return f"{sys.executable} -m faultlens.cli"


def _module(name: str):  # noqa: ANN202 - a module or None
    try:
        return importlib.import_module(f"faultlens.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"faultlens.commands.{name}":
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lifeline.watch_parent()  # started by a faultlens parent (demo, a benchmark): end with it
    # Only the named command's module is imported: peek at the command first.
    name = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([name] if name in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    # Every handler escapes control characters and redacts secrets, third-party loggers' records included.
    logsafe.install(getattr(logging, args.log_level))
    module = _module(args.command)
    if module is None:
        print(f"faultlens {args.command}: not built yet", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, overrides=args.overrides, flags={"bus.bootstrap_servers": args.bootstrap_servers})
        logsafe.register_secrets(config.secrets())
        set_time_bounds(TimeBounds.from_config(config))  # every decoder of this process: [time] bounds
        return int(module.run(args, config) or 0)
    except FaultlensError as exc:
        print(f"faultlens {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
