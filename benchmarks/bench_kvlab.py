"""Cost of the KV cache lab, side by side, per decoded token.

GPT2Config() defaults (124M parameters, random weights), a prompt of 512 tokens (``--prompts``),
``--new`` decode steps. Printed per policy:

- policy step / plain step: one Session stepping under the policy against a plain Session (the
  simulated cache's attention, masked or written out, plus the bookkeeping), and the share of that
  step spent inside the policy's own calls: its bookkeeping (scoring, eviction, quantization,
  deferred evictions included; target <= 10%);
- lab step / HF generate: one lockstep step (reference and policy run as one batch of two, then
  the measures) against HF generate's per-token decode time (target <= 2.2);
- the state the lab keeps after each step for an exact step back, against a lab step;
- the lockstep run against HF generate (untimed, once per prompt): the lab's reference tokens and
  logits against ``generate``'s greedy ones on the same prompt, and whether the policy run's
  tokens (teacher-forced) were fed the same.

A policy is a name or ``name:option=value:...`` with the serving options (``schedule``, ``page``,
``share``), e.g. ``h2o:page=16:schedule=4`` or ``tova:share=layer``; or a kvpress-exact press run by
``from_press``, ``press:NAME[:ratio=R][:every=K]`` (NAME: knorm, streaming, keydiff, random;
``every``: also compress while decoding after every K-th step, default 1, so that each step pays for it).

Then the sweep (``--sweep-jobs N``, default 2; 0 skips it): the same sweep (policies x budgets
over ``--sweep-prompts`` prompts) with jobs=1 and jobs=N, wall time side by side (worker start-up
and model loads included), and the ratio (ideal: 1/N on N free cores).

Runs alternate so machine noise hits every side alike; medians over ``--reps``.

``--policy-alone``: instead, each eviction policy's own calls (attend, observe and the deferred
batched pass) on GPT-2-small shapes with fixed tensors and no model, ms per decode step, the best of
``--reps``: the policy's overhead without the forward's noise (compare two checkouts run one after
the other on the same machine).

    python benchmarks/bench_kvlab.py [--reps 3] [--new 32] [--prompts 512] [--policies h2o,streaming,int4]
                                     [--sweep-jobs 2] [--sweep-prompts 4] [--sweep-len 256] [--sweep-steps 16]
                                     [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import build


def per_token(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def _time_calls(policy) -> list[float]:
    """Wrap the policy's two per-layer calls to add their wall time to the returned cell."""
    spent = [0.0]
    for attr in ("attend", "observe"):
        fn = getattr(policy, attr)

        def timed(*a, _fn=fn, **kw):  # a press's attend also takes the forward's query
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(policy, attr, timed)
    return spent


def policy_from(spec: str, budget: int):
    """``name`` or ``name:option=value:...`` (the serving options) as a policy; a quantization takes no budget."""
    from gpt_inspector.core.kvlab import make

    name, *opts = spec.split(":")
    if name == "press":  # a kvpress-exact press, per step: press:knorm:ratio=0.5:every=1
        from gpt_inspector.core.kvlab import presses
        from gpt_inspector.core.kvlab.press_policy import from_press

        kind, *opts = opts
        kw = dict(o.split("=", 1) for o in opts)
        cls = {"knorm": presses.KnormPress, "streaming": presses.StreamingLLMPress, "keydiff": presses.KeyDiffPress,
               "random": presses.RandomPress}[kind]  # fmt: skip
        return from_press(cls(compression_ratio=float(kw.get("ratio", 0.5))), every=int(kw.get("every", 1)),
                          name=spec)  # fmt: skip
    kw = {k: int(v) if v.isdigit() else v for k, v in (o.split("=", 1) for o in opts)}
    return make(name, None if name.startswith(("int", "fp8")) else budget, **kw)


def lockstep(hf, labs: dict, ids: list[int], args) -> None:
    """The lab's reference against HF generate's greedy run on the same prompt, and each policy run's
    fed tokens against the reference's (teacher-forced: they must be the same)."""
    first = next(iter(labs.values()))
    n = len(first.history)
    x = torch.tensor([ids], device=args.device)
    with torch.inference_mode():
        g = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                        output_logits=True, return_dict_in_generate=True)  # fmt: skip
    want = g.sequences[0, len(ids) :].tolist()
    worst = max(float((s.logits.float() - lg[0].float().cpu()).abs().max())
                for s, lg in zip(first.reference.steps_done, g.logits))  # fmt: skip
    same = first.reference.tokens[len(ids) :][:n] == want
    fed = all(lab.run.tokens[len(ids) :][:n] == want for lab in labs.values())
    print(f"  lockstep vs HF generate, {n} greedy tokens: reference tokens {'the same' if same else 'DIFFERENT'}, "
          f"max |logit diff| {worst:.2e} (HF sdpa vs the inspector's eager attention); every policy run fed the "
          f"same tokens: {'yes' if fed else 'NO'}")  # fmt: skip


def bench_policy_alone(args) -> None:
    """attend + observe per layer for ``--new`` decode steps after a prompt of ``--prompts`` tokens."""

    n_layers, n_heads, d = 12, 12, 64
    t0, n = int(args.prompts.split(",")[0]), args.new
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n_heads, t0 + n + 1, d, generator=g) for _ in range(3))  # (1, H, T, d)
    prompt_probs = torch.softmax(torch.randn(1, n_heads, t0, t0, generator=g), -1)  # (1, H, T0, T0)
    row = torch.softmax(torch.randn(1, n_heads, 1, t0 + n + 1, generator=g), -1)  # (1, H, 1, T), cut per step

    def once(name) -> float:
        p = policy_from(name, args.budget)
        p.bind(n_layers, n_heads, n_heads, d, 1024, 4)
        for layer in range(n_layers):
            p.attend(layer, k[:, :, :t0], v[:, :, :t0], 0, n_heads)
            p.observe(layer, q[:, :, :t0], k[:, :, :t0], None, d**-0.5, None, prompt_probs)
        start = time.perf_counter()
        for tk in range(t0 + 1, t0 + n + 1):
            for layer in range(n_layers):
                p.attend(layer, k[:, :, :tk], v[:, :, :tk], tk - 1, n_heads)
                probs = row[..., :tk] if p.reads_probs else None
                p.observe(layer, q[:, :, tk - 1 : tk], k[:, :, :tk], None, d**-0.5, None, probs)
        _ = p.evicted_at  # reading it runs the last step's deferred pass
        return (time.perf_counter() - start) / n

    names = [x for x in args.policies.split(",") if not x.startswith(("int", "fp8"))]
    best = {name: min(once(name) for _ in range(args.reps)) for name in names}
    print(f"policy alone, {n_layers} layers x {n_heads} heads, prompt {t0}, budget {args.budget}: "
          + ", ".join(f"{name} {ms * 1e3:.2f} ms/step" for name, ms in best.items()))  # fmt: skip


def bench_sweep(lm, folder, args) -> None:
    """jobs=1 against jobs=N on one sweep, alternating, medians over --reps."""
    import os

    from gpt_inspector.core.kvlab.sweep import plan, sweep

    g = torch.Generator().manual_seed(1)
    prompts = [lm.tokenizer.decode(torch.randint(0, 50000, (args.sweep_len,), generator=g).tolist())
               for _ in range(args.sweep_prompts)]  # fmt: skip
    pairs = plan(args.policies.split(","), [args.budget // 2, args.budget])
    pairs = [(n, b if b is None else min(b, args.sweep_len // 2)) for n, b in pairs]
    load = {"name_or_path": str(folder), "device": "cpu"}
    times: dict[int, list[float]] = {1: [], args.sweep_jobs: []}
    rows = {}
    for _ in range(args.reps):
        for jobs in times:
            t0 = time.perf_counter()
            r = sweep(lm, prompts, pairs, args.sweep_steps, probe=False, jobs=jobs, load=load)
            times[jobs].append(time.perf_counter() - t0)
            rows[jobs] = [(x.mean_kl, x.bytes_policy) for x in r.rows]
    one, many = (statistics.median(times[j]) for j in times)
    same = "the same rows" if rows[1] == rows[args.sweep_jobs] else "DIFFERENT rows"
    print(f"sweep of {len(pairs)} (policy, budget) x {len(prompts)} prompts of {args.sweep_len} tokens, "
          f"{args.sweep_steps} steps, {os.cpu_count()} cores: jobs=1 {one:.2f} s, jobs={args.sweep_jobs} {many:.2f} s "
          f"= {many / one:.3f}x ({same}; ideal {1 / args.sweep_jobs:.3f}x on free cores)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompts", default="512")
    ap.add_argument(
        "--policies", default="h2o,streaming,tova,h2o:page=16:schedule=4,tova:share=layer,press:knorm,int4,fp8-e4m3"
    )
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (1 keeps a loaded machine's thread-pool stalls out of small ops)",
    )
    ap.add_argument("--sweep-jobs", type=int, default=2, help="worker processes to compare with one (0: no sweep)")
    ap.add_argument("--sweep-prompts", type=int, default=4)
    ap.add_argument("--sweep-len", type=int, default=256)
    ap.add_argument("--sweep-steps", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the lab, the plain session and generate")
    ap.add_argument("--only-sweep", action="store_true", help="skip the per-token measures")
    ap.add_argument("--policy-alone", action="store_true", help="only the eviction policies' own calls, no model")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.policy_alone:
        bench_policy_alone(args)
        return

    from transformers import AutoModelForCausalLM

    import gpt_inspector as gi
    from gpt_inspector.core.capture import Recorder
    from gpt_inspector.core.kvlab import KVLab

    folder = build(Path(tempfile.mkdtemp()) / "gpt2-small-random")
    lm = gi.load_model(folder, device=args.device)
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}")
    if args.only_sweep:
        if args.sweep_jobs > 1:
            bench_sweep(lm, folder, args)
        return
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval().to(args.device)
    g = torch.Generator().manual_seed(0)
    names = args.policies.split(",")

    def policy(spec):
        return policy_from(spec, args.budget)

    for plen in (int(p) for p in args.prompts.split(",")):
        ids = torch.randint(0, 50000, (plen,), generator=g).tolist()
        n = args.new - 2  # decode steps timed after the prefill and one warm-up step
        times: dict[str, list[float]] = {}
        labs: dict = {}
        for _ in range(args.reps):
            x = torch.tensor([ids], device=args.device)
            kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
                t1 = time.perf_counter()
                hf.generate(x, max_new_tokens=args.new, min_new_tokens=args.new, **kw)
                t2 = time.perf_counter()
            times.setdefault("hf", []).append(((t2 - t1) - (t1 - t0)) / (args.new - 1))
            plain = gi.Session(lm, prompt_ids=ids)
            plain.step()
            plain.step()
            times.setdefault("plain", []).append(per_token(plain.step, n))
            for name in names:
                # the policy run alone: a Session whose recorder carries the policy, as the lab sets it up
                s = gi.Session(lm, prompt_ids=ids)
                s.recorder = Recorder(lm.n_layers, mirror_kv=True)
                p = policy(name)
                p.bind(lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.context_length, 4, lm.device)
                p.attach(s.recorder)
                if hasattr(p, "bind_model"):  # a press reads the attention modules' inputs (as KVLab binds it)
                    p.bind_model(lm.model)
                s.step()
                s.step()  # the first decode step quantizes the whole prompt once: not the steady state
                inside = _time_calls(p)
                times.setdefault(f"run:{name}", []).append(per_token(s.step, n))
                # the share of those same steps spent inside the policy's calls: robust to machine load
                times.setdefault(f"share:{name}", []).append(inside[0] / n / times[f"run:{name}"][-1])
                lab = KVLab(lm, prompt_ids=ids, policy=policy(name))
                lab.step()
                lab.step()
                times.setdefault(f"lab:{name}", []).append(per_token(lab.step, n))
                labs[name] = lab
                # what the lab keeps after each step so a step back restores the policy exactly
                times.setdefault(f"keep:{name}", []).append(per_token(lab.policy.snapshot, n))
        med = {k: statistics.median(v) * (1 if k.startswith("share:") else 1e3) for k, v in times.items()}
        print(
            f"prompt {plen} + {args.new} new: HF generate {med['hf']:.2f} ms/token, plain Session.step {med['plain']:.2f} ms/token"
        )
        for name in names:
            r, lab_ms = med[f"run:{name}"], med[f"lab:{name}"]
            print(f"  {name:<9} policy step {r:7.2f} ms = {r / med['plain']:.3f}x plain, of which {med[f'share:{name}']:.1%} "
                  f"inside the policy (target <= 10%); lab step {lab_ms:7.2f} ms = {lab_ms / med['hf']:.3f}x HF generate "
                  "(target <= 2.2)")  # fmt: skip
            keep = med[f"keep:{name}"]
            print(f"  {'':<9} state kept per step for step back {keep:.3f} ms = {keep / lab_ms:.2%} of a lab step")
        lockstep(hf, labs, ids, args)
    if args.sweep_jobs > 1:
        bench_sweep(lm, folder, args)


if __name__ == "__main__":
    main()
