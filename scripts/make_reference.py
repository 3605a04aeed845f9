#!/usr/bin/env python3
"""Writes the PyTorch golden state of the `tiny` GPT-2 that tests/reference.rs and tests/wgpu_training.rs
check ringtrain against: the initial model as a Hugging Face directory, one batch, and what one training
step must produce (logits, loss, every gradient, every parameter after one torch.optim.AdamW step).

usage: python3 scripts/make_reference.py [OUTDIR]    (default: tests/fixtures/gpt2-tiny-pytorch)
needs: python3 -m pip install -r scripts/requirements.txt

The committed dump was written with torch 2.x on CPU; a rerun with another torch build may differ in the
last bits, well inside the tests' tolerances.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ_LEN = 4, 32
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gpt2-tiny-pytorch")


def tiny_config():
    # ringtrain's `tiny` preset; dropout off so that the step is deterministic.
    return GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                      activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


def one_batch(vocab):
    # Byte tokens of a fixed sentence, so the batch needs no tokenizer.
    text = (b"the quick brown fox jumps over the lazy dog. " * 8)[: BATCH * (SEQ_LEN + 1)]
    tokens = torch.tensor(list(text), dtype=torch.long).view(BATCH, SEQ_LEN + 1)
    assert int(tokens.max()) < vocab
    return tokens[:, :SEQ_LEN].contiguous(), tokens[:, 1:].contiguous()


def adamw_for(model):
    # Decoupled weight decay on tensors of rank >= 2 only, as ringtrain does.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": ADAMW["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=DEFAULT_OUT)
    out = parser.parse_args().out

    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT2LMHeadModel(cfg).float().train()
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)

    inputs, targets = one_batch(cfg.vocab_size)
    logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    adamw_for(model).step()

    tensors = {"inputs": inputs.to(torch.int32), "targets": targets.to(torch.int32),
               "logits": logits.detach(), "loss": loss.detach().reshape(1)}
    tensors.update({f"grad.{name}": g for name, g in grads.items()})
    tensors.update({f"updated.{name}": p.detach().clone() for name, p in model.named_parameters()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "expected.safetensors"))
    summary = {"batch": BATCH, "seq_len": SEQ_LEN, "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
               "loss": loss.item(),
               "note": "weight decay on tensors of rank >= 2 only; lm_head is tied to transformer.wte"}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {out}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
