"""Locate and import the compiled core ``kdtree_native._native``.

For development, ``KDTREE_NATIVE_EXT_DIR=<cmake build dir>`` makes the package import the
``_native`` module built there (``cmake -S . -B build/dev -DKDTREE_BUILD_PYTHON=ON``) instead of
the installed one, so several builds can live side by side without reinstalling.
"""
import os


def load_native(package_path):
    ext_dir = os.environ.get("KDTREE_NATIVE_EXT_DIR")
    if ext_dir:
        package_path.insert(0, os.path.abspath(ext_dir))
    from . import _native  # noqa: F401  (resolved through package __path__)

    return _native
