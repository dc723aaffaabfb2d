"""Streaming: kn.Engine.stream / generation.stream yield each round's new tokens while generate runs
in a background thread (python/kdtree_native/generation.py TokenStream).

* the streamed chunks concatenate to generate()'s tokens (AR and DDTree drafters), are the
  acceptance lengths round by round, and .result is the GenerationResult;
* arguments are checked when the stream is made (the same errors as generate, nothing held after);
  a drafter's error is raised by the iteration; the engine is usable after either;
* the Engine is held while the stream is open (other calls raise RuntimeError), released at its end;
* close() / leaving the with block / breaking out stops the call early and the engine is usable.
"""
import threading
import time

import numpy as np
import pytest

from kdtree_native.drafters import NgramDrafter, OracleDrafter
from kdtree_native.generation import generate, stream
from test_engine_loop import PROMPT, _native_engine, toy


@pytest.fixture(scope="module")
def eng():
    return _native_engine(5)


P = np.array([3, 17, 42, 99, 3, 17, 42, 8, 3, 17], np.int64)


def test_chunks_are_the_rounds_of_generate(eng):
    ref = eng.generate(P, 40)
    for kw in ({}, dict(drafter=NgramDrafter(), tree_budget=8, depth=4),
               dict(drafter=OracleDrafter(ref.tokens, 0.3, vocab_size=eng.vocab_size), tree_budget=16, depth=6)):
        seen = []
        s = eng.stream(P, 40, progress=lambda new, done, total: seen.append(done), **kw)
        chunks = list(s)
        assert np.array_equal(np.concatenate(chunks), ref.tokens), kw
        assert all(c.dtype == np.int32 for c in chunks)
        r = s.result
        assert np.array_equal(r.tokens, ref.tokens)
        # the first token (prefill), then one chunk per round of acceptance_lengths[i] tokens
        assert [len(c) for c in chunks] == [1] + list(r.acceptance_lengths), kw
        assert seen == list(np.cumsum([len(c) for c in chunks]))   # the caller's progress still called
    # the module-level form on a native target
    t = toy(48, 256, seed=7)
    assert np.array_equal(np.concatenate(list(stream(t, PROMPT, 30, drafter=NgramDrafter(), tree_budget=8))),
                          generate(t, PROMPT, 30).tokens)


def test_bad_arguments_raise_when_made_and_nothing_is_held(eng):
    for kw, err in ((dict(max_new_tokens=-1), ValueError), (dict(tree_budget="x"), (TypeError, ValueError)),
                    (dict(temperature=-1.0), ValueError), (dict(progress=3), TypeError),
                    (dict(adaptive_budget="no"), TypeError)):
        args = dict(max_new_tokens=8)
        args.update(kw)
        with pytest.raises(err):
            eng.stream(P, **args)
    assert np.array_equal(eng.generate(P, 8).tokens, np.concatenate(list(eng.stream(P, 8))))


def test_a_drafter_error_is_raised_by_the_iteration(eng):
    class Boom(RuntimeError):
        pass

    def bad(ctx, depth, top_k):
        if len(ctx) > len(P) + 3:
            raise Boom("drafter failed")
        return None

    s = eng.stream(P, 30, drafter=bad, tree_budget=4, depth=2)
    got = []
    with pytest.raises(Boom, match="drafter failed"):
        for c in s:
            got.append(c)
    assert len(got) >= 1 and s.result is None
    assert list(s) == []                           # exhausted: no more chunks, no second raise
    assert np.array_equal(eng.generate(P, 12).tokens[:12], eng.generate(P, 12).tokens)


def test_the_engine_is_held_while_a_stream_is_open(eng):
    gate = threading.Event()

    def slow(ctx, depth, top_k):
        gate.wait(5)
        return None

    s = eng.stream(P, 6, drafter=slow, tree_budget=4, depth=2)
    with pytest.raises(RuntimeError, match="busy with stream"):
        eng.generate(P, 4)
    with pytest.raises(RuntimeError, match="busy with stream"):
        eng.stream(P, 4)
    gate.set()
    assert len(np.concatenate(list(s))) == 6
    assert len(eng.generate(P, 4).tokens) == 4      # released at the end


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_stopping_early_ends_the_call(eng, how):
    ref = eng.generate(P, 200).tokens
    calls = []

    def counting(ctx, depth, top_k):
        calls.append(len(ctx))
        time.sleep(0.002)
        return None

    if how == "with":
        with eng.stream(P, 200, drafter=counting, tree_budget=4, depth=2) as s:
            first = next(s)
    else:
        s = eng.stream(P, 200, drafter=counting, tree_budget=4, depth=2)
        first = next(s)
        if how == "close":
            s.close()
            assert list(s) == [] and s.result is None
        else:
            del s
    assert first[0] == ref[0]
    deadline = time.time() + 10
    while True:   # (dropped: the call stops at its next round, in the background)
        try:
            out = eng.generate(P, 20).tokens
            break
        except RuntimeError:
            assert time.time() < deadline, "the stream's call did not stop"
            time.sleep(0.01)
    assert np.array_equal(out, ref[:20])
    assert len(calls) < 150   # stopped well before its 200 tokens
