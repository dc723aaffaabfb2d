"""The command line (`python -m kdtree_native`): info, demo and generate run end to end on the
embedded default model and print what they promise; bad arguments fail with a message."""
import json
import os
import subprocess
import sys

import pytest

import kdtree_native as kn
from kdtree_native import cli


def _run(*args, timeout=240):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "kdtree_native", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_info_prints_build():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "version" in r.stdout and kn.__version__ in r.stdout
    assert "cuda_available" in r.stdout


def test_demo_runs_and_reports():
    pytest.importorskip("tokenizers")
    r = _run("demo", "-n", "24", "--repeats", "1", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for label in ("AR (no drafter)", "DDTree n-gram", "DDTree model"):
        line = next((l for l in out.splitlines() if l.startswith(label)), None)
        assert line is not None, out
        assert line.rstrip().endswith("yes"), line  # DDTree output == AR output
    assert "def " in out or "self" in out  # the streamed continuation is Python-like text


def test_generate_text_prompt_and_ids():
    pytest.importorskip("tokenizers")
    model = kn.default_model_dir()
    r = _run("generate", model, "--prompt", "def fibonacci(n):", "-n", "16", "--drafter", "ngram",
             "--budget", "8", "--depth", "4", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "mean acceptance" in (r.stdout + r.stderr)
    r = _run("generate", model, "--ids", "1,5,9", "-n", "8", "--drafter", "none", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "loaded" not in r.stderr and "loading weights" not in r.stderr  # not a terminal: no load report


def test_generate_reports_the_load_on_a_terminal(capsys, monkeypatch):
    """With stderr on a terminal, `generate` shows the load's progress and a line on what was loaded
    and what the model holds (the embedded model: BF16 weights, held as BF16)."""
    model = kn.default_model_dir()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    rc, _, err = _main(capsys, "generate", model, "--ids", "1,5,9", "-n", "4", "--drafter", "none", "--device", "cpu")
    assert rc == 0, err
    assert "loading weights: " in err, err
    eng = kn.Engine.from_pretrained(model, device="cpu")
    bf16, fp32 = eng.model.bf16_weight_bytes / 1e9, eng.model.fp32_weight_bytes / 1e9
    line = next((l for l in err.splitlines() if l.startswith(f"loaded {model} in ")), None)
    assert line is not None, err
    assert f"device cpu, {bf16 + fp32:.2f} GB of weights ({bf16:.2f} GB as BF16), " in line, line


def test_adaptive_budget_flags(capsys, no_debug):
    """The demo's DDTree rows choose their sizes by default (budget column "<=16", as with --adaptive) and
    still equal AR; --no-adaptive gives the fixed budgets (4); generate --adaptive gives the same ids as
    without."""
    pytest.importorskip("tokenizers")
    for flags, column in (([], "<=16"), (["--adaptive"], "<=16"), (["--no-adaptive"], "4")):
        rc, out, err = _main(capsys, "demo", "-n", "24", "--repeats", "1", "--device", "cpu", *flags)
        assert rc == 0, err
        for label in ("DDTree n-gram", "DDTree model", "oracle (ceiling)"):
            line = next(l for l in out.splitlines() if l.startswith(label))
            assert line[len(label):].split()[0] == column and line.rstrip().endswith("yes"), (flags, line)
    runs = []
    for extra in ([], ["--adaptive"], ["--no-adaptive"]):
        rc, out, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1,5,9,5,9", "-n", "12",
                             "--device", "cpu", "--no-stream", "--budget", "16", "--depth", "4", "--json", *extra)
        assert rc == 0, err
        j = json.loads(out.strip().splitlines()[-1])
        runs.append(j)
        assert len(j["tree_sizes"]) == len(j["acceptance_lengths"]) == j["stats"]["rounds"]
        assert sum(j["tree_sizes"]) == j["stats"]["num_draft_tokens"] and max(j["tree_sizes"]) <= 16
        assert len(j["draft_depths"]) == len(j["tree_sizes"]) and max(j["draft_depths"]) <= 4
    assert runs[0]["tokens"] == runs[1]["tokens"] == runs[2]["tokens"]


def test_generate_defaults(capsys, monkeypatch, no_debug):
    """generate's defaults are the demo's: the adaptive budget (--no-adaptive: fixed), device auto; MODEL_DIR
    `default` is the embedded model and, with it, --drafter model needs no --draft-model (the shipped draft
    model); the output is still AR's."""
    from kdtree_native import generation
    from kdtree_native.engine import Engine

    calls, loads = [], []
    real_generate, real_load = generation.generate, Engine.from_pretrained.__func__

    def spy_generate(*a, **kw):
        calls.append(kw)
        return real_generate(*a, **kw)

    def spy_load(cls, model_dir, *a, **kw):
        loads.append((os.path.realpath(model_dir), kw.get("device")))
        return real_load(cls, model_dir, *a, **kw)

    monkeypatch.setattr(generation, "generate", spy_generate)
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy_load))
    monkeypatch.chdir(os.path.dirname(kn.default_model_dir()))  # no `default` here: the name means the embedded model
    outs = []
    for extra in (["--drafter", "model"], ["--drafter", "model", "--no-adaptive"], ["--drafter", "none"]):
        calls.clear()
        rc, out, err = _main(capsys, "generate", "default", "--ids", "1,5,9,5,9", "-n", "10", "--budget", "8",
                             "--depth", "3", "--no-stream", "--json", *extra)
        assert rc == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1])["tokens"])
        kw = calls[-1]  # (the oracle's AR call would come first; none here)
        assert kw["adaptive_budget"] is ("--no-adaptive" not in extra), (extra, kw)
        assert (kw["drafter"] is None) == ("none" in extra)
    assert outs[0] == outs[1] == outs[2]
    target, draft = os.path.realpath(kn.default_model_dir()), os.path.realpath(kn.default_draft_dir())
    assert [path for path, _ in loads] == [target, draft, target, draft, target]
    assert all(d == "auto" for path, d in loads if path == target)
    assert all(d in ("cpu", "cuda") for path, d in loads if path == draft)  # the device the target resolved to


def test_generate_interactive_keeps_the_conversation(capsys, no_debug):
    """--interactive: one continuation per stdin line, the text's cache kept between turns (the second turn
    reuses every cached token of the first: its prompt + what it generated, but the last one); the same
    text as two plain generate calls would give; usage errors for --ids and the oracle."""
    pytest.importorskip("tokenizers")
    model = kn.default_model_dir()
    r = subprocess.run([sys.executable, "-m", "kdtree_native", "generate", model, "--interactive", "-n", "12",
                        "--budget", "8", "--depth", "4", "--device", "cpu", "--prompt", "import os"],
                       input="\ndef main():\n", capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    stats = [l for l in r.stderr.splitlines() if "prompt tokens reused" in l]
    assert len(stats) == 2, r.stderr
    import re
    (u1, p1), (u2, p2) = [tuple(int(x) for x in re.search(r"(\d+) of (\d+) prompt tokens reused", l).groups())
                          for l in stats]
    assert u1 == 0 and u2 == p1 + 12 - 1 and p2 > u2
    from kdtree_native.cli import _load_tokenizer
    tok = _load_tokenizer(model)
    eng = kn.Engine.from_pretrained(model, device="cpu")
    text = tok.encode("import os").ids + tok.encode("\n").ids
    first = eng.generate(text, 12, drafter=kn.drafters.NgramDrafter(), tree_budget=8, depth=4).tokens.tolist()
    text2 = text + first + tok.encode("def main():\n").ids
    second = eng.generate(text2, 12).tokens.tolist()
    assert r.stdout == tok.decode(first) + "\n" + tok.decode(second) + "\n"
    for extra, msg in ((["--ids", "1,2"], "use --prompt"), (["--drafter", "oracle"], "oracle drafter")):
        rc, _, err = _main(capsys, "generate", model, "--interactive", "--device", "cpu", *extra)
        assert rc == 2 and msg in err, err


def test_generate_bad_arguments_fail_cleanly():
    r = _run("generate", "/nonexistent/model/dir", "--ids", "1,2", "-n", "4")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "does not exist" in r.stderr
    r = _run("generate", kn.default_model_dir(), "--ids", "1,999999", "-n", "4", "--device", "cpu")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "999999" in r.stderr and "vocab" in r.stderr
    r = _run("demo", "--device", "tpu")
    assert r.returncode != 0 and "invalid choice" in r.stderr


# ---- robustness (in-process through cli.main where no subprocess is needed) --------------------

def _main(capsys, *argv):
    """(exit status, stdout, stderr) of cli.main(argv); argparse's errors exit through SystemExit."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)


def _model_copy(tmp_path, tokenizer_text=None):
    """A model directory with the default model's config and weights (symlinks) and, optionally,
    a tokenizer.json holding ``tokenizer_text``."""
    src = kn.default_model_dir()
    d = tmp_path / "model"
    d.mkdir()
    for name in os.listdir(src):
        if name != "tokenizer.json":
            os.symlink(os.path.join(src, name), d / name)
    if tokenizer_text is not None:
        (d / "tokenizer.json").write_text(tokenizer_text)
    return str(d)


def test_generate_corrupt_tokenizer_is_a_note_with_ids_and_an_error_with_a_prompt(tmp_path, capsys, no_debug):
    """A tokenizer.json that does not load used to end in a traceback even with --ids (where no
    tokenizer is needed): with --ids the output is printed as ids, after a note; with --prompt
    it is a clean error."""
    pytest.importorskip("tokenizers")
    model = _model_copy(tmp_path, "{not json")
    rc, out, err = _main(capsys, "generate", model, "--ids", "1,5,9", "-n", "4", "--drafter", "none",
                         "--no-stream", "--device", "cpu")
    assert rc == 0, err
    assert "note: cannot load" in err and "tokenizer.json" in err
    assert len(out.split()) == 4 and all(t.isdigit() for t in out.split())
    rc, out, err = _main(capsys, "generate", model, "--prompt", "def f", "-n", "4", "--device", "cpu")
    assert rc == 2 and "kdtree-native generate: error:" in err and "cannot load" in err, err


def test_generate_prompt_that_is_not_utf8(capsys, no_debug):
    """argv bytes that are not UTF-8 arrive as lone surrogates; the tokenizer used to raise a
    TypeError (traceback). Now an argparse error (exit 2), for generate and demo; the same through
    a real command line."""
    model = kn.default_model_dir()
    rc, _, err = _main(capsys, "generate", model, "--prompt", "abc\udcff", "-n", "2")
    assert rc == 2 and "argument --prompt: must be UTF-8 text" in err, err
    rc, _, err = _main(capsys, "demo", "--prompt", "\udcfe\udcff", "-n", "2")
    assert rc == 2 and "argument --prompt: must be UTF-8 text" in err, err
    r = subprocess.run([sys.executable, "-m", "kdtree_native", "generate", model, "--prompt", b"\xff\xfe", "-n", "2"],
                       capture_output=True, timeout=240, env=dict(os.environ))
    assert r.returncode == 2 and b"Traceback" not in r.stderr and b"argument --prompt" in r.stderr, r.stderr


def test_generate_stop_id_past_int64_is_a_clean_error(capsys, no_debug):
    """--stop 2**70 reached generate() as an object array and ended in a TypeError traceback."""
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1", "-n", "4", "--device", "cpu",
                       "--stop", str(2**70))
    assert rc == 2, err
    assert f"error: ValueError: stop token id must be <= 9223372036854775807, got {2**70}" in err, err


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_demo_repeats_must_be_positive(capsys, no_debug, repeats):
    """demo --repeats 0 / -1 used to time nothing and fail with an IndexError (traceback)."""
    rc, out, err = _main(capsys, "demo", "-n", "4", "--repeats", repeats)
    assert rc == 2 and f"argument --repeats: must be an integer >= 1, got {repeats}" in err, err
    assert out == ""  # refused before any model is loaded


@pytest.mark.parametrize("drafter, message", [
    ("oraclefoo", "argument --drafter: unknown drafter 'oraclefoo' (choose from none, ngram, model, oracle[:noise])"),
    ("bogus", "argument --drafter: unknown drafter 'bogus' (choose from none, ngram, model, oracle[:noise])"),
    ("oracle:abc", "argument --drafter: the oracle's noise (oracle:NOISE) must be a number in [0, 1], got 'abc'"),
    ("oracle:nan", "argument --drafter: the oracle's noise (oracle:NOISE) must be a number in [0, 1], got 'nan'"),
    ("oracle:1.5", "argument --drafter: the oracle's noise (oracle:NOISE) must be a number in [0, 1], got '1.5'"),
    ("ngram:3", "argument --drafter: unknown drafter 'ngram:3'"),
])
def test_generate_drafter_names_are_checked(capsys, no_debug, drafter, message):
    """--drafter oraclefoo used to run the oracle; oracle:abc said only "could not convert string
    to float". Both are argparse errors naming --drafter, before any model is loaded."""
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1", "-n", "4", "--drafter", drafter)
    assert rc == 2 and message in err, err


def test_generate_oracle_with_noise_still_runs(capsys, no_debug):
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1,5,9", "-n", "4", "--device", "cpu",
                       "--drafter", "oracle:0.25", "--no-stream")
    assert rc == 0, err


def test_generate_temperature_past_float32_is_refused_without_warnings(capsys, no_debug):
    """-t 1e39 overflowed float32 in the engine's check: NumPy printed a RuntimeWarning before the
    error. The command line refuses it (and NaN, inf, negatives) itself."""
    import warnings

    for t in ("1e39", "1e308", "inf", "nan", "-1"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1", "-n", "4", "-t", t)
        assert rc == 2 and "argument -t/--temperature: must be a finite number >= 0" in err, (t, err)
        assert "RuntimeWarning" not in err


@pytest.mark.parametrize("ids", ["\u0661\u0662", "1_0", "1,\uff12", "0x10", "1.5"])
def test_ids_are_ascii_decimal(capsys, no_debug, ids):
    """--ids "١٢" (Arabic-Indic digits) and "1_0" used to be taken as 12 and 10 (int() accepts
    both); token ids are ASCII decimal. Other int options follow the same rule."""
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", ids, "-n", "2")
    assert rc == 2 and "argument --ids: must be integers separated by commas or spaces" in err, err
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1", "-n", "1_0")
    assert rc == 2 and "argument -n/--max-new-tokens: invalid int value: '1_0'" in err, err
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", " +1, 5 ,-0", "-n", "0")
    assert rc == 0, err


def test_model_dir_that_is_a_file_or_a_fifo(tmp_path, capsys, monkeypatch, no_debug):
    """A regular file or a FIFO given as MODEL_DIR was reported as "does not exist"."""
    f = tmp_path / "afile"
    f.write_text("x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (f, fifo):
        rc, _, err = _main(capsys, "generate", str(path), "--ids", "1", "-n", "2")
        assert rc == 2, err
        assert f"error: NotADirectoryError: model directory {str(path)!r} is not a directory" in err, err
    rc, _, err = _main(capsys, "generate", kn.default_model_dir(), "--ids", "1", "-n", "2", "--drafter", "model",
                       "--draft-model", str(f))
    assert rc == 2 and f"draft model directory {str(f)!r} is not a directory" in err, err
    rc, _, err = _main(capsys, "generate", str(tmp_path / "missing"), "--ids", "1", "-n", "2")
    assert rc == 2 and "does not exist" in err, err
    (tmp_path / "default").write_text("x")  # a file named `default` here: the name is that path, with a hint
    monkeypatch.chdir(tmp_path)
    rc, _, err = _main(capsys, "generate", "default", "--ids", "1", "-n", "2")
    assert rc == 2 and "model directory 'default' is not a directory (`default` names the embedded model" in err, err


def test_usage_errors_are_argparse_style(capsys, no_debug):
    """Usage errors found after parsing used to exit 1 with a bare message; they now look like
    argparse's own: the usage line, "kdtree-native generate: error: ...", exit status 2."""
    for model, argv, message in [(kn.default_model_dir(), (), "give a prompt: --prompt TEXT"),
                                 ("/no/such/model", ("--ids", "1", "--drafter", "model"),
                                  "--drafter model needs --draft-model DIR (only the embedded default model has a "
                                  "default drafter)")]:
        rc, _, err = _main(capsys, "generate", model, *argv)
        assert rc == 2, err
        assert err.startswith("usage: kdtree-native generate") and f"kdtree-native generate: error: {message}" in err


def test_generate_max_seq_len_defaults_to_the_model_limit(capsys, no_debug):
    """The default --max-seq-len (4096) exceeded the embedded model's max_position_embeddings
    (2048) silently: positions the model never saw. The default is now capped at it, and a larger
    explicit value gets a note."""
    model = kn.default_model_dir()
    with open(os.path.join(model, "config.json")) as f:
        limit = json.load(f)["max_position_embeddings"]
    assert limit < 4096
    ids = ",".join(["5"] * (limit - 1))
    rc, _, err = _main(capsys, "generate", model, "--ids", ids, "-n", "2", "--drafter", "none", "--device", "cpu")
    assert rc == 2 and f"exceeds max_seq_len ({limit})" in err, err
    rc, _, err = _main(capsys, "generate", model, "--ids", "1", "-n", "2", "--drafter", "none", "--device", "cpu",
                       "--max-seq-len", str(limit + 8))
    assert rc == 0 and f"note: --max-seq-len {limit + 8} is more than the model's max_position_embeddings" in err, err


def test_closed_stdout_stops_quietly():
    """`kdtree-native generate ... | head -c1`: the reader of stdout goes away and the next write
    raises BrokenPipeError, which used to print "error: BrokenPipeError". Now: no output on
    stderr but the stats line's absence, exit status 1 (Python's documented convention)."""
    r_fd, w_fd = os.pipe()
    env = dict(os.environ)
    env.pop("KDTREE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "kdtree_native", "generate", kn.default_model_dir(), "--ids", "1,5,9",
                          "-n", "64", "--drafter", "none", "--device", "cpu"],
                         stdout=w_fd, stderr=subprocess.PIPE, env=env)
    os.close(w_fd)
    os.close(r_fd)  # before the child writes anything: its first write fails
    _, err = p.communicate(timeout=240)
    assert p.returncode == 1, err
    assert err.decode() == "", err


def test_memory_summary_of_a_gpu_model():
    """The load report's memory line for a model with a CUDA model's properties (FP32 arena, BF16 arena, mode)."""
    from kdtree_native.cli import _memory_summary

    class Fake:
        device, weight_bytes, bf16_weight_bytes, bf16_weights, memory_bytes = "cuda", 125e6, 859e6, "only", 1.6e9

    line = _memory_summary(Fake())
    assert line == ("device cuda, weights 0.12 GB FP32 + 0.86 GB BF16 (bf16_weights only), 1.60 GB held in all "
                    "(cache and workspaces included)"), line


def test_memory_summary_with_int4_experts():
    """A GPU model holding INT4 experts (int4_weight_bytes) and a CPU one: the INT4 bytes are named."""
    from kdtree_native.cli import _memory_summary

    class Gpu:
        device, weight_bytes, bf16_weight_bytes, bf16_weights, memory_bytes = "cuda", 125e6, 300e6, "only", 1.2e9
        int4_weight_bytes = 158e6

    assert _memory_summary(Gpu()) == ("device cuda, weights 0.12 GB FP32 + 0.30 GB BF16 + 0.16 GB INT4 experts "
                                      "(bf16_weights only), 1.20 GB held in all (cache and workspaces included)")

    class Cpu:
        device, fp32_weight_bytes, bf16_weight_bytes, int4_weight_bytes, memory_bytes = "cpu", 10e6, 300e6, 158e6, 0.5e9

    assert _memory_summary(Cpu()) == ("device cpu, 0.47 GB of weights (0.30 GB as BF16, 0.16 GB as INT4), 0.50 GB "
                                      "held in all (cache and workspaces included)")
