"""The command line (`python -m kdtree_native`): info, demo and generate run end to end on the
embedded default model and print what they promise; bad arguments fail with a message."""
import os
import subprocess
import sys

import pytest

import kdtree_native as kn


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


def test_generate_bad_arguments_fail_cleanly():
    r = _run("generate", "/nonexistent/model/dir", "--ids", "1,2", "-n", "4")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "does not exist" in r.stderr
    r = _run("generate", kn.default_model_dir(), "--ids", "1,999999", "-n", "4", "--device", "cpu")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "999999" in r.stderr and "vocab" in r.stderr
    r = _run("demo", "--device", "tpu")
    assert r.returncode != 0 and "invalid choice" in r.stderr
