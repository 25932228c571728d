"""The rank pool's own promises: a native crash or a silent hang reruns once (and fails when it happens again),
a Python failure never reruns, and a hang's report carries the hung ranks' stacks."""

import os
import shutil
import time

import pytest

from harness import RankFailure, RankPool, RankTimeout
from profiles import ci_only

#: the task timeout is longer than the collective timeout: that is what makes a hang with no report "silent"
TASK_S, COLLECTIVE_S = 3.0, 1.0


@pytest.fixture(scope="module")
def small_pool():
    p = RankPool(world_size=2, collective_timeout_s=COLLECTIVE_S)
    yield p
    p.stop(graceful=False)


def _first_time(marker: str) -> bool:
    """True for the first caller across the pool's lives (the marker file remembers)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def abort_on_first_try(marker: str, rank_to_fail: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail and _first_time(marker):
        os.abort()  # SIGABRT, as glibc's heap checks do
    return dist.get_rank()


def hang_on_first_try(marker: str, rank_to_fail: int, always: bool = False) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail and (always or _first_time(marker)):
        time.sleep(10 * TASK_S)  # stuck without any collective: nothing times out
    return dist.get_rank()


def raise_on_first_try(marker: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0 and _first_time(marker):
        raise ValueError("a Python failure")


def test_a_native_crash_reruns_once_with_its_stacks(small_pool, tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)native crash.*exit codes \[-6\].*abort_on_first_try"):
        assert small_pool.run(abort_on_first_try, str(tmp_path / "m"), 1, timeout_s=TASK_S) == [0, 1]


def test_a_silent_hang_reruns_once_with_python_and_native_stacks(small_pool, tmp_path):
    with pytest.warns(UserWarning) as caught:
        assert small_pool.run(hang_on_first_try, str(tmp_path / "m"), 0, timeout_s=TASK_S) == [0, 1]
    text = str(caught[0].message)
    assert "rank(s) [0] did not finish" in text and "hang_on_first_try" in text  # faulthandler's Python stack
    if shutil.which("gdb"):  # (what gdb prints depends on whether this machine lets it attach)
        assert "--- rank 0: native threads (gdb) ---" in text or "--- rank 0: gdb failed" in text


@ci_only("two hangs, 15 s; the dev profile checks a hang that reruns")
def test_a_hang_that_happens_again_fails(small_pool, tmp_path):
    with pytest.warns(UserWarning), pytest.raises(RankTimeout, match="happened twice"):
        small_pool.run(hang_on_first_try, str(tmp_path / "m"), 1, True, timeout_s=TASK_S)


def test_a_python_failure_is_never_rerun(small_pool, tmp_path):
    with pytest.raises(RankFailure, match="ValueError: a Python failure"):
        small_pool.run(raise_on_first_try, str(tmp_path / "m"), timeout_s=TASK_S)
