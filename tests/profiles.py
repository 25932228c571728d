"""The test profiles: ``make test`` locally runs the dev profile (under 10 minutes on 2 cores); CI sets
HYPOTHESIS_PROFILE=ci, which runs more hypothesis examples and the tests marked :data:`ci_only` (slow ones whose
property a faster test also covers in the dev profile)."""

import os

import pytest

CI = os.environ.get("HYPOTHESIS_PROFILE") == "ci"


def ci_only(reason: str):
    """Skip outside the CI profile; ``reason`` says what it costs and what covers it in the dev profile."""
    return pytest.mark.skipif(not CI, reason=f"CI profile only: {reason}")


def examples(dev: int, ci: int) -> int:
    """``max_examples`` of a property whose examples are cheap (a fuzz test): ``dev`` in the dev profile (``make
    test``), ``ci`` in CI's; the profile's other settings (deadline, derandomize, database) still apply."""
    return ci if CI else dev
