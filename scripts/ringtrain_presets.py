"""GPT-2 model presets shared by the helper scripts in this folder.

They mirror ringtrain's `--model tiny|small|gpt2` presets (ARCHITECTURE.md, "Numerics"): pre-LN blocks,
layer-norm eps 1e-5, gelu_new, no dropout, LM head tied to wte, fp32.

Import only the plain dict from here; `hf_config()` and `adamw()` import transformers and torch lazily so
that a missing install can be reported by the caller.
"""

PRESETS = {
    # name: (n_layer, n_embd, n_head, n_positions, vocab_size)
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256),
    "small": dict(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=256),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
}


def hf_config(name):
    """A transformers.GPT2Config for preset `name`, with ringtrain's numerics (no dropout, gelu_new)."""
    from transformers import GPT2Config

    if name not in PRESETS:
        raise SystemExit(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    # The byte-level presets use token 0 as BOS/EOS (as the golden reference does); the 124M preset keeps
    # GPT-2's own <|endoftext|> id.
    special = 50256 if p["vocab_size"] == 50257 else 0
    return GPT2Config(
        vocab_size=p["vocab_size"],
        n_positions=p["n_positions"],
        n_embd=p["n_embd"],
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special,
        eos_token_id=special,
    )


def adamw(model, lr):
    """torch.optim.AdamW with ringtrain's defaults: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on tensors of
    rank >= 2 only (not on biases or layer-norm parameters)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)
