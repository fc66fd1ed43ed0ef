"""The `wakegate` console script: one subcommand per long-running component.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``. Only the chosen module is imported, so `wakegate sim`
does not pay for the Kubernetes client and `wakegate extproc` stays small.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("wakegate.control.up.main", "run gateway, feeder and model backends on this machine"),
    "sim": ("wakegate.control.sim.main", "an OpenAI-compatible backend simulator that behaves like vLLM"),
    "extproc": ("wakegate.extproc.main", "the Envoy ext_proc server (request path)"),
    "xds": ("wakegate.control.xds.main", "the xDS feeder (ADS server for Envoy and extproc)"),
    "operator": ("wakegate.control.operator.main", "the Kubernetes operator for Model and InferenceRuntime"),
    "scaler": ("wakegate.control.scaler.main", "KEDA external-push scaler and demand aggregation"),
    "agent": ("wakegate.control.agent.main", "GPU node agent: labels nodes with accelerator facts"),
    "scheduler-extender": ("wakegate.control.extender.main", "kube-scheduler HTTP extender for GPU placement"),
    "bench": ("wakegate.control.bench.main", "measure tokens/s and TTFT of an OpenAI-compatible endpoint"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wakegate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in COMMANDS:
        parser = _top_parser()
        if not args_list or args_list[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if args_list else 2
        parser.error(f"unknown command {args_list[0]!r}; choose one of: {', '.join(COMMANDS)}")
    name = args_list[0]
    module_name, help_text = COMMANDS[name]
    # Our processes fork children (backends, Envoy) while gRPC threads run; gRPC's fork
    # handlers are for children that keep using gRPC, which ours never do.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"wakegate {name}: not available in this build", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"wakegate {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(args_list[1:])
    result: int = module.main(args)
    return result
