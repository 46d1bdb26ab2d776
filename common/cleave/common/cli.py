"""The ``cleave`` command: a dispatcher that imports a subcommand's module only when it runs.

Each image installs one extra of the distribution (docs/images.md): the operator image has no
torch, the runtime image no kopf. So the subcommands are registered here by module path, and
only the one named on the command line is imported: ``cleave operator`` starts without torch,
``cleave worker`` without kopf, and ``cleave --help`` lists every subcommand importing none.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


@dataclass(frozen=True)
class Command:
    name: str
    target: str  # "module:function", the function adds the subcommand's parser
    help: str  # the one line `cleave --help` shows (tests check it matches the module's)
    extra: str  # the extra of the distribution (and so the image) that it needs

    def load(self) -> Callable[[SubParsers], None]:
        module, function = self.target.split(":")
        adder: Callable[[SubParsers], None] = getattr(importlib.import_module(module), function)
        return adder


COMMANDS: tuple[Command, ...] = (
    Command("generate", "cleave.runtime.cli:add_generate_parser",
            "generate text from a prompt with the local engine", "runtime"),
    Command("worker", "cleave.runtime.serving.commands:add_worker_parser",
            "serve one engine (prefill, decode or both) over HTTP", "runtime"),
    Command("router", "cleave.runtime.serving.commands:add_router_parser",
            "the OpenAI-compatible API in front of the workers", "router"),
    Command("download", "cleave.runtime.models.download_cli:add_download_parser",
            "download a Hugging Face hub model into the cache and exit", "router"),
    Command("up", "cleave.runtime.serving.up:add_up_parser",
            "run the whole platform on this machine (redis, workers, router)", "runtime"),
    Command("operator", "cleave.operator.main:add_operator_parser",
            "run the Kubernetes operator for LLMService resources", "operator"),
    Command("simulate", "cleave.autoscaling.simulate_cli:add_simulate_parser",
            "simulate autoscaling of a prefill/decode deployment under a trace", "bench"),
    Command("bench", "cleave.runtime.loadgen.cli:add_bench_parser",
            "load-test an OpenAI-compatible endpoint (Cleave or any other)", "bench"),
)
BY_NAME = {c.name: c for c in COMMANDS}

_EPILOG = """\
Each subcommand needs its image's extra: cleave[runtime] (generate, worker, up), cleave[router]
(router), cleave[operator] (operator), cleave[bench] (bench, simulate plots).
'cleave COMMAND --help' describes one."""


def build_parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; only the subcommands in ``load`` (all when None) import their
    module and get their full parser, the others are listed by name and help alone."""
    parser = argparse.ArgumentParser(
        prog="cleave", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Cleave: disaggregated prefill/decode LLM serving. "
                    "'cleave generate' runs the engine in this process for a quick check.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if load is None or command.name in load:
            command.load()(sub)
        else:
            sub.add_parser(command.name, help=command.help, add_help=False)
    return parser


def _missing(command: Command, error: ModuleNotFoundError) -> int:
    print(f"cleave {command.name}: {error}: this command needs the '{command.extra}' extra "
          f"(pip install 'cleave[{command.extra}]', or the image that has it)", file=sys.stderr)
    return 2


def _is_ours(error: ModuleNotFoundError) -> bool:
    return (error.name or "").partition(".")[0] == "cleave"


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    # The top-level parser has no options but --help, so the first word is the command.
    name = next((a for a in args_in if not a.startswith("-")), None)
    command = BY_NAME.get(name or "")
    try:
        parser = build_parser(load=() if command is None else (command.name,))
    except ModuleNotFoundError as e:
        if command is None or _is_ours(e):
            raise
        return _missing(command, e)
    args = parser.parse_args(args_in)
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(func(args))
    except ModuleNotFoundError as e:
        # A module a subcommand imports only when it runs (kopf, torch, matplotlib).
        if command is None or _is_ours(e):
            raise
        return _missing(command, e)


if __name__ == "__main__":
    sys.exit(main())
