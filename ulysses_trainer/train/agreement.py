"""One machine and one plan for the whole job.

Each rank probes its own GPU, host RAM and kernels; a rank whose GPU holds a few GiB less could pick another
checkpoint_every or offload count and so run a different sequence of all-to-alls and ZeRO-3 gathers than its
peers: a hang. So every measurement that feeds `auto` is reduced over the ranks (the least memory, the
kernels every rank has) before the plan is made, and the ranks compare the plan's digest before step 1: a
mismatch is an error on every rank, never a hang. Without a process group (one rank, `ulysses-trainer plan`)
every function here returns the local value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from ..errors import PlanMismatchError
from ..parallel.comm import gather_objects
from ..plan.types import Machine, Plan


def _least(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _shared(lists: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The kernels every rank has, in the first rank's order (fastest first)."""
    return tuple(k for k in lists[0] if all(k in other for other in lists[1:]))


def combine_machines(machines: list[Machine]) -> Machine:
    """The machine every rank can run: the least GPU and host memory, the kernels all of them have, the GPU
    name when all agree (else the first rank's: its rate table is as good a guess as any)."""
    first = machines[0]
    host = [m.host_memory_gb for m in machines]
    return replace(first, gpu_memory_gb=_least([m.gpu_memory_gb for m in machines]),
                   host_memory_gb=min(host),
                   gpu_free_after_engine_gb=_least([m.gpu_free_after_engine_gb for m in machines]),
                   kernels=_shared([m.kernels for m in machines]),
                   norm_kernels=_shared([m.norm_kernels for m in machines]),
                   deltanet_kernels=_shared([m.deltanet_kernels for m in machines]),
                   bf16_supported=all(m.bf16_supported for m in machines),
                   # the source of the figure the plan uses: the rank that saw the least
                   host_memory_source=machines[host.index(min(host))].host_memory_source)


def agree_machine(machine: Machine) -> Machine:
    """This rank's probed machine reduced over every rank (collective): the same Machine on every rank."""
    return combine_machines(gather_objects(machine))


def agree_free_memory(free_gb: float) -> float:
    """The least free GPU memory of any rank (collective): the post-engine plan's budget on every rank."""
    return min(gather_objects(free_gb))


def plan_digest(plan: Plan) -> str:
    """A short digest of everything the plan decides (its JSON): equal plans, equal digests."""
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_plan(plan: Plan, when: str) -> str:
    """The plan's digest, checked equal on every rank (collective); PlanMismatchError on every rank if not."""
    digest = plan_digest(plan)
    digests = gather_objects(digest)
    if len(set(digests)) > 1:
        by_rank = ", ".join(f"rank {r} {d}" for r, d in enumerate(digests))
        raise PlanMismatchError(f"the ranks resolved different plans {when} ({by_rank}); they would run different "
                                f"collectives and hang. Set the `auto` levers explicitly (checkpoint_every, "
                                f"activation_offload, keep_attention_outputs, tiled_mlp) or free the GPUs")
    return digest
