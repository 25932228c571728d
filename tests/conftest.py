import os

import pytest
from hypothesis import HealthCheck, settings

from harness import RankPool, ensure_importable

ensure_importable()

# "ci": the profile .ci/run selects; hundreds of examples across the property tests within the time budget.
settings.register_profile("ci", max_examples=400, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow], database=None)
settings.register_profile("dev", max_examples=25, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def pool():
    """Four persistent gloo ranks (tp in {1, 2, 4} runs as dp x tp = 4)."""
    p = RankPool(world_size=4)
    p.start()
    yield p
    p.stop()
