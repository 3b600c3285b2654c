"""Ctrl+C at any moment of a run or a mask recompute leaves a session equal to a clean replay."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
import torch
from interrupting import interrupted_during

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit


def _close(a, b, exact):
    if exact:
        np.testing.assert_array_equal(a, b)
    else:  # a rolled-back mask edit refills the cache in one chunk: float rounding may differ
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _assert_like_fresh(lm, s, exact=True, **kw):
    """``s`` must equal a fresh session replayed to the same step, and step on identically."""
    n = s.n_steps
    fresh = gi.Session(lm, "She eats an apple", **kw)
    fresh.run(n) if n else None
    for me in s.mask_edits:
        fresh.add_mask_edit(me)
    assert s.tokens == fresh.tokens
    assert len(s.tokens) == len(s.prompt_ids) + n
    want = len(s.tokens) - 1 if n else 0
    for layer in s.cache.layers:
        assert (layer.get_seq_length() if getattr(layer, "is_initialized", True) else 0) == want
    assert s.recorder.length == want
    if n:
        _close(s.current.logits.numpy(), fresh.current.logits.numpy(), exact)
    if not s.finished:
        a, b = s.step(), fresh.step()
        assert a.token_id == b.token_id
        _close(a.logits.numpy(), b.logits.numpy(), exact)
        _close(s.attention(1, 0), fresh.attention(1, 0), exact)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_sigint_during_run_rolls_back_to_a_clean_step(tiny_lm):
    lm = tiny_lm("llama")
    kw = dict(temperature=1.0, top_k=50, seed=3)  # sampling: the generator state must roll back too
    # how long one step takes here, to spread the interrupts over whole runs
    t0 = time.perf_counter()
    gi.Session(lm, "She eats an apple", **kw).run(5)
    per_step = (time.perf_counter() - t0) / 5
    rnd = random.Random(1234)
    interrupted = 0
    deadline = time.monotonic() + 60
    for _ in range(20):
        if time.monotonic() > deadline:
            break
        s = gi.Session(lm, "She eats an apple", **kw)
        interrupted += interrupted_during(lambda: s.run(30), rnd.uniform(0, per_step * 20))
        _assert_like_fresh(lm, s, **kw)
    assert interrupted >= 5  # the test did interrupt mid-run, not only between runs


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_sigint_during_mask_recompute_restores_the_previous_state(tiny_lm):
    lm = tiny_lm("gpt2")
    rnd = random.Random(99)
    t0 = time.perf_counter()
    s = gi.Session(lm, "She eats an apple")
    s.run(20)
    s.set_mask_edits([MaskEdit(5, 1, layer=0)])
    per_recompute = time.perf_counter() - t0
    interrupted = 0
    for _ in range(15):
        s = gi.Session(lm, "She eats an apple")
        s.run(20)
        before = (list(s.tokens), s.current.logits.clone(), s.attention(1, 0).copy())
        interrupted += interrupted_during(lambda: s.set_mask_edits([MaskEdit(5, 1, layer=0)]),
                                          rnd.uniform(0, per_recompute * 0.2))  # fmt: skip
        if s.mask_edits:  # the edit finished before the interrupt: it must be complete
            _assert_like_fresh(lm, s)
        else:
            assert s.tokens == before[0]
            assert torch.equal(s.current.logits, before[1])  # never touched before the commit
            _close(s.attention(1, 0), before[2], exact=False)
            assert all(layer.get_seq_length() == len(s.tokens) - 1 for layer in s.cache.layers)
            _assert_like_fresh(lm, s, exact=False)
    assert interrupted >= 1


def test_keyboard_interrupt_is_not_wrapped_in_step_failed(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, "She eats an apple")
    s.run(2)
    mlp = lm.model.transformer.h[1].mlp

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlp, "forward", boom)
    with pytest.raises(KeyboardInterrupt):
        s.step()
    monkeypatch.undo()
    _assert_like_fresh(lm, s)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_sigint_during_beam_search_then_finishing_gives_the_uninterrupted_result(tiny_lm):
    from gpt_inspector.core.beams import BeamSearch

    lm = tiny_lm("gpt2")
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=12)
    t0 = time.perf_counter()
    ref = BeamSearch(lm, "She eats an apple", **kw)
    ref.run()
    whole = time.perf_counter() - t0
    want = ref.result().sequences
    rnd = random.Random(7)
    interrupted = 0
    for _ in range(10):
        b = BeamSearch(lm, "She eats an apple", **kw)
        interrupted += interrupted_during(b.run, rnd.uniform(0, whole))
        assert b.cache_length == (len(b.prompt_ids) + b.n_steps - 1 if b.n_steps else 0)
        if not b.done:
            b.run()
        assert b.result().sequences == want
    assert interrupted >= 3


def test_rollback_repairs_a_layer_whose_keys_outgrew_its_values(tiny_lm):
    """Ctrl+C between a cache layer's two concatenations leaves keys one longer than values."""
    from gpt_inspector.core.forward import crop_cache

    s = gi.Session(tiny_lm("gpt2"), "She eats an apple")
    s.run(3)
    n = s.cache_length
    layer = s.cache.layers[1]
    layer.keys = torch.cat([layer.keys, layer.keys[..., -1:, :]], dim=-2)  # keys n+1, values n
    crop_cache(s.cache, n)
    assert layer.keys.shape[-2] == layer.values.shape[-2] == n
    _assert_like_fresh(tiny_lm("gpt2"), s)


def test_rollback_of_a_layer_interrupted_right_after_lazy_initialisation():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from gpt_inspector.core.forward import crop_cache

    cache = DynamicCache()
    layer = DynamicLayer()
    layer.lazy_initialization(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))  # 1-D empty placeholders
    cache.layers.append(layer)
    crop_cache(cache, 0)  # must not index a placeholder's missing sequence dimension
    assert layer.get_seq_length() == 0
    k, v = layer.update(torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 8))
    assert k.shape == v.shape == (1, 4, 2, 8)


def test_rollback_of_a_prompt_interrupted_between_its_keys_and_values(tiny_lm):
    # the prompt's forward, cut after a layer concatenated its keys onto the lazy placeholder and
    # before its values: the keys must go too (they were kept, and the session read them as a cache
    # of the whole prompt with no step taken; the random-SIGINT test above caught it once)
    from gpt_inspector.core.forward import crop_cache

    lm = tiny_lm("llama")
    s = gi.Session(lm, "She eats an apple")
    s.run(1)
    layer = s.cache.layers[1]
    layer.values = torch.tensor([], dtype=layer.keys.dtype)  # (0,) the placeholder: values not written yet
    crop_cache(s.cache, 0)
    assert [x.get_seq_length() for x in s.cache.layers] == [0, 0]
    k, v = layer.update(torch.ones(1, lm.n_kv_heads, 2, lm.head_dim), torch.ones(1, lm.n_kv_heads, 2, lm.head_dim))
    assert k.shape == v.shape == (1, lm.n_kv_heads, 2, lm.head_dim)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_the_interrupting_helper_works_where_the_shell_ignored_sigint():
    # CI started in the background inherits SIGINT ignored: the random-SIGINT tests above would
    # then interrupt nothing and fail on their count
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert interrupted_during(lambda: time.sleep(2), 0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back as it was
    finally:
        signal.signal(signal.SIGINT, previous)
