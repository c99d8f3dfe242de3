"""Nsight Compute on the Triton kernels: run a KDA or short-conv case inside a CUDA profiler range, then read the
source page that ncu exports (warp-stall samples by SASS opcode, by instruction, and by stall reason per kernel).

    # one inference forward and one forward + backward of chunk_kda at B,T,H (K = V = 128)
    ncu --clock-control none --profile-from-start off --set full -k regex:'^_(prep|state|bwd)' \\
        --kernel-name-base function -o kda python3 -m benchmarks.ncu kda --shape 1,8192,96
    # one fused short conv + SiLU forward and backward at the small preset's 32K-token shape
    ncu --clock-control none --profile-from-start off --set full -k regex:_conv_silu -o conv \\
        python3 -m benchmarks.ncu short-conv
    # the source page of a report, then the samples of its 10th kernel launch, or the stalls of named kernels
    ncu -i kda.ncu-rep --page source --csv --print-source sass | gzip > kda_source.csv.gz
    python benchmarks/ncu.py source kda_source.csv.gz 10 --top 30
    python benchmarks/ncu.py stalls kda_source.csv.gz [kernel ...] [--top 14]

The profiled range holds exactly those launches (the warm-up and Triton's compilation run before it), so
`ncu --profile-from-start off` sees nothing else. The report gives per kernel DRAM bytes, L2 hit rate, issue-slot
use, occupancy and the warp stall reasons (docs/kda-kernels.md, "Measurements"). The source page has no line
information; an offline compile of the same kernel at the same settings (`benchmarks/spills.py --sass`) gives the
same SASS, and `nvdisasm -g` on it maps each instruction to its Triton line.

ncu charges a stall to the instruction that cannot issue: a `long_sb` stall sits on the first consumer of a late
global load (or on a write to a register that an in-flight memory instruction still reads), a `short_sb` one on the
consumer of a shared-memory load or an MUFU result.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json

SAMPLES = "Warp Stall Sampling (All Samples)"


# ---- profiled cases (need a GPU) ------------------------------------------------------------------------------

def profile_kda(shape: str, tuning: str) -> None:
    """One inference forward and one forward + backward of chunk_kda at dense B,T,H inside the profiler range."""
    import torch

    from benchmarks.kda import forward_steps

    B, T, H = (int(x) for x in shape.split(","))
    if tuning:
        from k3.ops.kda.tuning import TUNING

        TUNING.update(json.loads(tuning))
    forward, forward_backward = forward_steps(B, T, H, "cuda")
    for _ in range(2):  # compile every specialisation, warm the allocator
        forward()
        forward_backward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    forward()
    forward_backward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward and one forward+backward at B={B} T={T} H={H}")


def profile_short_conv() -> None:
    """One fused short conv + SiLU forward and backward at T = 32,768, C = 1,024 inside the profiler range (the
    kernels run at about 1 TB/s there, docs/fast-paths.md)."""
    import torch

    from benchmarks.short_conv import inputs
    from k3.ops.short_conv import short_conv_silu

    T, C = 32768, 1024
    wide, w, cu = inputs(T, C, "cuda", torch.bfloat16)
    x = wide[..., C:2 * C].detach().requires_grad_()  # the model's column slice of the projection (rows 3C apart)
    w = w.detach().requires_grad_()
    dy = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # compile and warm up outside the profiled range
        torch.autograd.grad(short_conv_silu(x, w, cu), (x, w), dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.autograd.grad(short_conv_silu(x, w, cu), (x, w), dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one short conv + SiLU forward and backward at T={T} C={C}")


# ---- the source page ------------------------------------------------------------------------------------------

def sections(path: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, its SASS rows)] of a (gzipped) `--page source --csv --print-source sass` export, one per
    profiled launch in launch order: each section is `"Kernel Name","<name>",` then a CSV table."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out = []
    for part in text.split('"Kernel Name",')[1:]:
        header, body = part.split("\n", 1)
        out.append((header.strip().strip(",").strip('"'), list(csv.DictReader(io.StringIO(body)))))
    return out


def stall_columns(rows: list[dict]) -> list[str]:
    return [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]


def opcode_report(name: str, rows: list[dict], top: int) -> None:
    """One launch's samples by SASS opcode (with its three main stall reasons), then its `top` instructions."""
    reasons = stall_columns(rows)
    samples = [int(r[SAMPLES] or 0) for r in rows]
    total = sum(samples) or 1
    print(f"{name}: {len(rows)} instructions, {total} samples")
    by_op, op_stalls = collections.Counter(), collections.defaultdict(collections.Counter)
    for r, s in zip(rows, samples):
        words = r["Source"].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "")
        op = op.split(".")[0]
        by_op[op] += s
        for c in reasons:
            op_stalls[op][c] += int(r[c] or 0)
    for op, s in by_op.most_common(14):
        main = " ".join(f"{c[6:]}={100 * v / total:.1f}" for c, v in op_stalls[op].most_common(3) if v)
        print(f"{op:10s} {100 * s / total:5.1f}%  {main}")
    print("--- top instructions (index, share, SASS, two main stall reasons)")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:top]):
        two = sorted(((int(rows[i][c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        print(f"{i:5d} {100 * samples[i] / total:5.1f}% {rows[i]['Source'].strip()[:60]:60s} {two}")


def stall_report(name: str, rows: list[dict], top: int) -> None:
    """One kernel's stall reasons by share, then the `top` instructions by samples with their two main reasons."""
    total = sum(int(r[SAMPLES] or 0) for r in rows)
    reasons = stall_columns(rows)
    shares = {c[6:]: sum(int(r[c] or 0) for r in rows) / max(total, 1) for c in reasons}
    print(f"== {name}: {total} samples over {len(rows)} instructions")
    print("   " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(shares.items(), key=lambda x: -x[1])[:7]))
    for i in sorted(range(len(rows)), key=lambda i: -int(rows[i][SAMPLES] or 0))[:top]:
        r = rows[i]
        mine = sorted(((int(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        print(f"   {i:5d} {100 * int(r[SAMPLES]) / max(total, 1):4.1f}%  {r['Source'].strip()[:64]:64s} "
              + ", ".join(f"{reason} {n}" for n, reason in mine))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    kda = sub.add_parser("kda", help="profile one KDA forward and one forward + backward (GPU)")
    kda.add_argument("--shape", default="1,8192,96", help="B,T,H (K = V = 128)")
    kda.add_argument("--tuning", default="", help="JSON: TUNING overrides, as benchmarks.kda --tuning")
    sub.add_parser("short-conv", help="profile one short conv + SiLU forward and backward (GPU)")
    source = sub.add_parser("source", help="one launch's stall samples by SASS opcode and by instruction")
    source.add_argument("export", help="the source-page CSV (.gz or plain)")
    source.add_argument("section", type=int, help="1-based kernel launch, in launch order")
    source.add_argument("--top", type=int, default=25, help="instructions to list")
    stalls = sub.add_parser("stalls", help="stall reasons and top instructions per kernel")
    stalls.add_argument("export", help="the source-page CSV (.gz or plain)")
    stalls.add_argument("kernels", nargs="*", help="kernel names (default: every kernel in the export)")
    stalls.add_argument("--top", type=int, default=14, help="instructions to list per kernel")
    args = p.parse_args()
    if args.command == "kda":
        profile_kda(args.shape, args.tuning)
    elif args.command == "short-conv":
        profile_short_conv()
    elif args.command == "source":
        found = sections(args.export)
        if not 1 <= args.section <= len(found):
            p.error(f"section {args.section}: the export has {len(found)} kernel launches")
        opcode_report(*found[args.section - 1], args.top)
    else:
        for name, rows in sections(args.export):
            if not args.kernels or name in args.kernels:
                stall_report(name, rows, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
