"""`python -m harness.emulated_check`: a few emulated dispatch + combine calls
checked against the oracle, as one process to run under compute-sanitizer or ncu.

    python -m harness.emulated_check --preset small          # sanitizer cases
    python -m harness.emulated_check -w 8 --hidden 8192 --tokens 4096 --topk 8 \
        --experts 16 --calls 3 --no-check                              # the seed shape, for ncu
    python -m harness.emulated_check --device cpu --preset small   # the CPU model

Exit status 0 when every call matched the oracle, 1 when one did not (the message names the
case, rank and row), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from hybrid_ep.dtypes import DISPATCH_BY_NAME
from hybrid_ep.verify.cases import Case

from .emulated import check_emulated, emulated_group_for

# Small cases that touch every path once: bf16 with padding and a zero-token rank, fp8 with
# scales, fp32 static size with overflow on a non-power-of-two group.
SMALL_CASES = (
    Case(4, 4, 8, 256, (33, 0, 17, 5), 2, torch.bfloat16, pad_multiple=16, backend="cuda"),
    Case(2, 2, 4, 256, (9, 17), 2, torch.float8_e4m3fn, drop_fraction=0.2, backend="cuda"),
    Case(3, 3, 6, 128, (17, 1, 8), 4, torch.float32, num_out_tokens=12, backend="cuda"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.emulated_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU (hybrid_ep._C); cpu: the CPU model (hybrid_ep._model)")
    p.add_argument("--preset", choices=("small",), default=None,
                   help="small: three small cases covering bf16 + padding, fp8, fp32 static size")
    p.add_argument("-w", "--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=33, help="tokens per rank")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts", type=int, default=None, help="default 2 x world size")
    p.add_argument("--dtype", choices=tuple(DISPATCH_BY_NAME), default="bf16")
    p.add_argument("--sms", type=int, default=None, help="SMs per rank (default: the backend's)")
    p.add_argument("--calls", type=int, default=2, help="dispatch + combine pairs per case (other seeds)")
    p.add_argument("--no-check", action="store_true", help="run only (profiling): no oracle")
    return p


def cases_from(args) -> list[Case]:
    if args.preset == "small":
        return list(SMALL_CASES)
    experts = args.experts or 2 * args.world_size
    return [Case(args.world_size, args.world_size, experts, args.hidden, (args.tokens,) * args.world_size,
                 args.topk, DISPATCH_BY_NAME[args.dtype], backend="cuda")]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("emulated_check: --device cuda needs a CUDA device (use --device cpu for the CPU model)",
              file=sys.stderr)
        return 2
    for case in cases_from(args):
        group = emulated_group_for(case, args.device)
        try:
            for call in range(args.calls):
                seeded = dataclasses.replace(case, seed=call)
                t0 = time.perf_counter()
                check_emulated(group, seeded, num_sms=args.sms, check=not args.no_check)
                verdict = "run" if args.no_check else "matches the oracle"
                print(f"emulated_check [{args.device}] {seeded} call {call}: {verdict} "
                      f"({time.perf_counter() - t0:.2f} s)", flush=True)
        except AssertionError as err:
            print(f"emulated_check [{args.device}] FAILED: {err}", file=sys.stderr)
            return 1
        finally:
            group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
