"""``python -m lightning_megatron.checkpoint consolidate PATH OUT`` (and ``info PATH``), on one process."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .consolidate import consolidate
from .errors import CheckpointError
from .folder import check_folder
from .info import read_info


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.checkpoint",
                                     description="Inspect or consolidate a sharded lightning_megatron checkpoint.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="write the single-process state_dict (global names, full tensors)")
    merge.add_argument("path", help="sharded checkpoint folder")
    merge.add_argument("out", help="output file (torch.save of {name: tensor})")
    merge.add_argument("--prefix", default="", help="keep only names under this prefix and strip it (e.g. 'model.')")
    info = commands.add_parser("info", help="print the saved layout and every tensor's global shape")
    info.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            state_dict = consolidate(args.path, args.out, prefix=args.prefix)
            numel = sum(t.numel() for t in state_dict.values())
            print(f"wrote {args.out}: {len(state_dict)} tensors, {numel:,} elements")
        else:
            print(read_info(args.path))
            for key, md in sorted(check_folder(args.path).state_dict_metadata.items()):
                print(f"{key}: {tuple(getattr(md, 'size', ())) if hasattr(md, 'size') else 'object'}")
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
