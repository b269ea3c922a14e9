"""A model-based checker for many nodes (docs/SEMANTICS.md, "Many nodes, one checkpoint").

Hypothesis writes programs over 2-8 nodes (tests/model_ref.py): writes, rewrites, renames of
files and directories (tmp-dir commits), exchanges, removals of any node's files (rank 0's
``rm -r`` of a checkpoint the others wrote), hard links, commit markers, evictions, retention
rounds planned and applied later, SIGKILLs and power losses, store errors and slowness.
tests/model_run.py runs each on a simulated cluster (the real core, uploader, coordinator and
listing of each node over one memory store, in virtual time) and checks the store and every
node's view against the reference: the job's operations applied in order.

The examples below are programs it found (or that reproduce what was found by hand on real
mounts); each failed before the fix it names. ``CKPTFS_TEST_MODEL_EXAMPLES=N`` runs N
generated programs (default 25, 50 with ``CKPTFS_TEST_FULL=1``); ``CKPTFS_TEST_MODEL_SEED``
picks the seed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, seed, settings

from tests.full import full_or
from tests.model_ref import Op, programs
from tests.model_run import run_program

# 25 generated programs by default, 50 with CKPTFS_TEST_FULL=1 (tests/full.py).
EXAMPLES = int(os.environ.get("CKPTFS_TEST_MODEL_EXAMPLES", full_or("25", "50")))
SEED = int(os.environ.get("CKPTFS_TEST_MODEL_SEED", "28"))


def check(tmp_path: Path, program: tuple[int, list[Op]]) -> None:
    count, ops = program
    root = tmp_path / f"run{check.runs}"  # type: ignore[attr-defined]
    check.runs += 1  # type: ignore[attr-defined]
    root.mkdir()
    clock = trio.testing.MockClock(autojump_threshold=0.002)
    runner = trio.run(run_program, root, f"model-{id(root)}", count, ops, clock=clock)
    if runner.violations:
        raise AssertionError(
            "\n".join(runner.violations) + "\n\nsteps:\n" + "\n".join(runner.steps)
            + ("\n\nskipped:\n" + "\n".join(runner.skipped) if runner.skipped else ""))


check.runs = 0  # type: ignore[attr-defined]


# Rank 0 rotates: it removes a checkpoint whose shards other nodes wrote and still hold.
ROTATION = (3, [Op("write", 1, "step1/b"), Op("write", 2, "step1/a"), Op("write", 0, "step1/.metadata"),
                Op("sync", 1), Op("sync", 2), Op("sync", 0), Op("rmtree", 0, "step1")])
# A shard rewritten and closed just before the barrier of a tmp-dir commit, still uploading.
REWRITE_IN_TMP_COMMIT = (2, [
    Op("write", 1, "step1.tmp/b"), Op("sync", 1), Op("write", 0, "step1.tmp/a"), Op("sync", 0),
    Op("pause", n=10), Op("write", 1, "step1.tmp/b"), Op("write", 0, "step1.tmp/.metadata"),
    Op("rename", 0, "step1.tmp", "step1")])
# Another node's own commit marker inside the tmp dir, closed before the rename.
MARKER_IN_TMP_COMMIT = (2, [
    Op("write", 1, "step1.tmp/b"), Op("write", 1, "step1.tmp/.metadata"),
    Op("write", 0, "step1.tmp/a"), Op("rename", 0, "step1.tmp", "step1")])
# Retention planned to delete a checkpoint; the job saves into it again before the apply.
REWRITE_AFTER_PLAN = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/.metadata"), Op("write", 0, "step2/a"),
    Op("write", 0, "step2/.metadata"), Op("sync", 0), Op("plan", 0, "step1"),
    Op("write", 0, "step1/a"), Op("apply")])
# A hard link whose head is evicted, then deleted by another node: read through the link.
LINK_AFTER_HEAD_DELETED = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step2/b"), Op("link", 0, "step1/a", "step2/l1"),
    Op("sync", 0), Op("evict", 0, "step1"), Op("unlink", 1, "step1/a")])

# Found by the generator: a node removes a directory and writes into it again at once, while
# the old version of that file (another node's, closed before the removal) is still uploading
# and lands after the new one.
REMOVED_THEN_REWRITTEN = (2, [Op("write", 0, "step1/a"), Op("rmtree", 1, "step1"),
                              Op("write", 1, "step1/a")])
# Found by the generator: a node replaces another node's version (an exchange uploads both
# files again), then deletes its own: the first writer must not find its old version missing
# with nothing to say why (it would upload it again).
REPLACED_THEN_DELETED = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/m/a"),
    Op("exchange", 1, "step1/a", "step1/m/a"), Op("write", 0, "step1/a"),
    Op("unlink", 1, "step1/m/a")])
# Found by the generator: a marker parked on its way to its name (an exchange) lost its
# place in its node's order, and a marker closed after it went out first.
PARKED_MARKER = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/.metadata"),
    Op("exchange", 0, "step1/.metadata", "step1/a"), Op("write", 0, "step1/n0.done")])
# Clock skew: the writer's wall clock an hour ahead of the renaming node's (the records of
# the previous code were compared by time: a moved shard was taken for lost and uploaded
# again under its old name).
CLOCK_SKEW = (2, [
    Op("skew", 1, n=3600), Op("write", 1, "step1.tmp/b"), Op("sync", 1),
    Op("write", 0, "step1.tmp/.metadata"), Op("rename", 0, "step1.tmp", "step1")])
# Found by the generator: a node renames a file over another node's (its object is
# overwritten at that key, not deleted), then removes it: the first writer must not find its
# version missing with nothing to say why.
RENAMED_OVER_THEN_DELETED = (2, [
    Op("write", 0, "step1/.metadata"), Op("write", 0, "step1.tmp/a"),
    Op("rename", 1, "step1.tmp/a", "step1/.metadata"), Op("write", 0, "step1.tmp/a"),
    Op("write", 0, "step1/a"), Op("unlink", 1, "step1/.metadata")])
# Found by the generator: rank 0 removes a directory while another node's new version of a
# file in it is still uploading; the removing node's listing brought the file back as an
# entry before the sweep ran, and the sweep took that entry for a change of its own.
REMOVED_WHILE_UPLOADING = (3, [
    Op("write", 0, "step1/a"), Op("unlink", 2, "step1/a"), Op("kill", 2),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("rmtree", 1, "step1")])
# Found by the generator, once directories were compared: a directory another node removed,
# whose entries here had to be decided first, stayed in this node's view until its listing's
# ttl (the node then wrote into it as if it still existed); and one removed with every file
# in it stayed in the view of a node whose clock stepped back meanwhile.
WRITTEN_INTO_REMOVED = (2, [
    Op("write", 0, "step1/a"), Op("rmtree", 1, "step1"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("pause", n=1), Op("unlink", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("unlink", 0, "step1/a")])
SUBDIRECTORY_REMOVED = (2, [
    Op("write", 1, "step1/m/a"), Op("rmtree", 0, "step1"), Op("sync", 0),
    Op("write", 0, "step1/a"), Op("skew", 1, n=-3600)])
# Found by the generator: a directory another node renamed, with a subdirectory in it: the
# node that wrote them put the parent back before its empty subdirectory went.
RENAMED_WITH_A_SUBDIRECTORY = (2, [
    Op("write", 1, "step1/a"), Op("write", 0, "step2/m/a"),
    Op("rename", 1, "step2", "step1.tmp"), Op("write", 0, "step1/a")])
# Found by the generator: a power loss rolled a node's journal back past the commit of a
# file's version: the file came back incomplete while the store held that version.
POWER_LOSS_AFTER_COMMIT = (2, [
    Op("write", 0, "step1/a"), Op("kill", 0), Op("write", 0, "step1/a"), Op("pause", n=1),
    Op("power", 0)])
# Found by the generator: a node renames a directory another node removed (and wrote into
# again) while its own view still holds the removed file.
RENAME_OF_A_REMOVED_DIRECTORY = (2, [
    Op("write", 1, "step2/m/a"), Op("rmtree", 0, "step2"), Op("write", 0, "step2/a"),
    Op("rename", 1, "step2", "step1")])
# Found by the generator: a power loss rolled the removing node's journal back to before its
# removal sweep was done; run again, the sweep took the file another node had written into
# the directory made again since for one the job had removed.
SWEEP_AGAIN_AFTER_POWER_LOSS = (2, [
    Op("write", 0, "step1/a"), Op("rmtree", 1, "step1"), Op("power", 1),
    Op("write", 0, "step1/a"), Op("power", 1)])
# Found by the generator: a node exchanged its file with another node's and renamed its own
# away while its upload to the exchanged name was on its way: the copy that landed there was
# retired pinned to its version, but the row that still named the other node's (replaced)
# version at that key held the deletion back, and the stale copy stayed.
EXCHANGE_THEN_RENAME = (2, [
    Op("write", 1, "step1/a"), Op("write", 0, "step1.tmp/.metadata"),
    Op("exchange", 0, "step1.tmp/.metadata", "step1/a"),
    Op("rename", 0, "step1/a", "step1.tmp/a")])
# Found by the generator (a fault of the simulated operator): after a power loss the lost
# files are rewritten shards first, then markers, in the job's order.
MARKERS_LOST_WITH_POWER = (2, [
    Op("write", 0, "step1/n0.done"), Op("write", 0, "step1/.metadata"), Op("power", 0)])
# Found by the generator: a power loss rolled a node's journal back past the commit of its
# file, which another node had replaced since; the file came back incomplete, and the record
# naming its replaced version was dropped unread (the rolled-back row had no stamp), so the
# node kept showing its lost file instead of the other node's.
REPLACED_WHILE_LOST_TO_POWER = (2, [
    Op("write", 0, "step1/a"), Op("rmtree", 0, "step1"), Op("write", 0, "step1/b"),
    Op("write", 1, "step1/b"), Op("power", 0)])
# Found by the generator: a node renamed another node's directory; a power loss rolled its
# journal back to its sweep's first listing after the sweep had carried the files, so the
# sweep ran again and found them gone, and the node's rows still named their old keys (the
# files then looked lost for good, shown incomplete).
SWEPT_BEFORE_POWER_LOSS = (2, [
    Op("write", 0, "step1/a"), Op("rmtree", 0, "step1"), Op("write", 0, "step2/a"),
    Op("rename", 1, "step2", "step1"), Op("write", 0, "step1/a"), Op("power", 1)])
# Found by the generator: another node deleted a file whose commit the writer's journal then
# lost to a power loss (rolled back to before the upload): the writer uploaded it again and
# brought back what the job removed.
DELETED_WHILE_COMMIT_FORGOTTEN = (2, [
    Op("write", 1, "step1/b"), Op("kill", 1), Op("unlink", 0, "step1/b"), Op("power", 1)])
# Found by the generator: the same roll-back past a rename's sweep, with a new file written
# since under the old name at a key the sweep had carried: the renaming node took the new
# file for a newer version of the carried one and copied it over the renamed file.
NEW_FILE_UNDER_THE_OLD_NAME = (2, [
    Op("write", 0, "step2/a"), Op("write", 1, "step2/n1.done"),
    Op("exchange", 0, "step2/a", "step2/n1.done"), Op("rename", 1, "step2", "step1"),
    Op("write", 0, "step2/a"), Op("power", 1)])
# Found by the generator (a rule of the job, kept in the runner: tests/model_run.py
# ``prepare``): another node unlinked one name of a hard-linked file, and the linking node
# wrote the file through another name before it saw the removal: the daemon is told the
# inode, not the name, so the new bytes went to every name it still showed and the removed
# name came back. The writing node must see the removal first (docs/HARD_LINKS.md).
LINK_NAME_REMOVED_THEN_WRITTEN = (2, [
    Op("write", 0, "step1/m/a"), Op("link", 0, "step1/m/a", "step1/l1"),
    Op("unlink", 1, "step1/l1"), Op("write", 0, "step1/m/a")])
# Found by the generator, on one node: a file renamed within its directory, a new file
# closed under its old name, then the directory renamed. The sweep copied the version at the
# old key to the same name under the new directory, over the new file: that version's row
# lives under its new name, and its own move (waiting for the sweep) carries it there.
RENAMED_THEN_DIRECTORY_RENAMED = (2, [
    Op("write", 0, "step1/a"), Op("rename", 0, "step1/a", "step1/b"),
    Op("write", 0, "step1/a"), Op("rename", 0, "step1", "step2")])
# Found by the generator (a runner defect): a node lost a file it closed to a power loss
# before uploading it, while another node renamed its directory (the sweep's barrier waited
# for the node, which came back without the file). The simulated operator rewrote only the
# files whose last writer the node was, and the rename made the renaming node that: the
# operator rewrites what the node closed, wherever it is now.
LOST_BEFORE_ANOTHER_NODES_RENAME = (2, [
    Op("write", 0, "step1/a"), Op("evict", 0), Op("rename", 1, "step1", "step2"),
    Op("power", 0)])
# Found by the generator (a runner defect): node 0 linked a file node 1 had written, and
# node 1 lost power before node 0 uploaded the new name. The simulated operator rewrote that
# name on node 1 as one of node 1's lost files, so two nodes wrote it with nothing ordering
# them; the name is node 0's to upload.
LINKED_NAME_AFTER_POWER_LOSS = (2, [
    Op("write", 0, "step1/a"), Op("write", 1, "step1/a"), Op("sync", 0),
    Op("link", 0, "step1/a", "step1/l1"), Op("power", 1), Op("rmtree", 0, "step1")])
# Found by the generator: a node removed a checkpoint and wrote a file into it again, lost
# power after the upload (its journal forgot the commit, its data came back short: the file
# is incomplete), and another node then removed the checkpoint. The incomplete copy stayed on
# the first node for good: the record of the removal names the version whose commit it
# forgot, but only a file the store still holds was judged. Now such a copy goes too.
REMOVED_WHILE_COMMIT_FORGOTTEN = (2, [
    Op("write", 0, "step1/a"), Op("rmtree", 0, "step1"), Op("write", 0, "step1/a"),
    Op("pause", 0, n=1), Op("power", 0), Op("rmtree", 1, "step1")])
# Found by the generator: node 1 rewrote node 0's file, and node 0 removed its directory
# while node 1's upload was on its way (it landed after). Node 0's deletion of its own
# version was not pinned (nobody else holds a node's own version, it assumed), so it
# deleted node 1's new one, without a record; node 1 found its file missing with nothing
# to say why and uploaded it again, and it outlived the removal. A node's own version is
# now deleted only while the store holds a version of that node there; the directory's
# sweep, after the barrier, removes node 1's.
OWN_VERSION_REPLACED_THEN_REMOVED = (3, [
    Op("write", 0, "step1/m/a"), Op("write", 2, "step1.tmp/a"), Op("write", 0, "step2/a"),
    Op("write", 1, "step2/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1.tmp/a"), Op("write", 0, "step1/a"), Op("rmtree", 0, "step2")])

# One node: a file renamed to a marker's name after another marker was closed, then a power
# loss; the replay queued the markers in their closing order, so `.metadata` reached the store
# before `n0.done` (the rename is when it became a marker: its ctime orders it now).
MARKER_MADE_BY_RENAME = (1, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/n0.done"), Op("rename", 0, "step1/a", "step1/.metadata"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("power", 0)])
# Node 1 exchanges node 0's two files, node 0 loses power: the operator rewrote on node 0 the
# files whose versions the store did not hold at their new names yet, racing node 1's uploads
# of the same names (a runner defect: the operator now keeps the job's rules, waits for node
# 1's data and finds nothing to rewrite); node 0's removal then left a file in the store.
OPERATOR_AFTER_AN_EXCHANGE = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/b"), Op("sync", 0), Op("exchange", 1, "step1/a", "step1/b"),
    Op("power", 0), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("rmtree", 0, "step1")])
# Node 0 renames node 1's file to a marker's name, node 1 removes it once the move is in the
# store, node 0 loses power with its journal rolled back to between its rename and the move's
# commit: the move, tried again, found the old key gone and marked the file incomplete for
# good (gone from the store behind ckptfs), though the job had removed it.
MOVE_FORGOTTEN_THEN_REMOVED = (2, [
    Op("write", 0, "step1/m/a"), Op("rmtree", 0, "step1"), Op("write", 1, "step2/a"),
    Op("rename", 0, "step2/a", "step2/.metadata"), Op("unlink", 1, "step2/.metadata"),
    Op("power", 0, n=2)])
# A rename of a hard link over another name of the same file does nothing (POSIX): the
# reference dropped the old name (a defect of the reference, not of ckptfs).
RENAME_OVER_ITS_OWN_LINK = (2, [
    Op("write", 0, "step1.tmp/.metadata"), Op("link", 1, "step1.tmp/.metadata", "step1.tmp/l1"),
    Op("rename", 1, "step1.tmp/l1", "step1.tmp/.metadata")])
# Two nodes each with a sweep waiting for a full barrier (node 1 removed step2, node 0
# step2.tmp) and a marker unrelated to it: one barrier per node carried both, so each
# marker waited for a full ack, which waits for the other node's marker: neither went, and
# node 1's sync hung. Plain and full barriers are posted apart now (coordination.py).
SWEEPS_AND_MARKERS_ON_TWO_NODES = (2, [
    Op("write", 0, "step1/m/a"), Op("rmtree", 0, "step1"), Op("write", 1, "step2/b"),
    Op("rename", 0, "step2/b", "step2/.metadata"), Op("rmtree", 1, "step2"),
    Op("power", 0, n=30), Op("write", 1, "step2/n1.done"), Op("write", 1, "step2.tmp/n1.done"),
    Op("write", 0, "step2/n0.done"), Op("pause", 0, n=1), Op("rmtree", 0, "step2.tmp"),
    Op("slow", 0), Op("power", 0), Op("write", 0, "step2/a"), Op("pause", 0, n=1),
    Op("slow", 0), Op("kill", 0), Op("write", 0, "step2/n0.done"), Op("sync", 1),
    Op("link", 0, "step2/n0.done", "step2/l1")])
# Node 1 links node 0's `.metadata` as `l1` and rewrites it: the close numbered the names in
# the order head, alias, so the marker (the head) did not wait for `l1`'s new version and
# reached the store first (flaky: 3 runs in 6). Markers among a file's names are numbered last.
LINKED_MARKER_REWRITTEN = (2, [
    Op("power", 0), Op("write", 0, "step1/.metadata"), Op("pause", 0, n=1),
    Op("pause", 0, n=1), Op("link", 1, "step1/.metadata", "step1/l1"), Op("sync", 0),
    Op("kill", 0), Op("sync", 0), Op("pause", 0, n=40), Op("pause", 0, n=1),
    Op("pause", 0, n=3), Op("write", 1, "step1/.metadata")])
# One node: a hard-linked file rewritten after a sync, its new version uploaded, then a power
# loss: the journal rolled back to the older commit and the bytes were gone, and a linked
# file never takes a version from the store (local wins), so both names read short for
# good. With nothing local left, its names take this node's later version.
LINKED_FILE_AFTER_POWER_LOSS = (1, [
    Op("write", 0, "step1/a"), Op("link", 0, "step1/a", "step1/l1"), Op("write", 0, "step1/a"),
    Op("sync", 0), Op("write", 0, "step1/a"), Op("pause", 0, n=1), Op("power", 0)])
# The same with a marker's name, the file closed but not committed in the rolled-back
# journal: it came back incomplete, and a linked file was never recovered from its own
# version in the store (the unlinked one was).
LINKED_MARKER_AFTER_POWER_LOSS = (2, [
    Op("write", 0, "step2.tmp/.metadata"), Op("link", 0, "step2.tmp/.metadata", "step2.tmp/l1"),
    *[Op("write", 0, "step1/a")] * 16, Op("rmtree", 0, "step1"),
    Op("write", 0, "step2.tmp/.metadata"), Op("pause", 0, n=1), Op("power", 0)])

# Three nodes: node 2 renamed node 0's directory, then exchanged a file of it (both names are
# made local first) while its own sweep moved that file to the new key and deleted the old
# one: the fetch, waiting for its turn, read the old key and failed (EIO). A read follows the
# row to where this node moved it.
EXCHANGE_DURING_OWN_SWEEP = (3, [
    Op("kill", 1, n=2), Op("write", 0, "step1.tmp/a"), Op("write", 2, "step2/a"),
    Op("unlink", 0, "step2/a"), Op("write", 0, "step2/b"), Op("rename", 0, "step2", "step2.old"),
    Op("link", 2, "step1.tmp/a", "step1.tmp/l1"), Op("skew", 1, n=-90),
    Op("rename", 2, "step2.old", "step2.old.old"), Op("power", 0, n=30),
    Op("write", 1, "step1/m/a"), Op("plan", 0, "step2"), Op("sync", 1),
    Op("write", 1, "step1.tmp/b"), Op("plan", 0, "step2", n=1), Op("rmtree", 2, "step1"),
    Op("exchange", 2, "step1.tmp/b", "step2.old.old/b")])

# One node: a linked file's head uploading into step1/m/ when rm -r removed it; its last name
# `l1` is outside, so the head moves there from its copy in m/. The move waited for m/'s
# sweep, numbered after the `.metadata` closed before the removal, and that marker did not
# wait for moves that wait for a sweep: it reached the store before `l1`. A move out of a
# removed directory does not wait for its sweep (which spares the keys this node holds).
LINKED_HEAD_REMOVED_WITH_ITS_DIRECTORY = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/m/a"), Op("link", 0, "step1/m/a", "step1/l1"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/.metadata"), Op("rmtree", 0, "step1/m")])

# Node 1 links node 0's step1/m/a as l1; node 0 removes step1/m and writes step1/m/a again.
# Node 1 saw only the new version at m/a (a linked name never took another node's version:
# local wins) and showed the old bytes there for good. A linked name whose own version
# another node replaced goes alone, as for a deletion, and shows the new version.
LINKED_NAME_REPLACED_BY_ANOTHER_NODE = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/m/a"), Op("link", 1, "step1/m/a", "step1/l1"),
    *[Op("write", 0, "step1/a")] * 4, Op("rmtree", 0, "step1/m"),
    *[Op("write", 0, "step1/a")] * 11, Op("write", 0, "step1/m/a")])

# Node 2 exchanged node 0's .metadata and n0.done; node 0 lost power before node 2's
# uploads of the two names, and the runner's operator rewrote them on node 0 (it took them
# for node 0's files), racing node 2's uploads of the same names: a copy of one was
# overwritten, removed by node 1's rename, and put back by node 2 under the old directory
# (flaky, 8 runs in 20). A defect of the runner: the names are node 2's to upload.
OPERATOR_AFTER_AN_EXCHANGE_OF_ITS_FILES = (3, [
    Op("write", 1, "step1/m/a"), Op("fault", 2, n=1), Op("rename", 0, "step1/m/a", "step1/b"),
    Op("evict", 2), Op("rename", 2, "step1", "step2.tmp"), Op("rmtree", 0, "step2.tmp"),
    Op("sync", 0), Op("pause", 0, n=3), Op("write", 0, "step1.tmp/.metadata"),
    Op("evict", 2, "step2.tmp"), Op("write", 0, "step1.tmp/n0.done"), Op("pause", 0, n=1),
    Op("write", 0, "step1.tmp/.metadata"),
    Op("exchange", 2, "step1.tmp/n0.done", "step1.tmp/.metadata"), Op("power", 0),
    Op("rename", 1, "step1.tmp", "step2"), Op("power", 0, n=2),
    Op("write", 1, "step2/.metadata")])

# Node 1 rewrote node 0's step1/a; node 0 renamed step1 to step2, then unlinked step2/a.
# Node 0's deletions ran at once (nothing at step2/a yet, its own version at step1/a gone),
# then node 1's version landed under the old name and the rename's sweep carried it to
# step2/a: a file the job removed, back for good. A deletion under a directory renamed
# here before it now waits for that rename's sweep, and takes what the sweep brought.
REMOVED_AFTER_ITS_DIRECTORYS_RENAME = (2, [
    Op("write", 0, "step1/a"), Op("write", 1, "step1/a"), Op("rename", 0, "step1", "step2"),
    Op("unlink", 0, "step2/a")])

# Node 2 linked a marker as step1.tmp/l1 and uploaded l1; node 0 removed step1.tmp (a record
# for node 2's l1); node 2 lost power, its journal rolled back to before l1's commit. Its
# start saw the record but passed over l1 (a name of a linked file), and put l1 back
# (flaky, 10 runs in 20). A linked name whose forgotten version another node removed goes
# alone.
FORGOTTEN_LINK_NAME_REMOVED = (3, [
    Op("sync", 2), Op("write", 1, "step1/.metadata"), Op("rmtree", 2, "step1"),
    Op("evict", 2, "step1.tmp"), Op("plan", 1, "step1"), Op("write", 2, "step2/.metadata"),
    Op("rename", 1, "step2", "step1.tmp"), Op("link", 2, "step1.tmp/.metadata", "step1.tmp/l1"),
    Op("power", 2, n=30), Op("fault", 2, n=3), Op("rmtree", 0, "step1.tmp"),
    Op("write", 1, "step1.tmp/.metadata"), Op("write", 2, "step2/.metadata"),
    Op("write", 2, "step2/m/a"), Op("fault", 2, n=3), Op("fault", 2, n=4), Op("power", 2, n=30),
    Op("rmtree", 2, "step2"), Op("write", 0, "step1/n0.done"), Op("write", 0, "step1/a"),
    Op("write", 1, "step1/m/a"), Op("write", 0, "step1/a")])

# Node 1 rewrote node 0's step1/a (still uploading); node 0 renamed step1 to step2, then
# step2/a to step2/b. The file's move found node 1's version at the old key and, node 0's
# own committed file not being a mere view, was put again from node 0's older local copy.
# A committed file with nothing changed here follows a newer version as a view does.
RENAMED_AFTER_ITS_DIRECTORY_WHILE_REWRITTEN = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("write", 0, "step1/a"),
    Op("write", 1, "step1/a"), Op("rename", 0, "step1", "step2"),
    Op("rename", 0, "step2/a", "step2/b")])

# Node 0 renamed step2 (holding node 1's m/a) to step1; node 1 lost power before the
# rename's sweep ran. The runner's operator rewrote step1/m/a on node 1 (the store did not
# hold it there yet), racing the sweep's copy of the same name; node 0 then removed it, and
# node 1's newer row put it back. A defect of the runner: that version was not lost, only
# not moved yet.
OPERATOR_BEFORE_A_SWEEP = (2, [
    Op("write", 0, "step1/a"), Op("sync", 0), Op("write", 0, "step2.tmp/a"),
    Op("rmtree", 1, "step1"), Op("write", 1, "step2/m/a"), Op("rmtree", 0, "step2.tmp"),
    Op("pause", 0, n=1), Op("rename", 0, "step2", "step1"), Op("power", 1),
    Op("pause", 0, n=10), Op("unlink", 0, "step1/m/a")])

# A hard-linked file came back incomplete after a power loss (both names), while another
# node had removed its first name: the other name took this node's version from the store,
# but the bytes are the head's, which stayed empty (both names read nothing; seed 291).
LINKED_FILE_LOST_WITH_ITS_FIRST_NAME_REMOVED = (2, [
    Op("write", 0, "step2.tmp/.metadata"), Op("link", 0, "step2.tmp/.metadata", "step2.tmp/l1"),
    Op("pause", 0, n=1), Op("write", 0, "step2.tmp/m/a"), Op("evict", 0), Op("sync", 0),
    Op("rename", 0, "step2.tmp/l1", "step2.tmp/a"), Op("write", 0, "step2.tmp/a"),
    Op("evict", 0), Op("pause", 0, n=1), Op("write", 0, "step2.tmp/a"), Op("evict", 0),
    Op("pause", 0, n=1), Op("unlink", 1, "step2.tmp/.metadata"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("power", 0)])

# A directory's marker came back after a power loss: the journal forgot that this node had
# put it, and another node had renamed the directory away meanwhile (seed 173; flaky).
MARKER_FORGOTTEN_AFTER_ANOTHER_NODES_RENAME = (2, [
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("rmtree", 0, "step1"),
    Op("write", 0, "step2/a"), Op("plan", 0, "step1"), Op("write", 0, "step2/a"),
    Op("write", 0, "step1.tmp/a"), Op("fault", 0, n=1), Op("rename", 1, "step1.tmp", "step1"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("power", 0, n=30)])

# The same, with a power loss early on: only the head (which holds the bytes) came back
# incomplete, the other name settled at its key, where the store held this node's own
# version; nothing took it, and both names read nothing (seed 291 again; flaky, 2 runs in 24
# on a loaded machine).
LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE = (2, [
    Op("write", 0, "step2.tmp/.metadata"), Op("link", 0, "step2.tmp/.metadata", "step2.tmp/l1"),
    Op("power", 0), Op("write", 0, "step2.tmp/m/a"), Op("evict", 0), Op("sync", 0),
    Op("rename", 0, "step2.tmp/l1", "step2.tmp/a"), Op("write", 0, "step2.tmp/a"),
    Op("evict", 0), Op("pause", 0, n=1), Op("write", 0, "step2.tmp/a"), Op("evict", 0),
    Op("pause", 0, n=1), Op("unlink", 1, "step2.tmp/.metadata"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("power", 0)])

# And again, the other node removing the name the file was linked as: that name came back
# incomplete, its record named a later version than the rolled-back journal knew (the bytes'
# version, which the head's name took from the store), and the name stayed, showing the file
# the job removed (seed 291 a third time; deterministic, and on the last stop's code too).
LINKED_NAME_REMOVED_AT_A_FORGOTTEN_VERSION = (2, [
    *LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE[1][:12], Op("pause", 0, n=3),
    Op("unlink", 1, "step2.tmp/a"), *LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE[1][14:]])

# An exchange, then the directory renamed: the retired older version of the exchanged name,
# its deletion pending, made a listing drop the evicted file now at that key, and the
# deletion then took the file's version: the store lost it (seed 139, 4 nodes; flaky in
# stop 36, 24 runs in 24 on a loaded machine before, 0 in 24 after).
RETIRED_VERSION_UNDER_AN_EXCHANGED_NAME = (4, [
    Op("write", 0, "step1/a"), Op("rename", 0, "step1", "step1.tmp"),
    Op("write", 1, "step1/n1.done"), Op("plan", 0, "step1"), Op("write", 1, "step2/n1.done"),
    Op("write", 0, "step1/n0.done"), Op("rmtree", 3, "step1.tmp"), Op("apply", 0),
    Op("write", 0, "step2/b"), Op("pause", 0, n=1), Op("pause", 0, n=1), Op("sync", 0),
    Op("exchange", 1, "step1/n0.done", "step2/n1.done"), Op("write", 0, "step1/a"),
    Op("write", 3, "step1/n3.done"), Op("evict", 1), Op("write", 0, "step1/a"),
    Op("rename", 1, "step2", "step2.tmp")])

# And with the whole directory removed by the other node: after the name the file was linked
# as went, the first name, alone then, kept waiting for a record of its own rolled-back
# version, and stayed (seed 291 a fourth time; deterministic).
LINKED_FILE_REMOVED_WITH_ITS_DIRECTORY_AT_A_FORGOTTEN_VERSION = (2, [
    *LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE[1][:12], Op("pause", 0, n=3),
    Op("rmtree", 1, "step2.tmp"), *LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE[1][14:]])

# The same without a hard link: a file rewritten and killed, then removed with its directory
# by the other node; after the power loss, its record named a later version than the
# rolled-back row, and the file and its directory stayed (seed 291 a fifth time;
# deterministic, and on the last stop's code too).
REWRITTEN_FILE_REMOVED_AT_A_FORGOTTEN_VERSION = (2, [
    Op("write", 0, "step2.tmp/.metadata"), Op("pause", 0, n=1), Op("pause", 0, n=1),
    Op("write", 0, "step2.tmp/m/a"), Op("evict", 0), Op("sync", 0),
    Op("rename", 0, "step2.tmp/m/a", "step2.tmp/a"), Op("write", 0, "step2.tmp/a"),
    Op("kill", 0), Op("pause", 0, n=1), Op("write", 0, "step2.tmp/a"), Op("evict", 0),
    Op("pause", 0, n=1), Op("rmtree", 1, "step2.tmp"), Op("write", 0, "step1/a"),
    Op("write", 0, "step1/a"), Op("write", 0, "step1/a"), Op("power", 0)])

# A file put at the key of one whose move out of a renamed directory waited for the sweep
# (an exchange after ``mv step1 step2``) waited for that sweep too, but the acks counted it:
# the sweep waited for the other node's marker, the marker for this node's ack, the ack for
# the file (seed 325; deterministic, and on the last stop's code too).
EXCHANGE_BEHIND_A_SWEEP = (2, [
    Op("write", 0, "step1/a"), Op("write", 1, "step1/n1.done"), Op("rmtree", 0, "step1"),
    Op("write", 0, "step1/a"), Op("rename", 0, "step1", "step2"), Op("write", 0, "step1/a"),
    Op("exchange", 0, "step1/a", "step2/a")])

# A file renamed over the commit marker of a tmp dir, then the dir renamed: the sweep carried
# the marker's older version, which the rename had replaced, to the new name, where it stood
# until the file's move overwrote it (seed 291, a sixth shape; deterministic, and on the last
# stop's code too). The same with the older version another node's.
REPLACED_MARKER_CARRIED = (2, [
    Op("write", 0, "step2.tmp/.metadata"), Op("pause", 0, n=1), Op("write", 1, "step2.tmp/m/a"),
    Op("pause", 0, n=1), Op("write", 0, "step2.tmp/a"),
    Op("rename", 0, "step2.tmp/a", "step2.tmp/.metadata"), Op("rename", 0, "step2.tmp", "step1")])
REPLACED_FOREIGN_MARKER_CARRIED = (2, [
    Op("write", 1, "step2.tmp/.metadata"), *REPLACED_MARKER_CARRIED[1][1:],
    Op("write", 0, "step2.tmp/b"), Op("pause", 0, n=3)])

# Another node removed a file just after this node's rename of its directory was carried;
# this node lost power, and its journal came back with the rename but not the end of its
# sweep (the file's row still at the old key). The record round dropped the record, whose key
# no row held yet, and the file, found missing where the sweep had put it, was uploaded again
# (seed 363; deterministic, and on the last stop's code too).
REMOVED_AFTER_A_SWEEP_THE_POWER_LOSS_FORGOT = (2, [
    Op("write", 1, "step1/a"), Op("pause", 0, n=1), Op("evict", 0), Op("sync", 1),
    Op("pause", 0, n=1), Op("rename", 1, "step1", "step2"), Op("pause", 0, n=1),
    Op("unlink", 0, "step2/a"), Op("power", 1)])

# A file renamed over another node's file, then renamed on before its move got there: the
# rename over it only told the old version's writer that it was replaced, and nothing ever
# overwrote or deleted that version (seed 374; deterministic, and on the last stop's code too).
RENAMED_ON_BEFORE_IT_OVERWROTE = (3, [
    Op("write", 0, "step2/a"), Op("unlink", 0, "step2/a"), Op("write", 0, "step2/.metadata"),
    Op("write", 0, "step2.tmp/a"), Op("rename", 2, "step2.tmp/a", "step2/.metadata"),
    Op("write", 0, "step1/a"), Op("unlink", 0, "step1/a"),
    Op("rename", 2, "step2/.metadata", "step1/a")])

# Node 1 rewrote node 0's file and lost power before its upload; node 0 renamed the directory,
# node 1 (its hold forgotten) put its rewrite under the new name, and node 0's sweep then
# copied the old version over it (seed 376; deterministic, and on the last stop's code too).
# The same with the tmp dir's commit marker (seed 392).
SWEPT_OVER_A_LATE_REWRITE = (2, [
    Op("write", 0, "step1/b"), Op("write", 1, "step1/b"), Op("write", 0, "step1/a"),
    Op("rename", 0, "step1", "step2"), *[Op("write", 0, "step1/a")] * 8, Op("power", 1)])
SWEPT_OVER_A_LATE_MARKER_REWRITE = (2, [
    Op("write", 0, "step1.tmp/.metadata"), Op("sync", 0), Op("write", 1, "step1.tmp/.metadata"),
    Op("rename", 0, "step1.tmp", "step1"), *[Op("write", 0, "step1/a")] * 5, Op("power", 1)])

# Another node's file moved away and back, then its directory renamed: the version is at its
# old key again with the same stamp, and the record of its first move is still in its writer's
# mailbox. A sweep that skipped versions with a record lost it (a rule tried for seed 376 and
# dropped; seed 291 again, shrunk from 16 ops).
MOVED_AWAY_AND_BACK_BEFORE_A_RENAME = (2, [
    Op("write", 1, "step2.tmp/m/a"), Op("rename", 0, "step2.tmp/m/a", "step2.tmp/b"),
    Op("rename", 0, "step2.tmp/b", "step2.tmp/m/a"), Op("rename", 0, "step2.tmp", "step2")])

# A file exchanged with one of another name is put again at its new name in the same version
# (its stamp unchanged); another node rewrote it there, and a power loss made this node forget
# that put: the record named the row's own stamp, which was taken for a commit the journal
# kept, and the old version was put back over the rewrite (seed 407; deterministic, and on the
# last stop's code too; shrunk from 11 ops).
EXCHANGED_PUT_FORGOTTEN = (2, [
    Op("write", 0, "step1/a"), Op("write", 1, "step2/a"), Op("kill", 1),
    Op("write", 1, "step1/a"), Op("rmtree", 1, "step1"), Op("write", 1, "step1/a"),
    Op("exchange", 1, "step1/a", "step2/a"), Op("write", 0, "step1/a"), Op("power", 1)])

# Another node rewrote the tmp dir's marker; this node renamed the dir and wrote the marker
# again under the new name. The sweep left the old key to this node's rewrite, whose
# retirement of its old copy is pinned to its own version: the other node's rewrite stayed
# under the old name (seed 449; deterministic, and on the last stop's code too; shrunk from
# 16 ops).
REWRITE_LEFT_UNDER_THE_OLD_NAME = (2, [
    Op("write", 0, "step1.tmp/.metadata"), Op("write", 1, "step1.tmp/.metadata"),
    Op("rename", 0, "step1.tmp", "step1"), Op("write", 0, "step1/.metadata")])

# Not a fault of ckptfs but of the reference: retention's deletion of a checkpoint removed
# its directory too, everywhere, while the reference kept it (seed 368, shrunk from 20 ops).
RETENTION_REMOVES_THE_DIRECTORY = (2, [
    Op("slow", 0, n=4), Op("write", 0, "step1/n0.done"), Op("write", 0, "step2/.metadata"),
    Op("write", 0, "step1/b"), Op("unlink", 0, "step1/b"), Op("plan", 0, "step1"),
    Op("apply", 0)])

FOUND = {"rotation": ROTATION, "rewrite-in-tmp-commit": REWRITE_IN_TMP_COMMIT,
         "marker-in-tmp-commit": MARKER_IN_TMP_COMMIT, "rewrite-after-plan": REWRITE_AFTER_PLAN,
         "link-after-head-deleted": LINK_AFTER_HEAD_DELETED,
         "removed-then-rewritten": REMOVED_THEN_REWRITTEN,
         "replaced-then-deleted": REPLACED_THEN_DELETED, "parked-marker": PARKED_MARKER,
         "clock-skew": CLOCK_SKEW, "renamed-over-then-deleted": RENAMED_OVER_THEN_DELETED,
         "removed-while-uploading": REMOVED_WHILE_UPLOADING,
         "written-into-removed": WRITTEN_INTO_REMOVED,
         "subdirectory-removed": SUBDIRECTORY_REMOVED,
         "renamed-with-a-subdirectory": RENAMED_WITH_A_SUBDIRECTORY,
         "power-loss-after-commit": POWER_LOSS_AFTER_COMMIT,
         "rename-of-a-removed-directory": RENAME_OF_A_REMOVED_DIRECTORY,
         "sweep-again-after-power-loss": SWEEP_AGAIN_AFTER_POWER_LOSS,
         "exchange-then-rename": EXCHANGE_THEN_RENAME,
         "markers-lost-with-power": MARKERS_LOST_WITH_POWER,
         "replaced-while-lost-to-power": REPLACED_WHILE_LOST_TO_POWER,
         "swept-before-power-loss": SWEPT_BEFORE_POWER_LOSS,
         "deleted-while-commit-forgotten": DELETED_WHILE_COMMIT_FORGOTTEN,
         "new-file-under-the-old-name": NEW_FILE_UNDER_THE_OLD_NAME,
         "link-name-removed-then-written": LINK_NAME_REMOVED_THEN_WRITTEN,
         "renamed-then-directory-renamed": RENAMED_THEN_DIRECTORY_RENAMED,
         "lost-before-another-nodes-rename": LOST_BEFORE_ANOTHER_NODES_RENAME,
         "linked-name-after-power-loss": LINKED_NAME_AFTER_POWER_LOSS,
         "removed-while-commit-forgotten": REMOVED_WHILE_COMMIT_FORGOTTEN,
         "own-version-replaced-then-removed": OWN_VERSION_REPLACED_THEN_REMOVED,
         "marker-made-by-rename": MARKER_MADE_BY_RENAME,
         "operator-after-an-exchange": OPERATOR_AFTER_AN_EXCHANGE,
         "move-forgotten-then-removed": MOVE_FORGOTTEN_THEN_REMOVED,
         "rename-over-its-own-link": RENAME_OVER_ITS_OWN_LINK,
         "sweeps-and-markers-on-two-nodes": SWEEPS_AND_MARKERS_ON_TWO_NODES,
         "linked-marker-rewritten": LINKED_MARKER_REWRITTEN,
         "linked-file-after-power-loss": LINKED_FILE_AFTER_POWER_LOSS,
         "linked-marker-after-power-loss": LINKED_MARKER_AFTER_POWER_LOSS,
         "exchange-during-own-sweep": EXCHANGE_DURING_OWN_SWEEP,
         "linked-head-removed-with-its-directory": LINKED_HEAD_REMOVED_WITH_ITS_DIRECTORY,
         "linked-name-replaced-by-another-node": LINKED_NAME_REPLACED_BY_ANOTHER_NODE,
         "operator-after-an-exchange-of-its-files": OPERATOR_AFTER_AN_EXCHANGE_OF_ITS_FILES,
         "removed-after-its-directorys-rename": REMOVED_AFTER_ITS_DIRECTORYS_RENAME,
         "forgotten-link-name-removed": FORGOTTEN_LINK_NAME_REMOVED,
         "renamed-after-its-directory-while-rewritten": RENAMED_AFTER_ITS_DIRECTORY_WHILE_REWRITTEN,
         "operator-before-a-sweep": OPERATOR_BEFORE_A_SWEEP,
         "linked-file-lost-with-its-first-name-removed":
             LINKED_FILE_LOST_WITH_ITS_FIRST_NAME_REMOVED,
         "marker-forgotten-after-another-nodes-rename":
             MARKER_FORGOTTEN_AFTER_ANOTHER_NODES_RENAME,
         "linked-file-lost-with-only-its-head-incomplete":
             LINKED_FILE_LOST_WITH_ONLY_ITS_HEAD_INCOMPLETE,
         "linked-name-removed-at-a-forgotten-version":
             LINKED_NAME_REMOVED_AT_A_FORGOTTEN_VERSION,
         "retired-version-under-an-exchanged-name": RETIRED_VERSION_UNDER_AN_EXCHANGED_NAME,
         "linked-file-removed-with-its-directory-at-a-forgotten-version":
             LINKED_FILE_REMOVED_WITH_ITS_DIRECTORY_AT_A_FORGOTTEN_VERSION,
         "rewritten-file-removed-at-a-forgotten-version":
             REWRITTEN_FILE_REMOVED_AT_A_FORGOTTEN_VERSION,
         "exchange-behind-a-sweep": EXCHANGE_BEHIND_A_SWEEP,
         "replaced-marker-carried": REPLACED_MARKER_CARRIED,
         "replaced-foreign-marker-carried": REPLACED_FOREIGN_MARKER_CARRIED,
         "removed-after-a-sweep-the-power-loss-forgot":
             REMOVED_AFTER_A_SWEEP_THE_POWER_LOSS_FORGOT,
         "renamed-on-before-it-overwrote": RENAMED_ON_BEFORE_IT_OVERWROTE,
         "swept-over-a-late-rewrite": SWEPT_OVER_A_LATE_REWRITE,
         "swept-over-a-late-marker-rewrite": SWEPT_OVER_A_LATE_MARKER_REWRITE,
         "moved-away-and-back-before-a-rename": MOVED_AWAY_AND_BACK_BEFORE_A_RENAME,
         "exchanged-put-forgotten": EXCHANGED_PUT_FORGOTTEN,
         "rewrite-left-under-the-old-name": REWRITE_LEFT_UNDER_THE_OLD_NAME,
         "retention-removes-the-directory": RETENTION_REMOVES_THE_DIRECTORY}


@pytest.mark.parametrize("program", list(FOUND.values()), ids=list(FOUND))
def test_found_programs(tmp_path: Path, program: tuple[int, list[Op]]) -> None:
    check(tmp_path, program)


@pytest.mark.slow
@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs())
def test_generated_programs(tmp_path: Path, program: tuple[int, list[Op]]) -> None:
    check(tmp_path, program)
