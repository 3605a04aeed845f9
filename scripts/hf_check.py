#!/usr/bin/env python3
"""Checks a GPT-2 checkpoint directory against Hugging Face transformers.

The directory (config.json + model.safetensors, HF GPT-2 layout) is loaded with
`transformers.GPT2LMHeadModel.from_pretrained(dir)`, HF runs a forward pass on a fixed input, and its logits
are compared with an expectation file written by someone else (normally ringtrain).

Exchange format (safetensors):
  inputs   int32/int64 [B, T]   token ids, each < vocab_size, T <= n_positions
  logits   f32 [B, T, V]        the logits the other implementation produced for `inputs`
  targets  int32 [B, T]         optional; with `loss` the mean cross-entropy is compared as well
  loss     f32 [1]              optional

Modes (one is required):
  --expect FILE        run HF on FILE's `inputs` and compare with FILE's `logits`
  --write-expect FILE  build the fixed input, run HF, and write `inputs` + `logits` to FILE, so that
                       ringtrain (or anyone) can compare against HF the other way round
  --self-test          --write-expect to a temporary file, load the checkpoint afresh and --expect it; then
                       check that a perturbed expectation is rejected (the comparison is not vacuous)

The fixed input: the bytes of --tokens (default: a pangram) taken modulo vocab_size, tiled over --batch rows of
--seq-len tokens; or, with --seed N, uniform random ids drawn from a torch generator seeded with N.

Exit status: 0 = match (or SKIP when torch/transformers/safetensors are missing), 1 = mismatch or a checkpoint
that does not load cleanly, 2 = bad usage or a malformed expectation file.
"""
import argparse
import math
import os
import sys
import tempfile

DEFAULT_TEXT = "the quick brown fox jumps over the lazy dog. "


class LoadError(Exception):
    """The checkpoint directory cannot be loaded by transformers (exit status 1)."""


def usage_error(msg):
    """Bad arguments or a malformed expectation file (exit status 2)."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="HF GPT-2 directory (config.json, model.safetensors)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--expect", metavar="FILE", help="safetensors file with `inputs` and `logits` to compare with")
    mode.add_argument("--write-expect", metavar="FILE", help="write HF's `inputs` and `logits` to FILE and exit")
    mode.add_argument("--self-test", action="store_true", help="write an expectation, reload and compare it")
    ap.add_argument("--tokens", metavar="TEXT", default=DEFAULT_TEXT,
                    help="text whose UTF-8 bytes (mod vocab) form the fixed input (default: %(default)r)")
    ap.add_argument("--seed", type=int, default=None,
                    help="use random token ids from this seed instead of --tokens")
    ap.add_argument("--batch", type=int, default=2, help="rows of the fixed input (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="tokens per row (default: min(32, n_positions))")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs logit difference allowed; 0 = bit-exact (default: %(default)g)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    return ap.parse_args(argv)


def import_stack():
    """torch, transformers and safetensors.torch, or None when any is missing."""
    # A local directory never needs the hub; make sure nothing tries to reach it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        import transformers
        import safetensors.torch
    except ImportError as e:
        return None, str(e)
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    return (torch, transformers, safetensors.torch), None


def load_model(torch, transformers, ckpt):
    """Loads `ckpt` with from_pretrained. Returns (model, problems); problems are reasons to fail."""
    if not os.path.isdir(ckpt):
        raise LoadError(f"{ckpt}: not a directory")
    for f in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(ckpt, f)):
            raise LoadError(f"{ckpt}: missing {f}")
    # Eager attention is the plain softmax(QK^T/sqrt(d))V; it is the clearest statement of the contract.
    try:
        model, info = transformers.GPT2LMHeadModel.from_pretrained(
            ckpt, attn_implementation="eager", output_loading_info=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, RuntimeError, ...)
        raise LoadError(f"{ckpt}: transformers could not load it: {type(e).__name__}: {e}") from e
    model = model.float().eval()

    problems = []
    # lm_head is tied to wte and deliberately not stored: it is the one key allowed to be "missing".
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    if missing:
        problems.append(f"{len(missing)} parameter(s) absent from the checkpoint and randomly initialised by "
                        f"transformers: {', '.join(sorted(missing)[:8])}{' ...' if len(missing) > 8 else ''}")
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        problems.append(f"shape mismatches: {mismatched[:8]}")
    unexpected = info.get("unexpected_keys", [])
    if unexpected:
        print(f"note: {len(unexpected)} key(s) in the checkpoint that GPT2LMHeadModel does not use: "
              f"{', '.join(sorted(unexpected)[:8])}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        problems.append("lm_head.weight is not tied to transformer.wte.weight")
    return model, problems


def fixed_input(torch, args, cfg):
    V, P = cfg.vocab_size, cfg.n_positions
    T = args.seq_len or min(32, P)
    B = args.batch
    if T < 1 or B < 1:
        usage_error("--batch and --seq-len must be positive")
    if T > P:
        usage_error(f"--seq-len {T} exceeds n_positions {P}")
    if args.seed is not None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, V, (B, T), generator=g, dtype=torch.long)
    data = args.tokens.encode("utf-8")
    if not data:
        usage_error("--tokens is empty")
    n = B * T
    ids = [data[i % len(data)] % V for i in range(n)]
    return torch.tensor(ids, dtype=torch.long).view(B, T)


def hf_logits(torch, model, inputs):
    with torch.no_grad():
        return model(input_ids=inputs).logits.float()


def read_expect(st, torch, path, cfg):
    if not os.path.isfile(path):
        usage_error(f"{path}: no such file")
    try:
        t = st.load_file(path)
    except Exception as e:  # safetensors raises its own error types for a bad header
        usage_error(f"{path}: not a readable safetensors file ({e})")
    for k in ("inputs", "logits"):
        if k not in t:
            usage_error(f"{path}: no tensor named {k!r} (has: {', '.join(sorted(t)) or 'none'})")
    inputs, logits = t["inputs"], t["logits"]
    if inputs.dtype not in (torch.int32, torch.int64):
        usage_error(f"{path}: `inputs` must be int32 or int64, found {inputs.dtype}")
    if inputs.dim() == 1:
        inputs = inputs.unsqueeze(0)
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
    if inputs.dim() != 2:
        usage_error(f"{path}: `inputs` must be [B, T], found {list(inputs.shape)}")
    B, T = inputs.shape
    if list(logits.shape) != [B, T, cfg.vocab_size]:
        usage_error(f"{path}: `logits` is {list(logits.shape)}, expected [{B}, {T}, {cfg.vocab_size}] "
                         f"for `inputs` {list(inputs.shape)} and this checkpoint's vocab")
    if T > cfg.n_positions:
        usage_error(f"{path}: T={T} exceeds the checkpoint's n_positions {cfg.n_positions}")
    lo, hi = int(inputs.min()), int(inputs.max())
    if lo < 0 or hi >= cfg.vocab_size:
        usage_error(f"{path}: token ids span [{lo}, {hi}], outside [0, {cfg.vocab_size})")
    extra = {}
    if "targets" in t and "loss" in t:
        extra = {"targets": t["targets"].long().view(B, T), "loss": t["loss"].float().reshape(-1)[0]}
    return inputs.long(), logits.float(), extra


def compare(torch, model, inputs, want, extra, tol, label):
    """Runs HF on `inputs` and compares with `want`. Returns True when within tolerance."""
    got = hf_logits(torch, model, inputs)
    if not torch.isfinite(want).all():
        print(f"{label}: expected logits contain NaN/Inf")
        return False
    diff = (got - want).abs()
    max_diff = float(diff.max())
    b, t, v = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
    scale = float(got.abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    ok = math.isfinite(max_diff) and max_diff <= tol
    print(f"{label}: logits {list(got.shape)}  max |hf - expected| = {max_diff:.3e} at [{b},{t},{v}] "
          f"(hf {float(got[b, t, v]):.6f}, expected {float(want[b, t, v]):.6f}); max |logit| {scale:.3f}; "
          f"argmax agreement {agree * 100:.1f}%  tol {tol:g}  -> {'OK' if ok else 'MISMATCH'}")
    if extra:
        V = got.shape[-1]
        loss = float(torch.nn.functional.cross_entropy(got.reshape(-1, V), extra["targets"].reshape(-1)))
        d = abs(loss - float(extra["loss"]))
        lok = d <= tol
        print(f"{label}: loss hf {loss:.6f} expected {float(extra['loss']):.6f}  |diff| {d:.3e} "
              f"-> {'OK' if lok else 'MISMATCH'}")
        ok = ok and lok
    return ok


def write_expect(torch, st, transformers, model, inputs, path, ckpt):
    logits = hf_logits(torch, model, inputs)
    meta = {"producer": "scripts/hf_check.py", "torch": torch.__version__,
            "transformers": transformers.__version__, "checkpoint": os.path.abspath(ckpt)}
    st.save_file({"inputs": inputs.to(torch.int32).contiguous(), "logits": logits.contiguous()}, path, metadata=meta)
    print(f"wrote {path}: inputs {list(inputs.shape)} int32, logits {list(logits.shape)} f32")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stack, why = import_stack()
    if stack is None:
        print(f"SKIP: transformers not installed ({why}); see scripts/requirements.txt")
        return 0
    torch, transformers, st = stack
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    try:
        model, problems = load_model(torch, transformers, args.checkpoint)
    except LoadError as e:
        print(f"FAIL: {e}")
        return 1
    cfg = model.config
    print(f"loaded {args.checkpoint}: L={cfg.n_layer} C={cfg.n_embd} NH={cfg.n_head} V={cfg.vocab_size} "
          f"n_positions={cfg.n_positions} act={cfg.activation_function} eps={cfg.layer_norm_epsilon} "
          f"(torch {torch.__version__}, transformers {transformers.__version__})")
    for p in problems:
        print(f"FAIL: {p}")
    if problems:
        return 1

    if args.write_expect:
        write_expect(torch, st, transformers, model, fixed_input(torch, args, cfg), args.write_expect, args.checkpoint)
        return 0

    if args.expect:
        inputs, want, extra = read_expect(st, torch, args.expect, cfg)
        ok = compare(torch, model, inputs, want, extra, args.tol, "check")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1

    # --self-test: write, reload the checkpoint from disk, compare; then make sure a wrong answer is caught.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "expect.safetensors")
        write_expect(torch, st, transformers, model, fixed_input(torch, args, cfg), path, args.checkpoint)
        try:
            model2, problems = load_model(torch, transformers, args.checkpoint)
        except LoadError as e:
            problems = [str(e)]
        if problems:
            print("FAIL: second load: " + "; ".join(problems))
            return 1
        inputs, want, extra = read_expect(st, torch, path, cfg)
        ok = compare(torch, model2, inputs, want, extra, args.tol, "self-test roundtrip")
        bad = want.clone()
        bad[0, -1, 0] += 10 * args.tol
        caught = not compare(torch, model2, inputs, bad, extra, args.tol, "self-test perturbed (must mismatch)")
        if not caught:
            print("FAIL: a perturbed expectation was accepted")
    ok = ok and caught
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
