"""Print a benchmarks/memory_attribution.py result.

    python benchmarks/show_memory_attribution.py FILE.json [section,section] [-r]
"""

import json
import sys

r = json.load(open(sys.argv[1]))
default = ("global_peak", "attention_kernel_bwd", "sdpa_node_bwd", "all_to_all_bwd", "tiled_mlp_bwd")
secs = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "-r" else default
print({k: v for k, v in r.items() if not isinstance(v, (dict, list))})
for k in secs:
    d = r.get(k)
    if not d:
        continue
    print(f"== {k} ev {d['event']} level {d['level_units']} before {d['before_step_units']} "
          f"step {d['step_live_units']}")
    print("   peak alloc", d["peak_alloc"])
    for g in d["groups"]:
        print(f"  {g['units']:7.3f} {g['n']:3d} {g['sizes'][:5]} {g['where'][:230]}")
    if "-r" in sys.argv:
        for a in d["recent_allocs"]:
            print(f"     ev{a['ev']} {a['u']:.3f} {'L' if a['live'] else '-'} {a['where'][:200]}")
