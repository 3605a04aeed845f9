#!/usr/bin/env python3
"""Writes a Hugging Face GPT-2 checkpoint directory with random weights, for testing `ringtrain --init`.

  python3 scripts/make_hf_dir.py OUT --model tiny|small|gpt2 [--random] [--seed N] [--force]

OUT gets config.json and model.safetensors (plus the generation_config.json that transformers adds), written
by transformers' GPT2LMHeadModel.save_pretrained, i.e. exactly the layout `from_pretrained` reads back:
`transformer.`-prefixed keys, Conv1D weights stored [in, out], fp32, the tied lm_head not stored. With
--model gpt2 the shapes are those of the real GPT-2 124M (vocab 50257, n_positions 1024), so the loader can be
exercised on them without downloading anything (about 500 MB on disk).

Weights:
  default   transformers' GPT-2 init, seeded: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer),
            biases 0, layer norms 1/0 (the same scheme ringtrain uses, though not the same random numbers).
  --random  additionally draws every bias and layer-norm parameter at random (bias ~ N(0, 0.02), LN weight
            ~ 1 + N(0, 0.1), LN bias ~ N(0, 0.1)), so that a loader that drops, swaps or transposes one of
            those tensors changes the logits, which the zero/one defaults would hide.

The key names, shapes and dtypes actually stored in model.safetensors are printed at the end.
"""
import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ringtrain_presets import PRESETS, hf_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="write a random-weight HF GPT-2 directory for a ringtrain preset",
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT", help="directory to write (created)")
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpt2")
    ap.add_argument("--random", action="store_true", help="also randomise biases and layer norms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="write into OUT even if it is not empty")
    args = ap.parse_args()

    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        ap.error(f"{args.out} exists and is not empty (use --force to write into it)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"{args.out} exists and is not a directory")

    try:
        import torch
        from safetensors import safe_open
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"error: needs torch, transformers and safetensors ({e}); see scripts/requirements.txt",
              file=sys.stderr)
        return 2

    try:
        import transformers
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    torch.manual_seed(args.seed)
    cfg = hf_config(args.model)
    model = GPT2LMHeadModel(cfg).float()
    if args.random:
        g = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() != 1:
                    continue
                if ".ln_" in name or name.startswith("transformer.ln_f"):
                    base = 1.0 if name.endswith(".weight") else 0.0
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
                else:  # a bias of a Conv1D
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))

    kwargs = {}
    # transformers 4.x took safe_serialization (default True since 4.35); 5.x always writes safetensors and
    # no longer lists the argument.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, **kwargs)

    path = os.path.join(args.out, "model.safetensors")
    if not os.path.isfile(path):
        print(f"error: save_pretrained wrote no {path} (files: {os.listdir(args.out)})", file=sys.stderr)
        return 1
    for name in os.listdir(args.out):  # save_pretrained may leave 0600 files; make them readable to all
        os.chmod(os.path.join(args.out, name), 0o644)
    n = 0
    with safe_open(path, framework="pt") as f:
        keys = sorted(f.keys())
        print(f"wrote {args.out} ({args.model}: L={cfg.n_layer} C={cfg.n_embd} NH={cfg.n_head} V={cfg.vocab_size} "
              f"n_positions={cfg.n_positions}; {'--random' if args.random else 'GPT-2 init'}, seed {args.seed})")
        print(f"files: {', '.join(sorted(os.listdir(args.out)))}")
        print(f"{len(keys)} tensors in model.safetensors (metadata {f.metadata()}):")
        for k in keys:
            sl = f.get_slice(k)
            shape = sl.get_shape()
            n += int(torch.tensor(shape).prod()) if shape else 1
            print(f"  {k:40s} {sl.get_dtype():4s} {shape}")
    print(f"{n} parameters, {os.path.getsize(path) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
