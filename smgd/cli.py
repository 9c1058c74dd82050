"""Command line: `smgd serve | check-config | wire | mock-engine | bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smgd")
    parser.add_subparsers(dest="command", required=True)
    args = parser.parse_args(argv)
    print(args, file=sys.stderr)
    return 0
