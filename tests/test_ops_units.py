"""What an operator reads, tested without a mount: ls-tiers states, log masking, wording,
configuration spellings, tables without a terminal.
"""

from __future__ import annotations

from ckptfs.checkpoints import DEFAULT_DETECTOR, LocalFile, RemoteFile, build
from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.journal import State


def test_a_checkpoint_without_a_marker_wholly_on_nvme_is_held_there() -> None:
    """ls-tiers said hot "partial" for a marker-less checkpoint whose every file is committed
    on the NVMe: being complete (a marker) and being held (every file) are two questions."""
    files = [LocalFile("step_1/model.pt", 10, 5, State.COMMITTED, committed_at=100.0),
             LocalFile("step_1/optim.pt", 11, 7, State.COMMITTED, committed_at=101.0),
             LocalFile("step_2/model.pt", 12, 5, State.REMOTE, committed_at=102.0)]
    remote = {"warm": [RemoteFile("step_1/model.pt", 5), RemoteFile("step_1/optim.pt", 7),
                       RemoteFile("step_2/model.pt", 5)]}
    got = {c.name: c for c in build(files, remote, step_regex="", tier_order=["hot", "warm"],
                                    detector=DEFAULT_DETECTOR,
                                    markers=DEFAULT_COMMIT_MARKERS)}
    assert got["step_1"].busy == "no marker"
    assert got["step_1"].held == {"hot", "warm"} and not got["step_1"].partial
    assert got["step_2"].held == {"warm"} and not got["step_2"].partial  # evicted: not on NVMe
