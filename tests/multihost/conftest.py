"""The test hosts of a session (h1..h3 and a head, engines/hosts/hosts.sh), shared by its multihost tests (each module
marked ``multihost``, and so ``mpi``) and always taken down."""

from __future__ import annotations

import pytest

from tests.multihost.hosts import HostSet, missing, remove_stale_sets, suite_prefix
from tests.support.requirements import require_or_skip

HOSTS = 3


@pytest.fixture(scope="session")
def test_hosts(tmp_path_factory: pytest.TempPathFactory):
    """Hosts h1..h3 for the session's tests (own directory and namespace prefix: hosts a user has up stay
    untouched); taken down at the end, and the teardown fails if anything of them is left."""
    require_or_skip(missing(), "the multihost tests")
    remove_stale_sets()
    hosts = HostSet(tmp_path_factory.mktemp("hosts"), suite_prefix("t"), HOSTS)
    try:
        hosts.script("up", str(HOSTS))
        yield hosts
    finally:
        hosts.down()
        assert not hosts.left_behind(), f"left after hosts.sh down: {hosts.left_behind()}"
