#!/usr/bin/env python3
"""Reads the JSON lines of a benchmark (ringtrain `bench step` / `bench kernels`, or torch_ref.py) from stdin
and prints one `FIGURE<TAB>NOTE` line for bench/device/run.sh's results file. Standard library only.

  figures.py step --layers L --embd C [--peak-tflops P] [--impl NAME] [--loss-near X]
      the first line with `tokens_per_s` (and `impl` NAME, when given): tokens/s, and the model FLOP utilisation
      MFU = tokens/s * (6N + 12*L*C*T) / peak, with N = `params` and T = `seq` from that line. The peak
      defaults to 67 TFLOP/s, the fp32 (non-tensor) rate of an H200 SXM (and H100 SXM) by NVIDIA's datasheet.
      With --loss-near X the line's `first_loss` (step 1, from a fresh init: about ln(vocab)) must lie within
      1 of X, else the model computes wrong and the figure is refused.
  figures.py matmul --size S
      the `matmul_forward` line of an S x S x S product: its GFLOP/s (the median over its rounds when it has
      them, as `bench kernels` writes for a GPU backend beside its CPU reference).

Exits 1, with the reason on stderr, when stdin has no such line.
"""
import argparse
import json
import statistics
import sys

H200_SXM_FP32_PEAK_TFLOPS = 67.0


def json_lines(text):
    """Every line of `text` that parses as a JSON object (the tools also print plain log lines)."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            yield value


def flops_per_token(params, layers, embd, seq):
    """Training FLOPs per token: 6N for the matmuls of forward and backward, plus 12*L*C*T for attention."""
    return 6 * params + 12 * layers * embd * seq


def step_figure(lines, layers, embd, peak_tflops, impl=None, loss_near=None):
    line = next((d for d in lines if "tokens_per_s" in d and impl in (None, d.get("impl"))), None)
    if line is None:
        raise LookupError(f"no line with tokens_per_s{f' from {impl}' if impl else ''}")
    for key in ("params", "seq", "tokens_per_s"):
        if not isinstance(line.get(key), (int, float)) or line[key] <= 0:
            raise LookupError(f"the tokens_per_s line has no positive {key}")
    tokens_per_s = line["tokens_per_s"]
    mfu = tokens_per_s * flops_per_token(line["params"], layers, embd, line["seq"]) / (peak_tflops * 1e12)
    note = (
        f"MFU {100 * mfu:.3g}% of {peak_tflops:g} TFLOP/s fp32"
        f" (6N+12LCT: N={line['params']} L={layers} C={embd} T={line['seq']});"
        f" {line.get('ms_per_step', float('nan')):.1f} ms/step, batch {line.get('batch', '?')};"
        f" {line.get('backend') or line.get('impl', '?')}"
    )
    first = line.get("first_loss")
    if loss_near is not None:
        if not isinstance(first, (int, float)) or not abs(first - loss_near) <= 1.0:
            raise LookupError(f"step-1 loss {first} is not within 1 of {loss_near:.3f}: the model computes wrong")
        note += f"; step-1 loss {first:.3f} (expected about {loss_near:.3f})"
    return f"{tokens_per_s:.0f} tok/s", note


def matmul_figure(lines, size):
    line = next(
        (d for d in lines if d.get("op") == "matmul_forward" and d.get("m") == d.get("k") == d.get("n") == size),
        None,
    )
    if line is None:
        raise LookupError(f"no matmul_forward line of size {size}")
    if "rounds" in line:
        rates = [r["gflops"] for r in line["rounds"]]
        cpu = statistics.median(r["cpu_gflops"] for r in line["rounds"])
        extra = f"median of {len(rates)} rounds (min {min(rates):.0f}, max {max(rates):.0f}); CPU backend {cpu:.0f}"
    else:
        rates = [line["gflops"]]
        extra = "one round"
    gflops = statistics.median(rates)
    return f"{gflops:.0f} GFLOP/s", f"{size}^3 fp32 matmul, {extra}; {line.get('backend', '?')}"


def main():
    ap = argparse.ArgumentParser(description="benchmark JSON lines on stdin -> FIGURE<TAB>NOTE")
    sub = ap.add_subparsers(dest="kind", required=True)
    step = sub.add_parser("step", help="tokens/s and MFU of a training-step line")
    step.add_argument("--layers", type=int, required=True)
    step.add_argument("--embd", type=int, required=True)
    step.add_argument("--peak-tflops", type=float, default=H200_SXM_FP32_PEAK_TFLOPS)
    step.add_argument("--impl", help="only the line whose impl is this")
    step.add_argument("--loss-near", type=float, help="the step-1 loss must lie within 1 of this")
    matmul = sub.add_parser("matmul", help="GFLOP/s of a square matmul line")
    matmul.add_argument("--size", type=int, required=True)
    args = ap.parse_args()
    if args.kind == "step" and (args.layers < 1 or args.embd < 1 or not args.peak_tflops > 0):
        ap.error("--layers, --embd and --peak-tflops must be positive")

    lines = list(json_lines(sys.stdin.read()))
    try:
        if args.kind == "step":
            figure, note = step_figure(lines, args.layers, args.embd, args.peak_tflops, args.impl, args.loss_near)
        else:
            figure, note = matmul_figure(lines, args.size)
    except (LookupError, KeyError, TypeError) as e:
        print(f"figures.py {args.kind}: {e}", file=sys.stderr)
        return 1
    print(f"{figure}\t{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
