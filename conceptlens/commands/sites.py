"""`conceptlens sites`: list a model's sites with their shapes and sources."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    parser.add_argument("--filter", default="", help="show only sites whose name contains this text")


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens.commands._common import load_model

    model, tokenizer = load_model(args)
    lens = conceptlens.attach(model, tokenizer)
    print(lens)
    for site in lens.sites.values():
        if args.filter in site.name:
            print(" ", site.describe())
    return 0
