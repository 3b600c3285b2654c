"""The lab's two runs as one batch of two: the same steps as the runs stepped one at a time, all or nothing."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
import tiny_families
import tiny_models
import torch
from interrupting import interrupted_during

from gpt_inspector.core.kvlab import KVLab, make
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads a book. They walk"


def _batches(lm) -> tuple[list[int], object]:
    """Every forward's batch size, as the model sees it."""
    sizes: list[int] = []
    hook = lm.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    return sizes, hook


def _apart(lm, policy, n: int, **kw) -> KVLab:
    lab = KVLab(lm, PROMPT, policy, **kw)
    lab._pair = None  # the runs one at a time: the independent computation
    lab.run_steps(n)
    return lab


def _assert_same_steps(lab: KVLab, apart: KVLab) -> None:
    # batch rows of two and forwards of one may round the matrix products differently: the tokens
    # are the same, the numbers equal to float32 rounding of their magnitude
    assert lab.run.tokens == apart.run.tokens and lab.reference.tokens == apart.reference.tokens
    for run in ("reference", "run"):
        for x, y in zip(getattr(lab, run).steps_done, getattr(apart, run).steps_done):
            tol = 2e-5 * max(1.0, float(y.logits.abs().max()))
            assert torch.allclose(x.logits, y.logits, rtol=0, atol=tol), run
    for x, y in zip(lab.history, apart.history):
        assert x.kl == pytest.approx(y.kl, rel=1e-3, abs=1e-6)
        np.testing.assert_allclose(x.lost_mass, y.lost_mass, rtol=0, atol=1e-5)  # NaN where the texts parted
        assert x.evicted_now == y.evicted_now
        assert x.bytes_policy == y.bytes_policy and x.agree == y.agree


def _policy(name):
    if name == "int4":
        return make(name, residual=4)
    return make(name, 12 if name == "snapkv" else 6)  # SnapKV keeps its 8-entry window beyond the budget


@pytest.mark.parametrize("family,name", [("gpt2", "h2o"), ("llama", "tova"), ("gemma2", "streaming"),
                                         ("qwen2", "int4"), ("gpt_neox", "snapkv")])  # fmt: skip
def test_the_runs_step_as_one_batch_and_equal_the_runs_stepped_apart(family, name, tiny_lm):
    lm = tiny_lm(family)
    sizes, hook = _batches(lm)
    try:
        lab = KVLab(lm, PROMPT, _policy(name))
        lab.run_steps(7)
    finally:
        hook.remove()
    assert sizes == [2] * 7  # one forward a step, both runs in it
    _assert_same_steps(lab, _apart(lm, _policy(name), 7))


@pytest.mark.parametrize("family", ["bloom", "gpt_oss", "deepseek_v3", "mistral", "bamba"])
def test_other_attention_kinds_pair_or_step_apart_with_the_same_numbers(family, tmp_path_factory):
    # ALiBi (a score bias per row: not pairable), sinks, a latent cache, a sliding window, a hybrid's own cache
    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))
    lm = from_model(
        tiny_families.build_model(family, tok.convert_tokens_to_ids("<|endoftext|>")),
        tok,
        family,
    )
    lab = KVLab(lm, PROMPT, make("h2o", 6))
    lab.run_steps(5)
    _assert_same_steps(lab, _apart(lm, make("h2o", 6), 5))
    if family in ("bloom", "bamba"):
        assert lab._pair is None or not lab._pair.ready()


def test_free_running_runs_pair_on_different_tokens(tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make("streaming", 5), free_running=True)
    lab.run_steps(8)
    assert lab.parted_at is not None  # the texts part, and the batch keeps each run's own
    _assert_same_steps(lab, _apart(lm, make("streaming", 5), 8, free_running=True))


def test_an_interrupt_inside_the_paired_forward_or_a_commit_undoes_both(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make("h2o", 5))
    lab.run_steps(3)
    real = lab.policy.observe

    def interrupted(layer, *a):
        if layer == 1:  # halfway through the forward: layer 0 of both rows is already in the pair's cache
            raise KeyboardInterrupt
        return real(layer, *a)

    monkeypatch.setattr(lab.policy, "observe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lab.step()
    monkeypatch.setattr(lab.policy, "observe", real)
    assert len(lab.history) == lab.run.n_steps == lab.reference.n_steps == 3
    assert lab.run.cache_length == lab.reference.cache_length == len(lab.run.tokens) - 1
    monkeypatch.setattr(
        lab.reference,
        "_make_step",
        lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()),
    )
    with pytest.raises(KeyboardInterrupt):
        lab.step()  # the forward ran; the reference's commit was cut off
    monkeypatch.undo()
    assert len(lab.history) == lab.run.n_steps == lab.reference.n_steps == 3
    assert lab.run.cache_length == lab.reference.cache_length == len(lab.run.tokens) - 1
    again = lab.run_steps(3)
    clean = KVLab(lm, PROMPT, make("h2o", 5))
    want = clean.run_steps(6)[3:]
    assert [s.kl for s in again] == [s.kl for s in want] and lab.run.tokens == clean.run.tokens


def test_a_step_back_then_the_same_steps_again_is_exact(tiny_lm):
    lm = tiny_lm("gpt2")
    lab = KVLab(lm, PROMPT, make("tova", 6))
    first = lab.run_steps(6)
    for _ in range(3):
        lab.step_back()
    again = lab.run_steps(3)
    assert [s.kl for s in again] == [s.kl for s in first[3:]]
    assert [s.lost_mass.tolist() for s in again] == [s.lost_mass.tolist() for s in first[3:]]
    assert lab.run.tokens == lab.reference.tokens


def test_the_lens_reads_each_runs_own_row_of_the_batch(tiny_lm):
    from gpt_inspector.core import lens as lens_mod

    lm = tiny_lm("llama")
    lens_mod.enable(lm)  # its hooks record the residual stream during the paired forward
    lab = KVLab(lm, PROMPT, make("h2o", 6))
    lab.run_steps(5)
    apart = _apart(lm, make("h2o", 6), 5)
    for run in ("reference", "run"):
        got, want = lens_mod.lens(getattr(lab, run)), lens_mod.lens(getattr(apart, run))
        assert getattr(lab, run).recorder.residual_length == getattr(lab, run).cache_length  # recorded, not recomputed
        assert [x.prob for x in got.layers] == pytest.approx([x.prob for x in want.layers], rel=1e-4, abs=1e-6)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_at_any_moment_leaves_the_lab_like_a_clean_one(tiny_lm):
    lm = tiny_lm("llama")
    t0 = time.perf_counter()
    KVLab(lm, PROMPT, make("h2o", 6)).run_steps(5)
    per_step = (time.perf_counter() - t0) / 5
    rnd = random.Random(7)
    interrupted = 0
    for _ in range(12):
        lab = KVLab(lm, PROMPT, make("h2o", 6))
        interrupted += interrupted_during(lambda: lab.run_steps(12), rnd.uniform(0, per_step * 12))
        n = len(lab.history)
        assert lab.run.n_steps == lab.reference.n_steps == n
        for s in (lab.run, lab.reference):
            t = len(s.tokens) - 1 if n else 0
            assert s.cache_length == t and s.recorder.length == t
        clean = KVLab(lm, PROMPT, make("h2o", 6))
        want = clean.run_steps(n + 2)[n:]
        got = lab.run_steps(2)
        assert [x.kl for x in got] == pytest.approx(
            [x.kl for x in want], rel=1e-9
        ) and lab.run.tokens == clean.run.tokens
    assert interrupted >= 3


def test_a_model_refused_partway_through_the_pair_steps_apart_with_the_policy_untouched(tiny_lm, monkeypatch):
    # Unpairable from a later layer: layer 0's attention already ran (and the policy scored it) in the
    # refused forward; the lab must step on as if that forward never happened
    from gpt_inspector.core import capture

    real = capture.RowRecorders.attend

    def refuse_at_layer_1(self, module, *a, **kw):
        if module.layer_idx == 1:
            raise capture.Unpairable("per-row arguments at layer 1")
        return real(self, module, *a, **kw)

    lm = tiny_lm("llama")
    monkeypatch.setattr(capture.RowRecorders, "attend", refuse_at_layer_1)
    lab = KVLab(lm, PROMPT, make("h2o", 6))
    got = lab.run_steps(6)
    assert lab._pair is None
    monkeypatch.undo()
    apart = _apart(lm, make("h2o", 6), 6)
    assert [s.kl for s in got] == [s.kl for s in apart.history] and lab.run.tokens == apart.run.tokens
    for layer in range(lm.n_layers):
        assert torch.equal(lab.policy.evicted_at[layer], apart.policy.evicted_at[layer])
        assert torch.equal(lab.policy.scores[layer], apart.policy.scores[layer])  # H2O's sums: nothing counted twice
