"""Print every process group of a layout: ``python -m lightning_megatron.parallel --world-size 16 --tp 4 --pp 2``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .topology import DEFAULT_ORDER, ParallelConfigError, ParallelLayout


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_megatron.parallel",
        description="Print the process groups of a tensor/pipeline/context/expert parallel layout.",
    )
    parser.add_argument("--world-size", "--world_size", type=int, required=True, dest="world_size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: tp)")
    parser.add_argument("--order", default=DEFAULT_ORDER, help=f"axis order, fastest first (default {DEFAULT_ORDER})")
    parser.add_argument("--rank", type=int, default=None, help="also print this rank's coordinates and groups")
    args = parser.parse_args(argv)
    try:
        layout = ParallelLayout(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                                etp=args.etp, order=args.order)
        print(layout.describe())
        if args.rank is not None:
            print(f"rank {args.rank}: {layout.coords(args.rank)}")
    except ParallelConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
