"""Where the host's main thread spends a run: its Python stack sampled every --interval seconds, summed by stack.

A GPU step whose spans match on the host's clock (rehearse --layer_times' `host`) is the device waiting on the
host; this names the Python line the host was in while it waited. Runs the module in this process:

    python benchmarks/host_stacks.py --out stacks.json -- -m ulysses_trainer rehearse ...
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import runpy
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--depth", type=int, default=12, help="innermost frames kept per stack")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- -m module args... or -- script.py args...")
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    main_id = threading.get_ident()
    counts: collections.Counter = collections.Counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(args.interval):
            frame = sys._current_frames().get(main_id)
            stack = []
            while frame is not None and len(stack) < args.depth:
                code = frame.f_code
                stack.append(f"{code.co_filename.split('site-packages/')[-1]}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            counts[tuple(stack)] += 1

    def report() -> None:
        stop.set()
        rows = [{"seconds": round(n * args.interval, 2), "stack": list(s)} for s, n in counts.most_common(args.top)]
        with open(args.out, "w") as f:
            json.dump({"interval_s": args.interval, "samples": sum(counts.values()), "top": rows}, f, indent=1)
        for r in rows[:8]:
            print(f"[host_stacks] {r['seconds']:.2f} s in {' <- '.join(r['stack'][:4])}", file=sys.stderr)

    atexit.register(report)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if rest[:1] == ["-m"]:
        sys.argv = [rest[1], *rest[2:]]
        try:
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        finally:
            print(f"[host_stacks] {time.perf_counter() - start:.1f} s sampled", file=sys.stderr)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
