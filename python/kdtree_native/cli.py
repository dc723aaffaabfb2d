"""The ``kdtree-native`` command line (also ``python -m kdtree_native``).

    kdtree-native info                       what this build contains
    kdtree-native generate MODEL_DIR ...     generate from a checkpoint (streams the output)
    kdtree-native demo                       AR vs DDTree on the embedded default model
"""
import argparse
import os
import json
import re
import sys
import time

import numpy as np


def _cmd_info(args):
    import kdtree_native as kn

    info = kn.build_info()
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    return 0


# ---- shared helpers ---------------------------------------------------------------------------

class _UsageError(Exception):
    """A bad command line that argparse cannot see by itself; main() reports it as argparse does
    (the usage, then "kdtree-native CMD: error: MESSAGE") with exit status 2."""


def _load_tokenizer(model_dir, required=False):
    """HF `tokenizers` Tokenizer from MODEL_DIR/tokenizer.json, or None. A tokenizer.json that
    does not load is an error when ``required`` (the prompt is text), else a note (the output is
    then printed as token ids)."""
    path = os.path.join(model_dir, "tokenizer.json") if model_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("note: tokenizer.json found but the `tokenizers` package is missing; use --ids", file=sys.stderr)
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # (`tokenizers` raises a bare Exception for a malformed file)
        if required:
            raise ValueError(f"cannot load {path}: {e}") from None
        print(f"note: cannot load {path} ({e}); printing token ids", file=sys.stderr)
        return None


def _resolve_model_dir(path):
    """MODEL_DIR as given, except ``default`` (when nothing of that name is in the working directory):
    the embedded default target model (kdtree_native.default_model_dir())."""
    if path == "default" and not os.path.exists(path):
        from . import models

        return models.default_model_dir()
    return path


def _is_embedded_target(path):
    """True when ``path`` is the embedded default target model's directory."""
    try:
        from . import models

        return os.path.realpath(path) == os.path.realpath(models.default_model_dir())
    except Exception:  # (not shipped in this build)
        return False


def _draft_model_dir(args):
    """--draft-model, or the embedded draft model when MODEL_DIR is the embedded target; else a usage error."""
    if getattr(args, "draft_model", None):
        return args.draft_model
    if _is_embedded_target(args.model_dir):
        from . import models

        return models.default_draft_dir()
    raise _UsageError("--drafter model needs --draft-model DIR (only the embedded default model has a default drafter)")


def _check_model_dir(path, what="model directory"):
    """FileNotFoundError / NotADirectoryError naming ``path`` unless it is a directory."""
    if not os.path.isdir(path):
        if os.path.exists(path):
            hint = (" (`default` names the embedded model only where nothing of that name is in the working "
                    "directory)" if path == "default" else "")
            raise NotADirectoryError(f"{what} {path!r} is not a directory{hint}")
        raise FileNotFoundError(f"{what} {path!r} does not exist")


# argparse types. int() and float() also take "1_0" and digits of other scripts ("١٢"); a
# number on this command line is ASCII: an optional sign, then decimal digits.
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _short(text, limit=40):
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _int_value(text):
    """An int in ASCII decimal, optionally signed, or ValueError."""
    if not _INT_RE.fullmatch(text):
        raise ValueError(text)
    return int(text)  # (ValueError past sys.get_int_max_str_digits() digits)


def _positive_int_arg(text):
    value = _int_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _float_value(text):
    if not _FLOAT_RE.fullmatch(text):
        raise ValueError(text)
    return float(text)


def _arg_type(parse, kind):
    """An argparse type from a parser that raises ValueError: "invalid KIND value: TEXT"."""
    def convert(text):
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind} value: {_short(text)}") from None
    return convert


_int_arg = _arg_type(_int_value, "int")
_float_arg = _arg_type(_float_value, "float")


def _temperature_arg(text):
    value = _float_arg(text)
    with np.errstate(over="ignore"):  # (the sampler works in float32: 1e39 is inf there)
        finite = bool(np.isfinite(np.float32(value)))
    if not (finite and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (within the float32 range), got {text!r}")
    return value


def _ids_arg(text):
    """--ids: token ids separated by commas or spaces."""
    ids = []
    for token in text.replace(",", " ").split():
        try:
            ids.append(_int_value(token))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be integers separated by commas or spaces, got {_short(token)}") from None
    return ids


def _text_arg(text):
    """Prompt text: valid Unicode (argv bytes that are not UTF-8 arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("must be UTF-8 text; the command line held bytes that are not UTF-8") from None
    return text


DRAFTERS = "none, ngram, model, oracle[:noise]"


def _drafter_arg(text):
    """--drafter: none | ar | ngram | model | oracle | oracle:NOISE with NOISE in [0, 1]."""
    name, colon, noise = text.partition(":")
    if name in ("none", "ar", "ngram", "model") and not colon:
        return text
    if name == "oracle":
        if not colon:
            return text
        try:
            value = _float_value(noise)
        except ValueError:
            value = None
        if value is None or not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"the oracle's noise (oracle:NOISE) must be a number in [0, 1], "
                                             f"got {_short(noise)}")
        return text
    raise argparse.ArgumentTypeError(f"unknown drafter {_short(text)} (choose from {DRAFTERS})")


class _Streamer:
    """progress callback: prints new tokens (text when a tokenizer is known) as they come, or
    (stream=False) a progress indicator on stderr, only when stderr is a terminal (\r updates)."""

    def __init__(self, tokenizer=None, stream=True, label=""):
        self.tok, self.stream, self.label = tokenizer, stream, label
        self.ids, self.printed, self.t0, self.last = [], "", time.perf_counter(), 0.0

    def __call__(self, new_tokens, done, total):
        self.ids.extend(int(t) for t in new_tokens)
        if self.stream:
            if self.tok is not None:
                text = self.tok.decode(self.ids)
                if text.startswith(self.printed):
                    sys.stdout.write(text[len(self.printed):])
                    self.printed = text
            else:
                sys.stdout.write("".join(f" {t}" for t in new_tokens))
            sys.stdout.flush()
        elif sys.stderr.isatty():
            now = time.perf_counter()
            if now - self.last > 0.2 or done == total:
                self.last = now
                rate = done / max(now - self.t0, 1e-9)
                sys.stderr.write(f"\r  {self.label}{done}/{total} tokens ({rate:.1f} tok/s)   ")
                if done == total:
                    sys.stderr.write("\n")
                sys.stderr.flush()

    def finish(self):
        if not self.stream and self.ids and sys.stderr.isatty():
            sys.stderr.write("\n")


def _make_drafter(name, engine, args, prompt, n, max_seq_len):
    from . import drafters
    from .generation import generate

    if name in (None, "none", "ar"):
        return None
    if name == "ngram":
        return drafters.NgramDrafter()
    if name == "model":
        from .engine import Engine

        draft_dir = _draft_model_dir(args)
        _check_model_dir(draft_dir, "draft model directory")
        # (on the device the target resolved to, whatever --device said)
        draft_engine = Engine.from_pretrained(draft_dir, device=engine.device, max_seq_len=max_seq_len)
        return drafters.ModelDrafter(draft_engine, min_chain_prob=DEMO_MODEL_MIN_CHAIN_PROB)
    if name == "oracle" or name.startswith("oracle:"):
        noise = _float_value(name.split(":", 1)[1]) if ":" in name else 0.0
        ref = generate(engine, prompt, n, temperature=0.0).tokens  # the answer, from AR
        return drafters.OracleDrafter(ref, noise=noise, seed=0, vocab_size=engine.vocab_size)
    raise ValueError(f"unknown drafter {name!r} (choose from {DRAFTERS})")


def _stats_line(res):
    s = res.stats
    sec = s["seconds"]
    return (f"[{s['num_tokens']} tokens in {sec['total']:.3f} s = {s['tokens_per_second']:.1f} tok/s | rounds "
            f"{s['rounds']} | mean acceptance {s['mean_acceptance_length']:.2f} | draft {sec['draft']:.3f} s, "
            f"tree {sec['tree_build']:.3f} s, verify {sec['verify']:.3f} s, accept/commit "
            f"{sec['accept_commit']:.3f} s, prefill {sec['prefill']:.3f} s]")


# ---- generate ---------------------------------------------------------------------------------

# The default KV capacity of `generate`, capped at the model's max_position_embeddings.
DEFAULT_MAX_SEQ_LEN = 4096


def _cmd_generate(args):
    from .config import load_config
    from .engine import Engine
    from .generation import generate

    if args.interactive:
        if args.ids is not None:
            raise _UsageError("--interactive reads text lines: use --prompt (optional) instead of --ids")
        if args.drafter is not None and args.drafter.startswith("oracle"):
            raise _UsageError("--interactive: the oracle drafter needs the answer in advance; use ngram, model or none")
    elif args.ids is None and args.prompt is None:
        raise _UsageError("give a prompt: --prompt TEXT (with tokenizer.json) or --ids 1,2,3")
    args.model_dir = _resolve_model_dir(args.model_dir)
    if args.drafter == "model":
        args.draft_model = _draft_model_dir(args)  # resolved once, the usage error before any loading
    _check_model_dir(args.model_dir)
    max_positions = load_config(args.model_dir).max_position_embeddings
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, max_positions)
    elif max_positions < max_seq_len <= 2**31 - 1:  # (beyond that the engine refuses it)
        print(f"note: --max-seq-len {max_seq_len} is more than the model's max_position_embeddings "
              f"({max_positions}); positions past it are outside what the model was trained for", file=sys.stderr)
    tok = _load_tokenizer(args.model_dir, required=args.ids is None)
    if args.ids is not None:
        prompt = args.ids
    else:
        if tok is None:
            raise _UsageError(("--interactive" if args.interactive else "--prompt") + " needs MODEL_DIR/tokenizer.json "
                              "(and the `tokenizers` package)" + ("" if args.interactive else "; use --ids"))
        prompt = tok.encode(args.prompt).ids if args.prompt else []
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()  # on a terminal: the load's progress and what it holds (scripts get neither)
    eng = Engine.from_pretrained(args.model_dir, device=args.device, max_seq_len=max_seq_len, progress=True if tty else None)
    if tty:
        print(f"loaded {args.model_dir} in {time.perf_counter() - t0:.1f} s: {_memory_summary(eng.model)}",
              file=sys.stderr)
    if eng.config.quantization is not None:
        print(f"note: quantized checkpoint ({eng.config.quantization.describe()}): its weights were dequantized on "
              "load and run with FP32 activations (docs/MODEL.md)", file=sys.stderr)
    drafter = _make_drafter(args.drafter, eng, args, prompt, args.max_new_tokens, max_seq_len)
    stream = _Streamer(tok, stream=not args.no_stream)
    stops = list(args.stop or [])
    if args.eos and getattr(eng.config, "eos_token_id", None) is not None:
        eos = eng.config.eos_token_id
        stops += list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    if args.interactive:
        return _interactive(eng, tok, prompt, drafter, stops, args, max_seq_len)
    res = generate(eng, prompt, args.max_new_tokens, progress=stream, **_generate_options(args, drafter, stops))
    if not args.no_stream:
        sys.stdout.write("\n")
    elif tok is not None:
        print(tok.decode(res.tokens.tolist()))
    else:
        print(" ".join(str(t) for t in res.tokens))
    if args.json:
        print(json.dumps({"tokens": res.tokens.tolist(), "acceptance_lengths": res.acceptance_lengths.tolist(),
                          "tree_sizes": res.tree_sizes.tolist(), "draft_depths": res.draft_depths.tolist(),
                          "stats": res.stats}))
    print(_stats_line(res), file=sys.stderr)
    return 0


def _generate_options(args, drafter, stops):
    """generate()'s options from the command line (the same for one call and for each interactive turn)."""
    return dict(drafter=drafter, tree_budget=args.budget, depth=args.depth, top_k=args.top_k,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_token_ids=stops,
                adaptive_budget=args.adaptive)


def _interactive(eng, tok, start, drafter, stops, args, max_seq_len):
    """generate --interactive: each line read from stdin is appended to the running text (the
    starting --prompt, the lines, and every continuation so far), and -n tokens are generated after
    it, streamed; the cache of the text so far is kept between turns (reuse_prefix), so a turn
    prefills only its new line. Ends at end of input or when the text would pass --max-seq-len."""
    from .generation import generate

    text = list(start)
    tty = sys.stdin.isatty()
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        new = tok.encode(line).ids
        if not text and not new:
            continue
        if len(text) + len(new) + args.max_new_tokens > max_seq_len:
            print(f"kdtree-native generate: the conversation would pass --max-seq-len ({max_seq_len} tokens); "
                  "stopping", file=sys.stderr)
            return 0
        text += new
        res = generate(eng, text, args.max_new_tokens, progress=_Streamer(tok, stream=True), reuse_prefix=True,
                       **_generate_options(args, drafter, stops))
        text += res.tokens.tolist()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_stats_line(res)[:-1] + f" | {res.stats['prefill_reused']} of {len(text) - len(res.tokens)} prompt "
              "tokens reused]", file=sys.stderr)


# ---- demo -------------------------------------------------------------------------------------

def _random_engine(seed, max_seq_len, vocab=2048, layers=3, hidden=384):
    """A small random DeepSeek-V3-shaped model built in memory (the demo's fallback)."""
    from . import _native
    from .config import config_from_dict
    from .engine import Engine

    cfg = config_from_dict(dict(
        model_type="deepseek_v3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _native.model_weight_specs(cfg.to_native()):
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1]) * (3.0 if name == "lm_head.weight" else 1.0)
        weights[name] = w.astype(np.float32)
    return Engine.from_weights(cfg, weights, device="cpu", max_seq_len=max_seq_len)


def _demo_models(args):
    """(target engine, draft engine or None, tokenizer or None, description)."""
    from .engine import Engine

    target_dir = draft_dir = None
    try:
        from . import models

        target_dir = models.default_model_dir()
        draft_dir = models.default_draft_dir()
    except Exception as e:  # the embedded model is not shipped in this build (yet)
        why = f"{type(e).__name__}: {e}"
    if target_dir:
        device = getattr(args, "device", "cpu")
        eng = Engine.from_pretrained(target_dir, device=device, max_seq_len=args.max_seq_len)
        draft = Engine.from_pretrained(draft_dir, device=eng.device, max_seq_len=args.max_seq_len) if draft_dir else None
        return eng, draft, _load_tokenizer(target_dir), f"embedded default model ({target_dir}) on {eng.device}"
    print(f"note: the embedded default model is not available ({why}); running on a small random model "
          f"instead (its text is noise, its speed-up is real)", file=sys.stderr)
    return (_random_engine(1, args.max_seq_len), _random_engine(2, args.max_seq_len, layers=1, hidden=128), None,
            "random 3-layer DeepSeek-V3-shaped model (hidden 384, vocab 2048), random 1-layer drafter")


# The demo's prompt: Python code, as the embedded model was trained on the standard library; it ends
# on a visible character (docs/TRAINING.md: a trailing newline or indentation derails the model).
DEMO_PROMPT = ('class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
               '        self.items = []\n\n    def push(self, item):\n        self.items.append(item)')

# Default tree budget / depth per drafter: the best CPU tokens/s, on average over three sweeps of
# budgets x depths on held-out prompts after the CPU model's BF16 weight copies made every step
# faster, 1-token steps most (benchmarks/bench_cpu_engine.py, docs/BENCHMARKS.md "BF16 weight
# copies on the CPU"; before them: n-gram 8 / 15, model 8 / 8). The model drafter also stops its
# chain early once the product of its top-1 probabilities falls below DEMO_MODEL_MIN_CHAIN_PROB: 0.2 since the
# fifty-ninth session (the adaptive policy replayed on the draft model's drafts after 16 held-out prompts, three
# cost tables x depths 3 / 4 / 6: 0 / 0.05 / 0.1 / 0.2 / 0.3 / 0.4 gave 1.403 / 1.440 / 1.464 / 1.474 / 1.460 /
# 1.448x AR on average, the best fixed budgets 1.326 -> 1.355x from 0.1 to 0.2; docs/BENCHMARKS.md "Adaptive tree
# budget: edge classes and the drafting depth").
DEMO_NGRAM = (4, 8)
DEMO_MODEL = (4, 4)
DEMO_MODEL_MIN_CHAIN_PROB = 0.2
# --adaptive: the most nodes a round may verify (each round's size is chosen from its draft).
DEMO_ADAPTIVE_BUDGET = 16


def _demo_prompt_ids(tok, text=DEMO_PROMPT):
    """The demo's prompt ids: `text` tokenised, or fixed random ids for the random fallback model."""
    return tok.encode(text).ids if tok else [int(x) for x in np.random.default_rng(0).integers(2, 2048, 24)]


def _memory_summary(model) -> str:
    """'device cpu, 0.95 GB of weights (0.95 GB as BF16), 1.00 GB held in all' (what the model reports); the
    GPU model: 'device cuda, weights 0.13 GB FP32 + 0.90 GB BF16 (bf16_weights only), 1.60 GB held in all'."""
    gb = 1e9
    parts = [f"device {model.device}"]
    bf16, fp32 = getattr(model, "bf16_weight_bytes", 0), getattr(model, "fp32_weight_bytes", None)
    int4 = getattr(model, "int4_weight_bytes", 0) or 0
    q = f", {int4 / gb:.2f} GB as INT4" if int4 else ""
    if fp32 is not None:
        parts.append(f"{(bf16 + fp32 + int4) / gb:.2f} GB of weights ({bf16 / gb:.2f} GB as BF16{q})")
    elif getattr(model, "weight_bytes", None) is not None:  # the GPU model: its FP32 arena, its BF16 one, its INT4 experts
        mode = getattr(model, "bf16_weights", None)
        parts.append(f"weights {model.weight_bytes / gb:.2f} GB FP32 + {bf16 / gb:.2f} GB BF16"
                     + (f" + {int4 / gb:.2f} GB INT4 experts" if int4 else "")
                     + (f" (bf16_weights {mode})" if mode else ""))
    parts.append(f"{model.memory_bytes / gb:.2f} GB held in all (cache and workspaces included)")
    return ", ".join(parts)


def _cmd_demo(args):
    from .drafters import ModelDrafter, NgramDrafter, OracleDrafter
    from .generation import generate

    t0 = time.perf_counter()
    eng, draft_eng, tok, what = _demo_models(args)
    print(f"model: {what} (loaded in {time.perf_counter() - t0:.1f} s)")
    text = args.prompt if args.prompt is not None else DEMO_PROMPT
    prompt = _demo_prompt_ids(tok, text)
    n = args.max_new_tokens
    tty = sys.stdout.isatty()

    # The text, once: an AR run streamed as it is generated (untimed: it is also the warm-up).
    print("-" * 72)
    if tok is not None:
        sys.stdout.write(text)
    else:
        sys.stdout.write("prompt ids:" + "".join(f" {t}" for t in prompt) + "\ngenerated ids:")
    sys.stdout.flush()
    streamer = _Streamer(tok, stream=True)
    ref = generate(eng, prompt, n, progress=streamer)
    print("\n" + "-" * 72)

    def setting(default):
        return (args.budget if args.budget is not None else default[0],
                args.depth if args.depth is not None else default[1])

    nb, nd = setting(DEMO_NGRAM)
    mb, md = setting(DEMO_MODEL)
    if args.adaptive and args.budget is None:
        nb = mb = DEMO_ADAPTIVE_BUDGET
    modes = [("AR (no drafter)", lambda: None, 0, 1)]
    modes.append(("DDTree n-gram", NgramDrafter, nb, nd))
    if draft_eng is not None:
        modes.append(("DDTree model", lambda: ModelDrafter(draft_eng, min_chain_prob=DEMO_MODEL_MIN_CHAIN_PROB), mb, md))
    modes.append(("oracle (ceiling)", lambda: OracleDrafter(ref.tokens, vocab_size=eng.vocab_size), nb, nd))

    # Timed runs: the modes interleaved, --repeats times (load changes hit every mode alike);
    # tokens/s of each whole generate call (prefill included), median over the repeats.
    runs = {label: [] for label, *_ in modes}
    for rep in range(args.repeats):
        for label, make, budget, depth in modes:
            progress = None
            if tty:
                def progress(new_tokens, done, total, label=label, rep=rep):
                    sys.stdout.write(f"\r  timing {label} ({rep + 1}/{args.repeats}): {done}/{total} tokens   ")
                    sys.stdout.flush()
            runs[label].append(generate(eng, prompt, n, drafter=make(), tree_budget=budget, depth=depth,
                                        progress=progress, adaptive_budget=bool(args.adaptive and budget)))
    if tty:
        sys.stdout.write("\r" + " " * 60 + "\r")

    def tps(label):
        return float(np.median([r.stats["tokens_per_second"] for r in runs[label]]))

    base = tps(modes[0][0])
    print(f"{n} new tokens, greedy; tokens/s = median of {args.repeats} whole generate calls (prefill included)")
    print(f"{'mode':<18}{'budget':>7}{'depth':>6}{'tok/s':>9}{'speedup':>9}{'mean acc':>10}  same as AR")
    ok = True
    for label, _, budget, depth in modes:
        res = runs[label][-1]
        same = all(np.array_equal(r.tokens, ref.tokens) for r in runs[label])
        ok &= same
        bd = (f"{('<=' if args.adaptive else '') + str(budget):>7}{depth:>6}") if budget else f"{'-':>7}{'-':>6}"
        print(f"{label:<18}{bd}{tps(label):>9.1f}{tps(label) / base if base else 0:>8.2f}x"
              f"{res.stats['mean_acceptance_length']:>10.2f}  {'yes' if same else 'NO'}")
    print("(oracle: a drafter that knows the AR answer, with the n-gram row's budget/depth: the ceiling there)")
    if not ok:
        print("kdtree-native demo: error: DDTree output differs from AR", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="kdtree-native", description="DDTree speculative decoding engine")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("info", help="print what this build contains")

    g = sub.add_parser("generate", help="generate from an HF checkpoint directory")
    g.add_argument("model_dir", help="HF checkpoint directory, or `default`: the embedded default model")
    g.add_argument("--prompt", type=_text_arg, help="prompt text (needs MODEL_DIR/tokenizer.json)")
    g.add_argument("--ids", type=_ids_arg, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("-n", "--max-new-tokens", type=_int_arg, default=64)
    g.add_argument("--drafter", type=_drafter_arg, default="ngram",
                   help="none | ngram | model | oracle[:noise] (default ngram)")
    g.add_argument("--draft-model", help="checkpoint dir of the drafter model (--drafter model; default with the "
                                         "embedded default model: its shipped draft model)")
    g.add_argument("--budget", type=_int_arg, default=64,
                   help="tree nodes per round (0 = AR); adaptive (the default), the most a round verifies")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each round's tree size (<= --budget) and drafting depth (<= --depth) from the draft "
                        "and the measured round costs; --no-adaptive: every round verifies --budget nodes "
                        "(default: adaptive)")
    g.add_argument("--depth", type=_int_arg, default=15)
    g.add_argument("--top-k", type=_int_arg, default=None, help="drafter candidates per depth (default: budget)")
    g.add_argument("-t", "--temperature", type=_temperature_arg, default=0.0)
    g.add_argument("--top-p", type=_float_arg, default=1.0)
    g.add_argument("--seed", type=_int_arg, default=None)
    g.add_argument("--stop", type=_int_arg, nargs="*", help="stop token ids")
    g.add_argument("--eos", action="store_true", help="also stop at the config's eos_token_id")
    g.add_argument("--max-seq-len", type=_int_arg, default=None,
                   help=f"KV cache capacity in tokens (default: {DEFAULT_MAX_SEQ_LEN}, or the model's "
                        f"max_position_embeddings when smaller)")
    g.add_argument("--device", default="auto",
                   help="auto (the GPU when one is usable, else the CPU; the default), cpu or cuda")
    g.add_argument("--no-stream", action="store_true", help="print the output at the end, with a progress line")
    g.add_argument("--interactive", action="store_true",
                   help="read lines from stdin: each is appended to the text so far and -n tokens are generated "
                        "after it (the text's cache kept between turns); --prompt, if given, starts the text")
    g.add_argument("--json", action="store_true",
                   help="also print tokens, per-round acceptance lengths and tree sizes, and stats as JSON")

    d = sub.add_parser("demo", help="AR vs DDTree side by side on the embedded default model")
    d.add_argument("-n", "--max-new-tokens", type=_int_arg, default=128)
    d.add_argument("--budget", type=_int_arg, default=None,
                   help=f"tree budget of every drafter (default: n-gram {DEMO_NGRAM[0]}, model {DEMO_MODEL[0]})")
    d.add_argument("--depth", type=_int_arg, default=None,
                   help=f"draft depth of every drafter (default: n-gram {DEMO_NGRAM[1]}, model {DEMO_MODEL[1]})")
    d.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help=f"DDTree rows choose each round's tree size from the draft, up to --budget (default "
                        f"{DEMO_ADAPTIVE_BUDGET}); --no-adaptive: fixed budgets (default: n-gram {DEMO_NGRAM[0]}, "
                        f"model {DEMO_MODEL[0]}) (default: adaptive)")
    d.add_argument("--prompt", type=_text_arg, default=None, help="prompt text (default: a few lines of a Python class)")
    d.add_argument("--repeats", type=_positive_int_arg, default=3, help="timed runs per mode (median; >= 1)")
    d.add_argument("--max-seq-len", type=_int_arg, default=1024)
    d.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the models run (auto: the GPU when one is usable, else the CPU)")

    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 0
    cmd = {"info": _cmd_info, "generate": _cmd_generate, "demo": _cmd_demo}[args.cmd]
    # Errors, one convention: "kdtree-native CMD: error: ..." on stderr and exit status 2, for a
    # bad command line (argparse's own checks and _UsageError, with the usage line) as for a
    # failure the command runs into (bad model dir, out-of-range ids, no GPU: the exception's
    # type and message, no traceback; KDTREE_DEBUG=1 shows it).
    try:
        return cmd(args)
    except _UsageError as e:
        sub.choices[args.cmd].error(str(e))  # (exits with status 2)
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): stop quietly, as Python's documentation
        # advises (stdout to /dev/null, so that the interpreter's final flush does not complain).
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (ValueError, TypeError, OSError, RuntimeError, NotImplementedError) as e:
        if os.environ.get("KDTREE_DEBUG"):
            raise
        print(f"kdtree-native {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
