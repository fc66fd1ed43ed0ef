"""The `wakegate` console script: one subcommand per long-running component.

It sits above both halves (the only module that reaches into wakegate.control and
wakegate.extproc alike). Each subcommand is a process whose `main` module exposes
``add_arguments(parser)`` and ``main(args) -> int``. Only the chosen module is imported (each in its own function below,
where the import linter sees it), so `wakegate sim` does not pay for the Kubernetes client
and `wakegate extproc` stays small.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def _up() -> ModuleType:
    from wakegate.control.up import main

    return main


def _sim() -> ModuleType:
    from wakegate.control.sim import main

    return main


def _extproc() -> ModuleType:
    from wakegate.extproc import main

    return main


def _xds() -> ModuleType:
    from wakegate.control.xds import main

    return main


def _operator() -> ModuleType:
    from wakegate.control.operator import main

    return main


def _scaler() -> ModuleType:
    from wakegate.control.scaler import main

    return main


def _agent() -> ModuleType:
    from wakegate.control.agent import main

    return main


def _extender() -> ModuleType:
    from wakegate.control.extender import main

    return main


def _bench() -> ModuleType:
    from wakegate.control.bench import main

    return main


def _cache() -> ModuleType:
    from wakegate.control.cache import main

    return main


def _catalog() -> ModuleType:
    from wakegate.control.catalog import main

    return main


def _flashload() -> ModuleType:
    from wakegate.control.flashload import main

    return main


def _federation() -> ModuleType:
    from wakegate.control.federation import main

    return main


#: subcommand -> (its process's main module, one-line help)
COMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "up": (_up, "run gateway, feeder and model backends on this machine"),
    "sim": (_sim, "an OpenAI-compatible backend simulator that behaves like vLLM"),
    "extproc": (_extproc, "the Envoy ext_proc server (request path)"),
    "xds": (_xds, "the xDS feeder (ADS server for Envoy and extproc)"),
    "operator": (_operator, "the Kubernetes operator: Model, InferenceRuntime, ModelCache, ModelCatalog, LoRAAdapter"),
    "scaler": (_scaler, "KEDA external-push scaler and demand aggregation"),
    "agent": (_agent, "GPU node agent: labels nodes with accelerator facts, pulls ModelCaches into its cache"),
    "scheduler-extender": (_extender, "kube-scheduler HTTP extender for GPU placement"),
    "bench": (_bench, "measure tokens/s and TTFT of an OpenAI-compatible endpoint"),
    "cache": (_cache, "the model cache: pull, ls, rm, push (OCI registries, Hugging Face Hub)"),
    "catalog": (_catalog, "what OCI registries publish (ls), and a Model manifest for one tag (deploy)"),
    "flash-load": (_flashload, "stage a cached model into fast storage (tmpfs, page cache), verified"),
    "federation": (_federation, "one global gateway over member gateways (Cluster, FederatedModel, GlobalProxy)"),
}


class _HelpWithDefaults(argparse.HelpFormatter):
    """Shows an option's default after its help, unless there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wakegate", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """The argument parser of one subcommand, and its process's main module."""
    load, help_text = COMMANDS[name]
    module = load()
    parser = argparse.ArgumentParser(prog=f"wakegate {name}", description=help_text, formatter_class=_HelpWithDefaults)
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in COMMANDS:
        parser = _top_parser()
        if not args_list or args_list[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if args_list else 2
        parser.error(f"unknown command {args_list[0]!r}; choose one of: {', '.join(COMMANDS)}")
    # Our processes fork children (backends, Envoy) while gRPC threads run; gRPC's fork
    # handlers are for children that keep using gRPC, which ours never do.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    parser, module = command_parser(args_list[0])
    args = parser.parse_args(args_list[1:])
    result: int = module.main(args)
    return result
