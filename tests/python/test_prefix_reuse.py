"""generate(reuse_prefix=True): the cache entries the previous generate left are kept for the longest
common prefix of its tokens and the new prompt, and only the rest is prefilled (cpp/engine/engine.h
GenerateParams::reuse_prefix), when the target's cache epoch shows nothing touched the cache since.

* multi-turn on the toy target (whose logits depend only on the cache's (token, position) entries:
  reuse must give exactly a fresh call's tokens) and on the CPU model, AR and DDTree: the counts
  reused, and the tokens equal to a fresh call's;
* rounds cut short (max_new_tokens, a stop token) that committed path nodes past the last emitted
  token: those entries are not reused;
* anything in between disables it: a forward / commit / truncate / reset / prefill / decode on the
  engine, the model used by another engine's ModelDrafter, a failed generate, reuse_prefix=False.
"""
import numpy as np
import pytest

from kdtree_native import _native
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
from kdtree_native.generation import generate
from test_engine_loop import PROMPT, _native_engine, toy

P = np.array([3, 17, 42, 99, 3, 17, 42, 8, 3, 17], np.int64)


def turns(target, drafter_kw, n=24, follow=15):
    """Two turns: (the second's result with reuse, the same call without)."""
    a = generate(target, P, n, reuse_prefix=True, **drafter_kw())
    assert a.stats["prefill_reused"] == len(P) - 1   # the caller generated from P just before
    p2 = np.concatenate([P, a.tokens[:follow], [5, 6, 7]])
    b = generate(target, p2, n, reuse_prefix=True, **drafter_kw())
    fresh = generate(target, p2, n, **drafter_kw())
    assert fresh.stats["prefill_reused"] == 0
    return a, b, fresh


@pytest.mark.parametrize("kind", ["toy", "cpu"])
@pytest.mark.parametrize("mode", ["ar", "ngram", "oracle"])
def test_second_turn_reuses_the_first(kind, mode):
    target = toy(128, 512, seed=3) if kind == "toy" else _native_engine(5)
    V = 128 if kind == "toy" else target.vocab_size
    ref = generate(target, P, 60).tokens
    make = {"ar": lambda: {},
            "ngram": lambda: dict(drafter=NgramDrafter(), tree_budget=8, depth=4),
            "oracle": lambda: dict(drafter=OracleDrafter(np.concatenate([ref, ref]), 0.3, vocab_size=V),
                                   tree_budget=16, depth=6)}[mode]
    a, b, fresh = turns(target, make)
    assert b.stats["prefill_reused"] == len(P) + 15
    assert np.array_equal(b.tokens, fresh.tokens)
    # the same prompt again (after `fresh`): everything but its last token
    p2 = np.concatenate([P, a.tokens[:15], [5, 6, 7]])
    c = generate(target, p2, 24, reuse_prefix=True, **make())
    assert c.stats["prefill_reused"] == len(p2) - 1 and np.array_equal(c.tokens, fresh.tokens)
    # a prompt that differs from the first token on
    d = generate(target, np.concatenate([[7], p2[1:]]), 8, reuse_prefix=True)
    assert d.stats["prefill_reused"] == 0


def test_entries_past_the_last_emitted_token_are_not_reused():
    """A stop token inside an accepted path ends the call there, but the round committed the whole
    path (root + 6 oracle nodes): the entries past the stop token are not reused."""
    t = toy(128, 512, seed=3)
    ref = generate(t, P, 40).tokens
    stop = int(ref[3])
    assert stop not in ref[:3]
    c = generate(t, P, 30, drafter=OracleDrafter(ref, vocab_size=128), tree_budget=16, depth=6,
                 stop_token_ids=[stop], reuse_prefix=True)
    k = len(c.tokens)
    assert c.tokens[-1] == stop and k == 4 and t.cache_len > len(P) + k   # more entries than emitted
    p2 = np.concatenate([P, ref[:20]])            # continues with the true text past the stop token
    e = generate(t, p2, 10, reuse_prefix=True)
    assert e.stats["prefill_reused"] == len(P) + k
    assert np.array_equal(e.tokens, generate(t, p2, 10).tokens)
    # max_new_tokens never leaves such entries: a round's depth is capped at what may still be emitted
    generate(t, P, 3, drafter=OracleDrafter(ref, vocab_size=128), tree_budget=16, depth=6, reuse_prefix=True)
    assert t.cache_len == len(P) + 2
    assert generate(t, p2, 10, reuse_prefix=True).stats["prefill_reused"] == len(P) + 2   # (last token: uncached)


def _calls(eng):
    ids = P[:4]
    return {
        "forward": lambda: eng.forward(np.array([1]), np.array([eng.cache_len])),
        "commit": lambda: (eng.forward(np.array([1]), np.array([eng.cache_len])), eng.commit([0])),
        "truncate": lambda: eng.truncate(eng.cache_len - 1),
        "reset": lambda: eng.reset(),
        "prefill": lambda: eng.prefill(ids),
        "decode": lambda: eng.decode(5),
    }


@pytest.mark.parametrize("call", list(_calls(None)))
def test_anything_in_between_disables_it(call):
    eng = _native_engine(5)
    a = eng.generate(P, 12, reuse_prefix=True)
    p2 = np.concatenate([P, a.tokens])
    _calls(eng)[call]()
    b = eng.generate(p2, 8, reuse_prefix=True)
    assert b.stats["prefill_reused"] == 0, call
    assert np.array_equal(b.tokens, eng.generate(p2, 8).tokens)


def test_used_as_a_draft_model_or_a_failed_call_disables_it():
    eng, other = _native_engine(5), _native_engine(6)
    a = eng.generate(P, 12, reuse_prefix=True)
    p2 = np.concatenate([P, a.tokens])
    other.generate(P, 12, drafter=ModelDrafter(eng), tree_budget=4, depth=3)   # drafts with eng's model
    assert eng.generate(p2, 8, reuse_prefix=True).stats["prefill_reused"] == 0

    eng.generate(P, 12, reuse_prefix=True)

    def boom(ctx, depth, top_k):
        raise RuntimeError("drafter failed")

    with pytest.raises(RuntimeError, match="drafter failed"):
        eng.generate(p2, 8, drafter=boom, tree_budget=4, depth=2, reuse_prefix=True)
    assert eng.generate(p2, 8, reuse_prefix=True).stats["prefill_reused"] == 0
    # off: never reused
    assert eng.generate(p2, 8).stats["prefill_reused"] == 0
    with pytest.raises(TypeError, match="reuse_prefix"):
        eng.generate(p2, 8, reuse_prefix=1)
