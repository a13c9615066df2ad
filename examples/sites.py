"""Wrap a model in one line and list its sites.

    python examples/sites.py [--model smollm2-135m] [--filter blocks.3]
"""

import argparse

import conceptlens
from conceptlens import models

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m", help="registered name, local folder or hub id")
parser.add_argument("--filter", default="blocks.3", help="show only sites whose name contains this")
args = parser.parse_args()

lens = conceptlens.attach(*models.load(args.model))       # the one line
print(lens)
for name, site in lens.sites.items():
    if args.filter in name or name in ("embed", "final"):
        print(" ", site.describe())
print(lens.site("blocks.-1.attn.k"))                       # negative indices; post-rotary keys
