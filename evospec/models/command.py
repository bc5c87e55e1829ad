"""``evospec models``: list registered models, or verify and convert one into $EVOSPEC_HOME."""

from __future__ import annotations

import argparse

from evospec.models.registry import REGISTRY


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list or prepare registered models")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("list", help="registered model names and their cache state")
    pull = msub.add_parser("pull", help="verify and convert a registered model into $EVOSPEC_HOME")
    pull.add_argument("name", choices=sorted(REGISTRY))
    m.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from evospec.models.registry import cache_dir, ensure_converted, is_converted

    if args.models_command == "list":
        for name, entry in REGISTRY.items():
            folder = cache_dir(entry)
            state = f"converted at {folder}" if is_converted(folder, entry) else "not converted yet"
            pins = " ".join(f"{p}=={v}" for p, v in entry.packages)
            print(f"{name}\t{pins}\t{entry.license}\t{state}")
        return 0
    print(ensure_converted(REGISTRY[args.name]))
    return 0
