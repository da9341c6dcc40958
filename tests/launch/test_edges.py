"""The edges of a job, in real processes: a forgotten join(), a skipped step, a stall, AsyncSGD at exit.

Each test starts tests/launch/edges_job.py on 2 ranks (a plain launch: RANK,
WORLD_SIZE, MASTER_ADDR set by hand, no ``bunsan run``) and reads the exit codes,
stderr and each rank's final parameters. Collective timeouts are set long (30 s)
where the test proves that bunsan names the problem before the timeout, and
every job is killed after a hard limit.
"""

from __future__ import annotations

import pytest

from tests.launch.edges_run import run_job

# Every test starts 2 fresh processes (3-5 s each on an idle 2-core machine): `make test-all` runs them.
pytestmark = pytest.mark.slow

LIMIT_S = 90.0  # a hard end for any job here; the assertions on time are much tighter
FIX = "call optimizer.join() on every rank after the loop"


def _ok(result) -> None:
    assert result.codes == [0, 0], result.summary() + "\n" + "\n".join(result.stderr)
    assert result.equal_replicas, result.summary()


def test_async_sgd_without_join_or_finalize_exits_0_with_equal_replicas():
    # Before finalize() joined: rank 0 died in std::terminate at exit (exit 134) in 22 of 23 runs.
    _ok(run_job(["--algorithm", "async"], timeout_s=LIMIT_S))


@pytest.mark.parametrize("algorithm", ["block_momentum", "model_averaging"])
def test_block_algorithms_without_join_end_with_equal_replicas(algorithm):
    # 7 batches of 4 samples with blocks of 12: the last block is partial, and only a join averages it.
    _ok(run_job(["--algorithm", algorithm], timeout_s=LIMIT_S))


@pytest.mark.parametrize("algorithm", ["block_momentum", "model_averaging", "async"])
def test_uneven_data_without_join_trains_as_with_join(algorithm):
    # Rank 1 ends 3 batches early and calls nothing: finalize() at exit joins for it.
    without = run_job(["--algorithm", algorithm, "--extra", "0:3", "--collective-timeout", "30"], timeout_s=LIMIT_S)
    _ok(without)
    if algorithm != "async":  # asynchronous runs depend on the arrival order; deterministic ones must match
        with_join = run_job(["--algorithm", algorithm, "--extra", "0:3", "--join"], timeout_s=LIMIT_S)
        assert with_join.replicas == without.replicas


def test_uneven_data_parallel_without_join_matches_an_explicit_join():
    args = ["--algorithm", "data_parallel", "--extra", "0:3", "--collective-timeout", "30"]
    without = run_job(args, timeout_s=LIMIT_S)
    _ok(without)  # exit 0 and equal replicas: the rank that trained longest gives its model at the end
    with_join = run_job([*args, "--join"], timeout_s=LIMIT_S)
    assert with_join.replicas == without.replicas


def test_forgotten_join_with_another_collective_names_the_fix():
    # Rank 0 logs its loss with an all_reduce every step; rank 1, finished and in
    # finalize(), answers only gradient exchanges. The job must end at once, not
    # after the 30 s timeout, and say what to do.
    result = run_job(
        ["--algorithm", "data_parallel", "--extra", "0:3", "--log-loss", "--collective-timeout", "30"],
        timeout_s=LIMIT_S,
    )
    assert any(code != 0 for code in result.codes), result.summary()
    assert FIX in "".join(result.stderr), result.summary()
    assert result.after_start is not None and result.after_start < 20, result.summary()  # the timeout is 30 s


@pytest.mark.parametrize("finalize", [[], ["--finalize"]], ids=["at-exit", "finalize"])
def test_skipped_step_on_one_rank_is_named_and_fails_the_job(finalize):
    result = run_job(
        ["--algorithm", "data_parallel", "--skip", "1:2", "--collective-timeout", "30", *finalize], timeout_s=LIMIT_S
    )
    assert all(code != 0 for code in result.codes), result.summary()
    assert "rank 1 skipped optimizer.step() at its step 2" in "".join(result.stderr), result.summary()
    assert result.after_start is not None and result.after_start < 20, result.summary()


def test_an_extra_collective_on_one_rank_is_named_while_the_others_wait():
    # Rank 1's barrier pairs with rank 0's gradient all-reduce: gloo waits until the
    # 30 s timeout. The watch threads compare the ranks' recent collectives after 1 s.
    result = run_job(
        ["--algorithm", "data_parallel", "--barrier", "1:3", "--collective-timeout", "30"], timeout_s=LIMIT_S
    )
    assert all(code != 0 for code in result.codes), result.summary()
    text = "".join(result.stderr)
    assert "collectives out of step at world collective #" in text, result.summary()
    assert "rank 1 called barrier" in text, result.summary()
    assert result.after_start is not None and result.after_start < 20, result.summary()


def test_stall_report_names_the_absent_rank_and_what_it_does():
    # Rank 1 spends 5 s "in checkpoint save"; with a 2 s stall threshold rank 0 reports
    # once, keeps waiting, and the job ends normally.
    result = run_job(
        ["--algorithm", "data_parallel", "--pause", "1:3", "--pause-s", "5"],
        timeout_s=LIMIT_S,
        env_extra={"BUNSAN_STALL_S": "2"},
    )
    _ok(result)
    reports = [line for line in result.stderr[0].splitlines() if "still waiting" in line]
    assert len(reports) == 1, result.stderr[0]
    assert "for 1 rank(s)" in reports[0] and "rank 1 is in checkpoint save" in reports[0], reports[0]
    assert not any("still waiting" in line for line in result.stderr[1].splitlines())
