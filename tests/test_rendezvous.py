"""The master port's store must be this job's before torch.distributed starts: rank 0 publishes the job's token,
the other ranks find it there or say in one line that another job holds the port (they never join its store)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist

from ulysses_trainer.errors import JobStartError
from ulysses_trainer.parallel.rendezvous import check_one_job, job_token


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_token_is_the_same_on_every_rank_of_a_launch():
    assert job_token(["--config", "r.yaml", "--local_rank=1"], 2) == job_token(["--config", "r.yaml"], 2)
    assert job_token(["--local_rank", "3", "--config", "r.yaml"], 2) == job_token(["--config", "r.yaml"], 2)
    assert job_token(["--config", "r.yaml"], 2) != job_token(["--config", "other.yaml"], 2)
    assert job_token(["--config", "r.yaml"], 2) != job_token(["--config", "r.yaml"], 4)


def test_the_ranks_of_one_job_meet_on_one_store_and_leave_the_port_free():
    port = _free_port()
    errors, stores = [], {}

    def rank(r: int) -> None:
        try:
            stores[r] = check_one_job("127.0.0.1", port, r, 3, "abc", timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    stores[1].set("from/rank1", "x")  # one store: what a peer writes, rank 0's server holds
    assert stores[0].get("from/rank1") == b"x"
    stores.clear()
    again = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)  # the port is free again
    del again


def _group_on_the_checked_store(rank: int, port: int, queue) -> None:
    import os

    import torch

    from ulysses_trainer.parallel.init import destroy_distributed, init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = check_one_job("127.0.0.1", port, rank, 4, "abc", timeout_s=120)
    init_distributed("gloo", store=store)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    queue.put((rank, float(t)))
    destroy_distributed()


@pytest.mark.slow
def test_four_ranks_start_their_group_on_the_checked_store():
    """The group runs on the store the check opened (the port opened once): a peer that moves on before rank 0
    has no second store to miss (closing the checked store and reopening the port raced: "Failed to recv")."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_group_on_the_checked_store, args=(r, port, queue)) for r in (3, 1, 2, 0)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    assert got == {r: 10.0 for r in range(4)} and codes == [0, 0, 0, 0], (got, codes)


def test_another_jobs_store_on_the_port_is_one_line_and_never_joined():
    port = _free_port()
    other = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # another job's
    other.set("its/key", "x")
    keys = other.num_keys()
    with pytest.raises(JobStartError) as err:
        check_one_job("127.0.0.1", port, 1, 2, job_token(["--config", "mine.yaml"], 2), timeout_s=2)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"cannot start the process group on 127.0.0.1:{port}: rank 1 found "
                                                f"no store of this job there within 2 s (another job holds the port")
    assert "deepspeed --master_port" in line
    assert other.num_keys() == keys  # nothing written into the other job's store
    with pytest.raises(JobStartError, match=rf"127.0.0.1:{port}: that port is in use \(another job"):
        check_one_job("127.0.0.1", port, 0, 2, "abc", timeout_s=2)  # rank 0 of this job: the port is taken


def test_a_rank_that_finds_another_jobs_store_prints_one_line_and_exits_1(monkeypatch, capsys):
    from ulysses_trainer.cli import train
    from ulysses_trainer.parallel import rendezvous

    port = _free_port()
    other = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(rendezvous, "TOKEN_TIMEOUT_S", 2.0)
    monkeypatch.setattr(train, "_PEER_REPORT_DELAY_S", 0.0)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    rc = train.main(["--max_steps", "1", "--output_dir", "unused"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 1 and "Traceback" not in err, err
    assert len([x for x in lines if "error:" in x]) == 1
    assert any(x.startswith("(rank 1) error: cannot start the process group on 127.0.0.1:") for x in lines), err
    assert not dist.is_initialized()
    del other
