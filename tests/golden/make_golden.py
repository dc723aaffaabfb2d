"""Write every golden KDTR file the C++ tests read.

Each tests/golden/golden_<area>.py module defines ``generate(out_dir)``; this script runs them
all (or those named with --only). Run by ctest as the `make_golden` fixture.
"""
import argparse
import importlib.util
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    names = sorted(f[len("golden_"):-3] for f in os.listdir(here) if f.startswith("golden_") and f.endswith(".py"))
    if args.only:
        names = [n for n in names if n in args.only]
    for name in names:
        spec = importlib.util.spec_from_file_location(f"golden_{name}", os.path.join(here, f"golden_{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        t0 = time.perf_counter()
        mod.generate(args.out)
        print(f"golden {name}: {time.perf_counter() - t0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
