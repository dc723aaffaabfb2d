"""kdtree-native: DDTree speculative decoding for DeepSeek-V3 / Kimi-K2 models, native core.

Public contract (see docs/DESIGN.md):
    kn.__version__, kn.build_info(), kn.cuda_available()
    kn.save_kdtr / kn.load_kdtr            KDTR container (docs/kdtr.md)
    kn.ops                                 native ops (tree_build, tree_accept, ...)
    kn.reference                           NumPy oracles for every algorithm
    kn.Engine                              the engine (prefill / generate)
"""
from ._loader import load_native as _load_native

_native = _load_native(__path__)

__version__ = _native.build_info()["version"]


def build_info():
    """What this build contains: version, compiler, CUDA on/off and archs, the BLAS used."""
    import platform

    info = dict(_native.build_info())
    ok, why = _native.cuda_available()
    info["cuda_available"] = bool(ok)
    if not ok:
        info["cuda_unavailable_reason"] = why
    else:
        info["cuda_device"] = _native.cuda_device_name()
    info["python"] = platform.python_version()
    return info


def cuda_available():
    """True when the CUDA backend is compiled in and a CUDA device can be used now."""
    ok, _ = _native.cuda_available()
    return bool(ok)


from .kdtr import save_kdtr, load_kdtr  # noqa: E402
from . import reference  # noqa: E402
from . import ops  # noqa: E402
from .engine import Engine  # noqa: E402
from .models import default_model_dir, default_draft_dir  # noqa: E402
from . import drafters  # noqa: E402

__all__ = [
    "__version__",
    "build_info",
    "cuda_available",
    "save_kdtr",
    "load_kdtr",
    "reference",
    "ops",
    "Engine",
    "default_model_dir",
    "default_draft_dir",
    "drafters",
]
