"""Real Slurm cluster fixture (munged + slurmctld + two slurmd on localhost).

Skips when Slurm/munge are not installed or not root -- unless ``HAPO_REQUIRE_SLURM=1``
(set by .ci/run, which installs them), where that is a failure.
"""

import os

import pytest

from .slurm_cluster import SlurmCluster, available


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    why = available()
    if why:
        if os.environ.get("HAPO_REQUIRE_SLURM") == "1":
            pytest.fail(f"HAPO_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    os.environ.update(c.env)  # sbatch / scontrol from the code under test find this cluster
    yield c
    c.stop()
