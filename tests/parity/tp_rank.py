"""One rank of a tensor-parallel inspector session; ``torchrun --nproc-per-node 2 tp_rank.py MODEL OUT.json``.

tests/parity/test_tensor_parallel.py starts it. Each rank loads the checkpoint twice: whole (the
one-process reference, loaded before torch.distributed starts) and sharded by transformers' own
``tp_plan="auto"`` (this rank's share of the heads: q_proj, k_proj and v_proj split by output
columns, so rank r holds query heads r*H/W .. and KV heads r*Hkv/W ..). Both are stepped by an
inspector ``Session`` on the same prompt. Rank 0 then gathers every rank's captured q, K, V and
softmax rows per head over gloo (what a window on rank 0 would need) and writes, as JSON, the
reference's and the sharded run's tokens and the largest differences; the test judges them.
"""

from __future__ import annotations

import json
import os
import sys

import torch

PROMPT = "She eats an apple. He reads a book."
STEPS = 4


def main(folder: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import gpt_inspector as gi
    from gpt_inspector.core import hf
    from gpt_inspector.core.models import from_model

    ref = gi.Session(gi.load_model(folder, device="cpu"), PROMPT)  # before torch.distributed starts
    ref.step()
    ref.run(STEPS)
    model, tok = hf.load_tensor_parallel(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = from_model(model, tok, "tp-shard")
    s = gi.Session(lm, PROMPT)
    s.step()
    s.run(STEPS)
    t = s.cache_length
    result: dict = {"world": world, "rank_heads": lm.n_heads, "rank_kv_heads": lm.n_kv_heads,
                    "ref_heads": ref.n_heads, "tokens": s.tokens, "ref_tokens": ref.tokens}  # fmt: skip
    # every rank computed the whole vocabulary (lm_head gathers its output): compare each step's logits
    logits = torch.stack([st.logits for st in s.steps_done])  # (steps, V)
    ref_logits = torch.stack([st.logits for st in ref.steps_done])  # (steps, V)
    result["logits_max_abs"] = float((logits - ref_logits).abs().max())
    result["logits_scale"] = float(ref_logits.abs().max())
    diffs = {}
    for layer in range(lm.n_layers):
        q, k, v = (torch.as_tensor(x) for x in s.qkv(layer))  # (H/W, T, d), (Hkv/W, T, d), (Hkv/W, T, d)
        probs = s.attention_rows(layer, 0, t)  # (H/W, T, T)
        for name, local in (("q", q), ("k", k), ("v", v), ("probs", probs)):
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            whole = torch.cat(parts)  # (H, ...) or (Hkv, ...): the heads in the reference's order
            if rank == 0:
                if name == "probs":
                    want = ref.attention_rows(layer, 0, t)  # (H, T, T)
                else:
                    want = torch.as_tensor(ref.qkv(layer)[("q", "k", "v").index(name)])
                same = whole.shape == want.shape
                diffs[f"{layer}.{name}"] = [float((whole - want).abs().max()) if same else None,
                                            float(want.abs().max()), list(whole.shape)]  # fmt: skip
    if rank == 0:
        result["captured"] = diffs
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2])
