"""Multi-node through the DeepSpeed launcher: sp inside a node, dp across nodes.

On one CPU machine two "nodes" are emulated the way the launcher runs without pdsh/ssh: a hostfile
naming two hosts, and `deepspeed --hostfile H --no_ssh --node_rank N --master_addr 127.0.0.1 ...`
started once per node (what each node runs in a real job). The rank layout comes from DeepSpeed's own
per-node launcher (deepspeed.launcher.launch), not from a copy of its rule.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, free_port, job_failure, train_command, train_env
from tests.warm_ranks import run_trainer
from ulysses_trainer.parallel.state import group_ranks

ROOT = Path(__file__).resolve().parent.parent


def node_of(ranks_by_node: list[list[int]]) -> dict[int, int]:
    return {r: n for n, ranks in enumerate(ranks_by_node) for r in ranks}


def test_sp_groups_are_consecutive_ranks_and_dp_groups_one_rank_per_sp_group():
    sp_groups, dp_groups = group_ranks(8, 4)
    assert sp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    sp_groups, dp_groups = group_ranks(8, 2)
    assert sp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]] and dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


def launcher_ranks(world_info: dict[str, list[int]], node_rank: int) -> list[tuple[int, int, int]]:
    """(RANK, LOCAL_RANK, LOCAL_SIZE) of each process DeepSpeed's per-node launcher starts on node `node_rank`."""
    info = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    cmd = [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={node_rank}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--no_python", "--no_local_rank",
           "sh", "-c", 'echo "ranks $RANK $LOCAL_RANK $LOCAL_SIZE"']
    proc = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [tuple(int(x) for x in line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("ranks ")]
    return sorted(rows)


@pytest.mark.slow
def test_two_nodes_of_four_ranks_sp4_keeps_each_sp_group_inside_a_node():
    world_info = {"node0": [0, 1, 2, 3], "node1": [0, 1, 2, 3]}  # what `deepspeed --hostfile` passes on
    per_node = [launcher_ranks(world_info, n) for n in (0, 1)]
    assert [len(p) for p in per_node] == [4, 4] and all(size == 4 for p in per_node for *_, size in p)
    ranks_by_node = [[rank for rank, _, _ in p] for p in per_node]
    assert sorted(ranks_by_node[0] + ranks_by_node[1]) == list(range(8))
    node = node_of(ranks_by_node)
    sp_groups, dp_groups = group_ranks(8, 4)
    for g in sp_groups:  # the all-to-all of every layer stays on one node's links
        assert len({node[r] for r in g}) == 1, (g, ranks_by_node)
    for g in dp_groups:  # the gradient reduction crosses nodes
        assert {node[r] for r in g} == {0, 1}, (g, ranks_by_node)
    # sp = 8 > 4 ranks per node: one SP group would span both nodes (so the check above can fail)
    assert len({node[r] for r in group_ranks(8, 8)[0][0]}) == 2


ARGS = ["--max_length", "128", "--max_steps", "2", "--bf16", "false", "--learning_rate", "1e-3",
        "--save_strategy", "no", "--report_to", "none", "--seed", "7"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_nodes_through_a_hostfile_sp2_inside_dp2_across_equal_one_node_dp2(tmp_path):
    """2 nodes x 2 ranks, sp 2 inside a node, dp 2 across, started per node as without ssh; the same
    sequences and global batch as 2 ranks of one node with dp 2, sp 1."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    out, port = tmp_path / "two_nodes", free_port()
    deepspeed = train_command(1, [])[0]  # the venv's launcher
    nodes = [subprocess.Popen([deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(n),
                               "--master_addr", "127.0.0.1", "--master_port", str(port), "launch/train.py",
                               *ARGS, "--sp_size", "2", "--output_dir", str(out)],
                              cwd=ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (1, 0)]
    try:
        results = [p.communicate(timeout=JOB_TIMEOUT_S) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(nodes, results):
        assert p.returncode == 0, f"{stdout[-2000:]}\n{stderr[-5000:]}"
    one = tmp_path / "one_node"  # the reference: its ranks needn't come from the launcher (tests/warm_ranks.py)
    proc = run_trainer(2, [*ARGS, "--sp_size", "1", "--output_dir", str(one)], timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, job_failure(proc)
    two, ref = metrics(out), metrics(one)
    assert [r["step"] for r in two] == [r["step"] for r in ref] == [1, 2]
    assert all(r["num_tokens"] == q["num_tokens"] for r, q in zip(two, ref))  # same global batch
    for key in ("loss", "grad_norm"):
        for r, q in zip(two, ref):
            assert abs(r[key] - q[key]) / abs(q[key]) <= 1e-5, (key, two, ref)
