"""Where a rehearsed step spends its time: `ulysses-trainer rehearse` with its last step under torch.profiler,
the GPU's kernel time summed into buckets (attention forward / backward, matmul, copies, reductions, the rest)
and the top kernels by name, written as JSON next to the rehearsal's own result.

    python benchmarks/profile_rehearsal.py --out prof.json [--fa4_tiles library] -- REHEARSE ARGUMENTS

    e.g. -- --config launch/recipes/reference_8gpu_1m.yaml --gpus 8 --steps 3 --warmup_length 8192 \
            --model_init_kwargs '{"num_hidden_layers": 4, ...}'

Use --steps 3 or more: the first step is the rehearsal's warm-up, the middle ones are timed without the
profiler (`step_s` in the rehearsal's result), the last runs under it (its time includes the profiler's cost).
A reduced depth (num_hidden_layers) gives the per-layer buckets in a minute; two depths give per layer and
per step apart. `--fa4_tiles library` runs flash-attn-4 with the library's own tile choice instead of the
trainer's (attention/grouped.py), for an in-step comparison of the two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.profile_step import busy_seconds, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fa4_tiles", choices=("trainer", "library"), default="trainer")
    ap.add_argument("--top", type=int, default=40, help="kernels listed by name")
    ap.add_argument("--no_profile", action="store_true",
                    help="run no step under the profiler (the rehearsal alone, with the --fa4_tiles arm)")
    a = ap.parse_args(ours)
    if a.fa4_tiles == "library":
        from ulysses_trainer.attention import grouped

        grouped.BACKENDS["fa4"] = grouped.BACKENDS["fa4_library"]  # this process only: the A/B's other arm

    import torch

    from ulysses_trainer.cli import rehearse

    cuda = torch.cuda.is_available()
    found: dict = {}

    @contextlib.contextmanager
    def around_step(step: int, steps: int):
        if a.no_profile or step != steps - 1:
            yield
            return
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            yield
        events = prof.events()
        device = "cuda" if cuda else "cpu"
        found.update(summarize(events, device, a.top))
        found["device_busy_s"] = busy_seconds(events) if cuda else None

    result_path = a.out + ".rehearsal.json"
    rc = rehearse.main([*rest, "--out", result_path], around_step=around_step)
    if rc != 0:
        return rc
    with open(result_path) as f:
        result = json.load(f)
    os.remove(result_path)
    top = found.pop("top", [])
    profiled = None if a.no_profile else len(result["step_s"])  # 1-based: the last
    out = {"fa4_tiles": a.fa4_tiles, "rehearse_args": rest, "profiled_step": profiled,
           "step_s": result["step_s"], **found, "top": top, "rehearsal": result}
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("top", "rehearsal")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
