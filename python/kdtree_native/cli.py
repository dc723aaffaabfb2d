"""The ``kdtree-native`` command line."""
import argparse
import json
import sys


def _cmd_info(args):
    import kdtree_native as kn

    info = kn.build_info()
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="kdtree-native", description="DDTree speculative decoding engine")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("info", help="print what this build contains")
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 0
    return {"info": _cmd_info}[args.cmd](args)
