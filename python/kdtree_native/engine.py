"""kn.Engine: the target model loaded from an HF checkpoint directory, on a native backend.

Where it sits: the public entry point (docs/DESIGN.md section 5). `Engine.from_pretrained`
parses config.json (config.py), memory-maps the safetensors (checkpoint.py), uploads every
tensor into the native model (`_native.CpuModel`, cpp/model/) one at a time, dropping the
Python copy as soon as it is uploaded, and finalizes it. docs/MODEL.md describes the model.

    eng = kn.Engine.from_pretrained(model_dir, device="cpu", max_seq_len=4096)
    logits = eng.prefill(prompt_ids)                # float32 [len, vocab]; resets the cache
    # low level (the engine loop, tests): any T new tokens against the cache
    logits = eng.forward(tokens, positions, visibility=None)   # None = causal; pending
    eng.commit(keep)                                 # keep pending entries, packed
    eng.truncate(n)                                  # roll the cache back to its first n entries
    eng.reset(); eng.cache_len
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Optional, Union

import numpy as np

from . import _native
from .checkpoint import PackedInt4, int4_experts_group, iter_weights, matrices_not_bf16
from .config import ModelConfig, load_config

__all__ = ["Engine"]

_DEVICES = ("auto", "cpu", "cuda")
# keyword arguments of _native.CudaModel that an Engine passes through (docs/CUDA_MODEL.md)
_CUDA_OPTIONS = ("max_tokens", "device", "math", "attention_naive", "expert_kernel", "graphs", "skinny_max_tokens",
                 "attention_kernel", "side_stream", "skinny_big_max_tokens", "tile_max_tokens",
                 "tile_tensor_cores", "expert_mma_rows", "bf16_weight_copies", "uv_combine_max_tokens",
                 "context_buckets", "combine_norm", "bf16_weights", "bf16_widen_elements", "int4_experts_group",
                 "fp32_matrices", "row_exact", "q_fold_max_tokens")


# keyword arguments of _native.CpuModel that an Engine passes through (docs/MODEL.md)
_CPU_OPTIONS = ("bf16_weights", "bf16_weight_copies")
_BOOL_OPTIONS = ("attention_naive", "graphs", "side_stream", "tile_tensor_cores", "bf16_weight_copies",
                 "combine_norm", "row_exact")


def _check_options(options, known, what) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"{what} must be a dict or None, got {type(options).__name__}")
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {list(known)}")
    for k, v in options.items():  # (pybind would take 3.5 as True for a bool)
        if k in _BOOL_OPTIONS and not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{what}: {k} must be True or False, got {v!r}")
    return dict(options)


def _check_cuda_options(options) -> dict:
    return _check_options(options, _CUDA_OPTIONS, "cuda_options")


def _check_cpu_options(options) -> dict:
    return _check_options(options, _CPU_OPTIONS, "cpu_options")


def _progress_printer(done: int, total: int) -> None:
    if done == total or done % max(1, total // 20) == 0:
        print(f"\rloading weights: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _resolve_device(device: str) -> str:
    if not isinstance(device, str) or device not in _DEVICES:
        raise ValueError(f"device must be one of {list(_DEVICES)}, got {device!r}")
    if device == "cuda":
        if not hasattr(_native, "CudaModel"):
            raise NotImplementedError(
                "device='cuda': this build has no CUDA target model (built without nvcc or without the cuBLAS "
                "headers: see `kdtree-native info`); reinstall with KDTREE_CUDA=ON, or use device='cpu' (or 'auto')")
        ok, why = _native.cuda_available()
        if not ok:
            raise RuntimeError(f"device='cuda' requested but no CUDA device can be used: {why}")
        return "cuda"
    if device == "auto":
        if hasattr(_native, "CudaModel") and _native.cuda_available()[0]:
            return "cuda"
        return "cpu"
    return "cpu"


class Engine:
    """The target model on one device, with its latent KV cache.

    Attributes: `device` ("cpu" / "cuda"), `config` (the parsed ModelConfig), `max_seq_len`,
    `model` (the native model object), `model_dir`.
    """

    def __init__(self, model, config: ModelConfig, device: str, max_seq_len: int, model_dir: Optional[str] = None):
        self.model = model
        self.config = config
        self.device = device
        self.max_seq_len = int(max_seq_len)
        self.model_dir = model_dir
        # one call at a time (_one_call): prefill / decode / generate are sequences of model calls that another
        # thread's calls must not interleave with (the native model refuses overlapping calls one by one too)
        self._busy = threading.Lock()
        self._holder = ""

    def _acquire(self, what: str):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{what}: this Engine is busy with {self._holder or 'another call'} (another thread, "
                               "a drafter / progress callback of a running generate, or an open stream): an Engine "
                               "runs one call at a time; use one Engine per thread")
        self._holder = what

    def _release(self):
        self._holder = ""
        self._busy.release()

    @contextmanager
    def _one_call(self, what: str):
        self._acquire(what)
        try:
            yield
        finally:
            self._release()

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir, device: str = "auto", max_seq_len: int = 4096,
                        progress: Union[None, bool, Callable[[int, int], None]] = None,
                        cuda_options: Optional[dict] = None, cpu_options: Optional[dict] = None,
                        check_finite: bool = True) -> "Engine":
        """Load an HF DeepSeek-V3 / Kimi-K2 checkpoint directory (config.json +
        model.safetensors or shards with model.safetensors.index.json; F32/BF16/F16).

        device: "cpu", "cuda" (the CUDA model when it is built in and a device is usable:
        NotImplementedError without a CUDA model, RuntimeError without a device) or "auto"
        (CUDA when available, else CPU). max_seq_len: the KV cache capacity in tokens.
        progress: None, True (print to stderr) or a callable(done, total) per tensor.
        cuda_options: keyword arguments for the GPU model when the engine runs on CUDA (ignored
        on the CPU), e.g. {"device": 1} for the second GPU, {"max_tokens": 257} for trees of up
        to 256 nodes, {"skinny_max_tokens": 0, "tile_max_tokens": 0} for cuBLAS only, {"bf16_weights": ...} how a BF16
        checkpoint's matrices are held: "only" (the default when any matrix is stored as BF16 and the
        shapes allow it: BF16 alone, 2 bytes a weight; those stored otherwise held as FP32, the
        "fp32_matrices" the checkpoint's headers name), "copies" (FP32 plus a BF16 copy, 6 bytes; the
        default otherwise), "off" (FP32); the same logits (docs/CUDA_MODEL.md "BF16 weights");
        {"int4_experts_group": g} holds the routed experts as 4-bit integers in groups of g (the default, with
        g from the checkpoint, when every routed expert is stored in Kimi K2-Thinking's INT4 scheme; 0 turns it
        off: the experts dequantized; docs/CUDA_MODEL.md "INT4 experts"); unknown names are a ValueError.
        cpu_options: keyword arguments for the CPU model (ignored on CUDA): "bf16_weights"
        says how a BF16 checkpoint's weight matrices are held: "only" (the default: as BF16, 2
        bytes a weight), "copies" (FP32 plus BF16 copies, 6 bytes) or "off" (FP32, 4 bytes, slower
        decode); the logits are the same bits in all three (docs/MODEL.md). The older
        {"bf16_weight_copies": False} is "off". Unknown names are a ValueError.
        check_finite: refuse a weight tensor holding NaN or an infinity (ValueError naming the
        tensor and the index: such a model's logits are NaN and every token garbage); False
        skips the scan (it adds ~0.13 s per GB of float32 weights on a 2-core VM), e.g. to study
        what a broken checkpoint does.
        Raises FileNotFoundError / ValueError naming the problem for a bad directory, config
        or checkpoint.
        """
        model_dir = os.fspath(model_dir)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or not 0 < max_seq_len <= 2**31 - 1:
            raise ValueError(f"max_seq_len must be an integer in [1, 2**31 - 1], got {max_seq_len!r}")
        if progress is True:
            progress = _progress_printer
        elif progress is False:
            progress = None
        elif progress is not None and not callable(progress):
            raise ValueError("progress must be None, True/False or a callable(done, total)")
        device = _resolve_device(device)
        cuda_options = _check_cuda_options(cuda_options)
        cpu_options = _check_cpu_options(cpu_options)
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
        cfg = load_config(model_dir)
        # (checked whole here; then read one tensor at a time as the model takes them)
        # (a CPU model takes a BF16 tensor as its bits: no float32 copy of it is made at all)
        # and a 4-bit group-quantized one packed, as it is stored (docs/MODEL.md)
        if device == "cuda" and "int4_experts_group" not in cuda_options:
            # Kimi K2-Thinking's INT4 experts: held as their 4-bit integers on the GPU too (0.56 bytes a weight)
            group = int4_experts_group(model_dir, cfg)
            if group is not None and not _native.cuda_int4_experts_unsupported(
                    cfg.to_native(), group, cuda_options.get("expert_kernel", "auto")):
                cuda_options = dict(cuda_options, int4_experts_group=group)
        g = cuda_options.get("int4_experts_group", 0)
        int4 = device == "cpu" or (isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g > 0)
        if device == "cuda" and "bf16_weight_copies" not in cuda_options and cuda_options.get("bf16_weights") in (None, "only"):
            # a BF16 checkpoint: its matrices held as BF16 alone (2 bytes a weight, not FP32 + a BF16 copy: 6), those it
            # stores otherwise (a few F32 routers, say) as FP32 (fp32_matrices)
            fp32 = matrices_not_bf16(model_dir, cfg, int4_experts=int4)
            n_mat = sum(1 for _, s in _native.model_weight_specs(cfg.to_native()) if len(s) == 2)
            if cuda_options.get("bf16_weights") == "only" or (
                    len(fp32) < n_mat and not _native.cuda_bf16_only_unsupported(
                        cfg.to_native(), cuda_options.get("tile_tensor_cores", True),
                        cuda_options.get("expert_kernel", "auto"))):
                cuda_options = dict(cuda_options, bf16_weights="only")
                if fp32 and "fp32_matrices" not in cuda_options:
                    cuda_options["fp32_matrices"] = fp32
        # A CUDA model holding BF16 weights only takes them as bits too (its matrices go over as they are).
        bits = device == "cpu" or cuda_options.get("bf16_weights") == "only"
        weights = iter_weights(model_dir, cfg, progress=progress, bf16_bits=bits, int4_packed=int4)
        eng = cls._build(cfg, weights, device, int(max_seq_len), cuda_options, cpu_options, bool(check_finite),
                         bf16_bits=bits)
        eng.model_dir = model_dir
        return eng

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict, device: str = "cpu", max_seq_len: int = 4096,
                     cuda_options: Optional[dict] = None, cpu_options: Optional[dict] = None,
                     check_finite: bool = True) -> "Engine":
        """An engine from a parsed config and {HF name: array} (any float dtype; converted to
        float32). The dict is left intact. For tests and tools that make weights in memory.
        cuda_options, cpu_options, check_finite: as in from_pretrained."""
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or not 0 < max_seq_len <= 2**31 - 1:
            raise ValueError(f"max_seq_len must be an integer in [1, 2**31 - 1], got {max_seq_len!r}")
        options = _check_cuda_options(cuda_options)
        cpu = _check_cpu_options(cpu_options)
        return cls._build(config, dict(weights), _resolve_device(device), int(max_seq_len), options, cpu,
                          bool(check_finite))

    @classmethod
    def _build(cls, cfg: ModelConfig, weights, device: str, max_seq_len: int,
               cuda_options: Optional[dict] = None, cpu_options: Optional[dict] = None,
               check_finite: bool = True, bf16_bits: bool = False) -> "Engine":
        """weights: a dict {name: array} (emptied as it is uploaded), or an iterator of (name, array)
        pairs already checked against the config (checkpoint.iter_weights). bf16_bits: uint16 arrays
        are BF16 bits (iter_weights(bf16_bits=True); a CPU model, or a CUDA model with
        bf16_weights="only")."""
        opts, what = (cuda_options, "cuda_options") if device == "cuda" else (cpu_options, "cpu_options")
        if isinstance(weights, dict):
            # (before the model is built: its buffers are sized from the config alone)
            missing = [n for n, _ in _native.model_weight_specs(cfg.to_native()) if n not in weights]
            if missing:
                raise ValueError(f"{len(missing)} weight tensor(s) missing: " + ", ".join(missing[:20])
                                 + (" ..." if len(missing) > 20 else ""))
        try:
            if device == "cuda":
                model = _native.CudaModel(cfg.to_native(), max_seq_len, **(opts or {}))
            else:
                model = _native.CpuModel(cfg.to_native(), max_seq_len, **(opts or {}))
        except TypeError:  # pybind's signature dump names the whole config: say what was wrong
            types = {k: type(v).__name__ for k, v in (opts or {}).items()}
            raise ValueError(f"{what}: a value of the wrong type in {opts!r} (types {types}; booleans for "
                             "switches, integers for sizes and counts, strings for kernel names: "
                             "docs/MODEL.md, docs/CUDA_MODEL.md)") from None
        # Upload one tensor at a time and drop the Python side right away (F32 tensors are
        # views of the mmap'd file, BF16/F16 ones are widened to float32 one at a time by
        # iter_weights; the CPU model holds an exactly-BF16 one as BF16 as it arrives).
        def pairs():
            if isinstance(weights, dict):
                for name in list(weights):
                    yield name, weights.pop(name)
            else:
                yield from weights

        for name, arr in pairs():
            if isinstance(arr, PackedInt4):  # (iter_weights(int4_packed=True): the CPU, or a GPU with INT4 experts)
                model.set_weight_int4(name, arr.packed, arr.scales, arr.group)
            elif bf16_bits and arr.dtype == np.uint16:  # BF16 bits (iter_weights(bf16_bits=True))
                model.set_weight_bf16(name, arr, check_finite)
            else:
                model.set_weight(name, np.ascontiguousarray(arr, dtype=np.float32), check_finite)
            del arr
        model.finalize()
        return cls(model, cfg, device, max_seq_len)

    # ---- the one entry point --------------------------------------------------------------
    def forward(self, tokens, positions, visibility=None) -> np.ndarray:
        """Logits float32 [T, V] of T new tokens at `positions` (RoPE positions, usually
        cache_len + depth) against the committed cache. visibility bool/uint8 [T, T]: row i =
        which of the new tokens token i sees (None = causal). The T new cache entries stay
        pending until `commit`; another forward replaces them."""
        with self._one_call("forward"):
            return self.model.forward(tokens, positions, visibility)

    def commit(self, keep) -> None:
        """Keep pending entries `keep` (indices into the last forward's tokens, strictly
        increasing), packed right after the committed context; cache_len grows by len(keep)."""
        with self._one_call("commit"):
            self.model.commit(np.asarray(keep).reshape(-1))

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` committed cache entries (0 <= n <= cache_len; ValueError
        otherwise) and drop any pending ones, so the next forward continues at position n. O(1):
        rolls back a speculative continuation (a drafter's greedy chain) without recomputing the
        prefix."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ValueError(f"truncate: n must be an integer, got {n!r}")
        with self._one_call("truncate"):
            if not 0 <= int(n) <= self.model.cache_len:
                raise ValueError(f"truncate: n must be in [0, cache_len = {self.model.cache_len}], got {int(n)}")
            self.model.truncate(int(n))

    def reset(self) -> None:
        """Empty the cache."""
        with self._one_call("reset"):
            self.model.reset()

    @property
    def cache_len(self) -> int:
        return self.model.cache_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ---- conveniences ---------------------------------------------------------------------
    def prefill(self, prompt_ids) -> np.ndarray:
        """Reset the cache, run the prompt causally and commit it: logits float32 [len, vocab]."""
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1:
            raise ValueError(f"prefill: prompt_ids must be 1-D, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError("prefill: empty prompt")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prefill: prompt_ids must be integers, got dtype {ids.dtype}")
        if ids.size > self.max_seq_len:
            raise ValueError(f"prefill: prompt of {ids.size} tokens exceeds max_seq_len ({self.max_seq_len})")
        with self._one_call("prefill"):
            self.model.reset()
            T = ids.size
            logits = self.model.forward(ids, np.arange(T, dtype=np.int32), None)
            self.model.commit(np.arange(T, dtype=np.int32))
        return logits

    def decode(self, token: int) -> np.ndarray:
        """One token at position cache_len, committed: logits float32 [vocab]."""
        with self._one_call("decode"):
            pos = self.model.cache_len
            logits = self.model.forward(np.asarray([token]), np.asarray([pos], dtype=np.int32), None)
            self.model.commit(np.zeros(1, dtype=np.int32))
        return logits[0]

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_ids, max_new_tokens: int, drafter=None, tree_budget: int = 64, depth: int = 15,
                 top_k=None, temperature: float = 0.0, seed=None, stop_token_ids=(), **kwargs):
        """Prefill ``prompt_ids`` and generate up to ``max_new_tokens`` tokens: plain AR when
        ``drafter`` is None, DDTree speculative decoding otherwise (lossless). Returns a
        ``GenerationResult`` (``tokens``, ``acceptance_lengths``, ``tree_sizes``, ``draft_depths``,
        ``stats``). Other keyword arguments (``top_p``, ``target_top_k``, ``progress``, ``prefill_chunk``,
        ``adaptive_budget``, ``reuse_prefix``) are those of ``kdtree_native.generation.generate``."""
        from .generation import generate

        with self._one_call("generate"):
            return generate(self, prompt_ids, max_new_tokens, drafter=drafter, tree_budget=tree_budget, depth=depth,
                            top_k=top_k, temperature=temperature, seed=seed, stop_token_ids=stop_token_ids, **kwargs)

    def stream(self, prompt_ids, max_new_tokens: int, drafter=None, progress=None, **kwargs):
        """``generate()`` as an iterator: a ``kdtree_native.generation.TokenStream`` of each round's new
        tokens (int32 arrays) while the call runs in a background thread; ``.result`` is the
        ``GenerationResult`` at the end. Arguments as ``generate``'s, checked before it starts. The
        Engine is held until the stream ends or is closed (other calls raise RuntimeError meanwhile).

            with eng.stream(ids, 128, drafter=NgramDrafter(), tree_budget=8, depth=6) as s:
                for new in s:
                    print(tok.decode(new.tolist()), end="", flush=True)"""
        from .generation import TokenStream, _prepare

        self._acquire("stream")
        try:
            run = _prepare(self, prompt_ids, max_new_tokens, drafter=drafter, **kwargs)
            return TokenStream(run, progress, on_done=self._release)
        except BaseException:
            self._release()
            raise

    def __repr__(self) -> str:
        c = self.config
        return (f"Engine(device={self.device!r}, model_type={c.model_type!r}, layers={c.num_hidden_layers}, "
                f"hidden={c.hidden_size}, vocab={c.vocab_size}, max_seq_len={self.max_seq_len}, "
                f"cache_len={self.cache_len}"
                + (f", quantized={c.quantization.describe()!r} (dequantized on load)" if c.quantization else "")
                + ")")
