"""Ray runtime helpers: freeing the placement groups that a dead actor left reserved."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.ray.runtime import remove_orphaned_placement_groups


@pytest.mark.ray
def test_orphaned_placement_group_is_removed_and_live_or_driver_groups_are_kept(
    ray_local: Any,
) -> None:
    ray = ray_local
    from ray.util.placement_group import placement_group, placement_group_table

    @ray.remote(num_cpus=0)
    class Creator:  # stands for Ray Train's controller, which creates the workers' group
        def make(self) -> str:
            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return group.id.hex()

    driver_group = placement_group([{"CPU": 0.5}])  # as Tune's trial groups: made by a driver
    ray.get(driver_group.ready())
    creator = Creator.remote()
    orphan = ray.get(creator.make.remote())
    try:
        assert remove_orphaned_placement_groups() == []  # its creator is alive: in use
        ray.kill(creator)  # as Tune ending a trial actor: Ray keeps the group while the job lives
        assert remove_orphaned_placement_groups(wait_s=20.0) == [orphan]
        table = placement_group_table()
        assert table[orphan]["state"] == "REMOVED"
        assert table[driver_group.id.hex()]["state"] == "CREATED"
    finally:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(driver_group)


# a driver of a local Ray session, and a stranger (a wrong token) knocking at its GCS port
_SESSION = """
import os, subprocess, sys
import ray
from pipeline.ray.runtime import ray_session
from pipeline.settings import RayConfig
with ray_session(RayConfig(num_cpus=1)):
    gcs = ray.get_runtime_context().gcs_address
    probe = "import ray; ray.init(address=%r, logging_level='ERROR'); print('in')" % gcs
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=240)
    print("stranger", done.returncode)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_session_runs_with_token_auth_whatever_the_environment_says() -> None:
    """Its workers' ports (a Serve replica's among them) take pickles: with RAY_AUTH_MODE=disabled
    in the environment, a process without the token is still refused."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", _SESSION], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["stranger", "1"], done.stdout[-500:]
