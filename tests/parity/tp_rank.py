"""One rank of a tensor-parallel inspector session: ``torchrun --nproc-per-node W tp_rank.py MODEL OUT PROMPT STEPS``.

tests/parity/test_tensor_parallel.py starts it. Each rank loads the checkpoint sharded by
transformers' own ``tp_plan="auto"`` (its share of the heads: q_proj, k_proj and v_proj split by
output columns, so rank r holds query heads r*H/W .. and KV heads r*Hkv/W ..), wires the inspector
into it (probe and fidelity self-test included) and steps a ``Session`` on PROMPT. Rank 0 then
gathers every rank's captured q, K, V and softmax rows per head over the process group (what a
window on rank 0 would need) and writes them with the step tokens and logits to OUT (safetensors);
the test compares them with one process's session.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(folder: str, out: str, prompt: str, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from safetensors.torch import save_file

    import gpt_inspector as gi
    from gpt_inspector.core import hf
    from gpt_inspector.core.models import from_model

    model, tok = hf.load_tensor_parallel(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = from_model(model, tok, "tp-shard")
    s = gi.Session(lm, prompt)
    s.step()
    s.run(steps)
    t = s.cache_length
    tensors = {
        "tokens": torch.tensor(s.tokens),  # (T,)
        "logits": torch.stack([st.logits for st in s.steps_done]),  # (steps, V): lm_head gathers the vocabulary
    }
    for layer in range(lm.n_layers):
        q, k, v = (torch.as_tensor(x) for x in s.qkv(layer))  # (H/W, T, d), (Hkv/W, T, d), (Hkv/W, T, d)
        probs = s.attention_rows(layer, 0, t)  # (H/W, T, T)
        for name, local in (("q", q), ("k", k), ("v", v), ("probs", probs)):
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            tensors[f"{layer}.{name}"] = torch.cat(parts)  # (H, ...) or (Hkv, ...): rank order is head order
    if rank == 0:
        shapes = {"world": world, "rank_heads": lm.n_heads, "rank_kv_heads": lm.n_kv_heads}
        save_file(tensors, out, metadata={"shapes": json.dumps(shapes)})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
