#!/usr/bin/env python3
"""Jobs for bench/restore_whole_gpu.py: PyTorch on the GPU, deterministic, one line a step on stdout.

    python3 bench/restore_job.py train  --steps N [--sleep S]   a Llama-style model (transformers' config
        classes, random weights), bf16 autocast, AdamW; each step's batch drawn from a generator seeded by the
        step number; prints `step K LOSS` (LOSS as float.hex: bit for bit)
    python3 bench/restore_job.py decode --steps N [--sleep S]   a KV-cache decode loop (GPT-2 from its config):
        one greedy token a step, the cache dropped and a new prompt (seeded by its number) started every 48
        tokens, so the caching allocator frees and reuses blocks; prints `step K TOKEN LOGIT`
After the last step: `done`.  Deterministic kernels (torch.use_deterministic_algorithms, eager attention,
the cuBLAS workspace fixed), so an uninterrupted run is the reference for any run brought back to a step.
--sleep: host time a step (does not change the output), so that a checkpoint and a restore can land between
steps at the pace of a few steps a second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(steps: int, sleep: float) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).cuda()
    model.get_input_embeddings().weight.requires_grad_(False)  # its backward accumulates with atomics
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    for k in range(1, steps + 1):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, cfg.vocab_size, (8, 64), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # freed every step: the allocator hands the blocks to the next step
        say(f"step {k} {loss.float().item().hex()}")
        time.sleep(sleep)


def decode(steps: int, sleep: float) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).cuda().eval()
    past, tok, n = None, None, 0
    with torch.no_grad():
        for k in range(1, steps + 1):
            if past is None or n == 48:
                g = torch.Generator().manual_seed(k)
                ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=g).cuda()
                past, n = None, 0
            else:
                ids = tok
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]
            tok = logits.argmax(dim=-1, keepdim=True)
            n += 1
            say(f"step {k} {int(tok)} {logits.max().float().item().hex()}")
            time.sleep(sleep)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["train", "decode"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    (train if a.kind == "train" else decode)(a.steps, a.sleep)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
