"""A PyTorch training loop for real GPUs: the demo's workload there, and the benchmarks' target.

--mode launch: 4 x Linear(256), Adam, batch 64: launch-bound, about 480 driver calls a step.
--mode gpu:    large matmuls: GPU-bound, the CPU mostly waits.
Prints one JSON line: steps, seconds, steps_per_s (measured after --warmup steps).
"""

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["launch", "gpu"], default="launch")
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="run this long after warm-up (0 with --wait-stdin: until stdin closes)")
    ap.add_argument("--steps", type=int, default=0, help="run exactly this many steps instead")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wait-stdin", action="store_true", help="read a line from stdin before starting to time")
    ap.add_argument("--serve", action="store_true",
                    help="after warm-up print 'ready', then for each line 'SECONDS' on stdin run that long and "
                         "print a JSON line; lets a benchmark interleave conditions in one warm process")
    ap.add_argument("--size", type=int, default=8192, help="matrix size for --mode gpu")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("torch_step: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if args.mode == "launch":
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256, device=dev)
        y = torch.randn(64, 256, device=dev)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
    else:
        a = torch.randn(args.size, args.size, device=dev, dtype=torch.bfloat16)
        b = torch.randn(args.size, args.size, device=dev, dtype=torch.bfloat16)

        def step() -> float:
            c = a
            for _ in range(8):
                c = torch.matmul(c, b) * 1e-2
            return float(c[0, 0].item())

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    def timed(seconds: float, steps: int) -> dict:
        n = 0
        t0 = time.perf_counter()
        while True:
            step()
            n += 1
            el = time.perf_counter() - t0
            if (steps and n >= steps) or (not steps and el >= seconds):
                break
        return {"mode": args.mode, "steps": n, "seconds": el, "steps_per_s": n / el}

    if args.serve:
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(timed(float(line), 0)), flush=True)
        return 0
    if args.wait_stdin:
        print("ready", flush=True)
        sys.stdin.readline()
        if not args.seconds and not args.steps:
            # Until stdin closes (the demo ends the loop when its attach has ended).
            import threading

            done = threading.Event()
            threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
            n, t0 = 0, time.perf_counter()
            while not done.is_set():
                step()
                n += 1
            el = time.perf_counter() - t0
            print(json.dumps({"mode": args.mode, "steps": n, "seconds": el, "steps_per_s": n / el}), flush=True)
            return 0
    print(json.dumps(timed(args.seconds, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
