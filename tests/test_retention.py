"""The retention planner, pure: selection rules, the plan's invariants (hypothesis), and
checkpoint detection.

The invariants are checked on random histories and policies: every plan is applied to a
model of the tiers (copies succeed, removes remove) and planned again until nothing is left.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.config import KeepRules
from ckptfs.lifecycle.checkpoints import HOT, Checkpoint, LocalFile, RemoteFile, build, parse_step
from ckptfs.lifecycle.retention import Action, Policy, TierPolicy, newest_complete, plan, select
from ckptfs.state.journal import State

DEFAULT_REGEX = r"(\d+)(?!.*\d)"
T0 = 1_736_121_600.0  # 2025-01-06 00:00 UTC, a Monday
TOTAL = 1000


# -- checkpoint detection -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "step"), [
    ("step_1000", 1000), ("ckpt_step_1000.pt", 1000), ("global_step1000", 1000),
    ("iter_0001000", 1000), ("epoch3_step_250", 250), ("latest", None),
    ("latest_checkpointed_iteration.txt", None), ("model.pt", None),
])
def test_step_from_name(name: str, step: int | None) -> None:
    assert parse_step(name, DEFAULT_REGEX) == step


def test_custom_step_regex() -> None:
    assert parse_step("epoch3_step_250", r"epoch(\d+)") == 3
    assert parse_step("final", r"step_(\d+)") is None


def test_build_states_and_time() -> None:
    files = [
        LocalFile("step_1/a", 10, 5, State.COMMITTED, committed_at=T0 + 5),
        LocalFile("step_1/b", 11, 7, State.REMOTE, committed_at=T0 + 9),
        LocalFile("step_2/a", 12, 5, State.UPLOADING),
        LocalFile("step_3/a", 13, 5, State.OPEN),
        LocalFile("step_4/a", 14, 5, State.OPEN, incomplete=True),
        LocalFile("latest", 15, 6, State.COMMITTED, committed_at=T0 + 1, checksum="c:1"),
    ]
    remote = {"warm": [RemoteFile("step_1/a", 5), RemoteFile("step_1/b", 7),
                       RemoteFile("latest", 6, checksum="c:0"),
                       RemoteFile("step_9/x", 3, mtime=T0 + 100)],
              "cold": [RemoteFile("step_1/a", 5)]}
    got = {c.name: c for c in build(files, remote, step_regex=DEFAULT_REGEX,
                                    tier_order=["hot", "warm", "cold"],
                                    local_entries=["step_5"], progress={"step_2/a": 2})}
    s1 = got["step_1"]
    assert (s1.step, s1.time, s1.size, s1.busy) == (1, T0 + 9, 12, None)
    assert s1.held == {"warm"} and s1.partial == {"hot", "cold"}
    assert got["step_2"].busy == "uploading" and got["step_2"].progress == pytest.approx(0.4)
    assert got["step_3"].busy == "writing" and got["step_4"].busy == "incomplete"
    assert got["step_5"].busy == "writing"  # a directory with no file yet
    assert got["latest"].step is None and "warm" in got["latest"].partial  # stale content
    assert got["step_9"].time == T0 + 100 and got["step_9"].held == {"warm"}


# -- selection ---------------------------------------------------------------------------------


def ckpt(step: int, hour: float, held: set[str], **kw: object) -> Checkpoint:
    return Checkpoint(name=f"step_{step}", step=step, time=T0 + hour * 3600, size=100,
                      held=frozenset(held), files=((f"step_{step}/m", 100),), **kw)  # type: ignore[arg-type]


def test_rules_select_as_documented() -> None:
    policy = Policy((
        TierPolicy("hot", KeepRules(last=2), "hot", "hot"),
        TierPolicy("warm", KeepRules(hourly=timedelta(hours=3)), "memory:w", "memory"),
        TierPolicy("cold", KeepRules(daily=timedelta(days=2), weekly=timedelta(weeks=2)),
                   "memory:c", "memory"),
        TierPolicy("arch", KeepRules(milestones=(0.5, 1.0)), "memory:a", "memory"),
    ), total_steps=TOTAL)
    # Every 30 minutes for 3 days: steps 10, 20, ...
    cps = [ckpt(10 * (i + 1), i / 2, {"warm"}) for i in range(144)]
    now = T0 + 72 * 3600
    sel = select(cps, policy, now)
    assert set(sel["hot"]) == {"step_1440", "step_1430"}
    # hourly 3h: the newest of each of the last hours (:30 of hours 69, 70, 71).
    assert set(sel["warm"]) == {"step_1400", "step_1420", "step_1440"}
    # daily 2d: the newest of days 1 and 2 (day 0 ended more than 2 days ago); weekly 2w:
    # the newest of this week.
    assert set(sel["cold"]) == {"step_960", "step_1440"}
    assert sel["cold"]["step_1440"] == ["daily", "weekly"]
    assert set(sel["arch"]) == {"step_500", "step_1000"}


# -- property tests of the plan ---------------------------------------------------------------

LOCATIONS = ["s3:e:b/run", "s3:e:b/other", "file:/lustre"]
CLASSES = ["STANDARD", "STANDARD_IA", "GLACIER", "DEEP_ARCHIVE"]


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    def keep(with_milestones: bool) -> KeepRules:
        return KeepRules(
            last=draw(st.none() | st.integers(0, 4)),
            hourly=draw(st.none() | st.integers(1, 30).map(lambda h: timedelta(hours=h))),
            daily=draw(st.none() | st.integers(1, 6).map(lambda d: timedelta(days=d))),
            weekly=draw(st.none() | st.integers(1, 3).map(lambda w: timedelta(weeks=w))),
            milestones=draw(st.none() | st.lists(st.sampled_from([0.25, 0.5, 0.75, 1.0]),
                                                 min_size=1, max_size=4, unique=True)
                            .map(tuple)) if with_milestones else None,
        )

    tiers = [TierPolicy(HOT, KeepRules(last=draw(st.none() | st.integers(0, 4))), HOT, HOT)]
    used: set[tuple[str, str]] = set()
    for i in range(draw(st.integers(1, 3))):
        location = draw(st.sampled_from(LOCATIONS))
        cls = "STANDARD" if location.startswith("file:") or i == 0 else \
            draw(st.sampled_from(CLASSES))
        if (location, cls) in used:
            continue
        used.add((location, cls))
        group = location.split("/")[0] if location.startswith("s3:") else location
        tiers.append(TierPolicy(f"t{i}", keep(True), location, group, cls))
    return Policy(tuple(tiers), total_steps=TOTAL)


@st.composite
def histories(draw: st.DrawFn, policy: Policy) -> list[Checkpoint]:
    remote = [t for t in policy.tiers if t.name != HOT]
    steps = sorted(draw(st.sets(st.integers(1, TOTAL), max_size=14)))
    cps = []
    for i, step in enumerate(steps):
        held: set[str] = set()
        partial: set[str] = set()
        for location in {t.location for t in remote}:
            members = [t.name for t in remote if t.location == location]
            choice = draw(st.sampled_from([None, *members]))
            if choice is not None:
                held.add(choice)
            for m in members:
                if m != choice and draw(st.integers(0, 5)) == 0:
                    partial.add(m)
        if draw(st.booleans()):
            held.add(HOT)
        busy = draw(st.sampled_from([None] * 6 + ["writing", "uploading", "incomplete",
                                                  "no marker"]))
        hour = i * draw(st.sampled_from([1, 6, 24])) + draw(st.integers(0, 3))
        cps.append(Checkpoint(
            name=f"step_{step}", step=step, time=T0 + hour * 3600.0, size=10,
            busy=busy, held=frozenset(held), partial=frozenset(partial - held),
            files=((f"step_{step}/m", 10),), in_use=draw(st.integers(0, 9)) == 0))
    for name in draw(st.sets(st.sampled_from(["latest", "tracker.txt"]))):
        held = {t.name for t in remote if draw(st.booleans())}
        cps.append(Checkpoint(name=name, step=None, time=T0, size=1, held=frozenset(held),
                              files=((name, 1),)))
    return cps


def apply_model(cps: list[Checkpoint], actions: list[Action], policy: Policy
                ) -> list[Checkpoint]:
    """What the tiers look like after the plan, if every unblocked action succeeds."""
    loc = {t.name: t.location for t in policy.tiers}
    by_name = {c.name: c for c in cps}
    for a in actions:
        c = by_name.get(a.checkpoint)
        if c is None or a.blocked:
            continue
        held, partial = set(c.held), set(c.partial)
        if a.kind == "copy":
            assert a.tier is not None
            for t in [t for t in loc if t != a.tier and loc[t] == loc[a.tier]]:
                held.discard(t)  # one object per key: it has the new class now
                partial.discard(t)
            held.add(a.tier)
            partial.discard(a.tier)
        elif a.kind == "remove":
            held.discard(a.tier or "")
            partial.discard(a.tier or "")
        elif a.kind == "evict":
            held.discard(HOT)
            partial.discard(HOT)
        else:
            del by_name[c.name]
            continue
        by_name[c.name] = dataclasses.replace(c, held=frozenset(held), partial=frozenset(partial))
    return list(by_name.values())


def independent_milestones(cps: list[Checkpoint], policy: Policy) -> set[str]:
    names = set()
    for t in policy.tiers:
        for f in t.keep.milestones or ():
            past = [c for c in cps if c.step is not None and c.step >= f * TOTAL]
            if past:
                names.add(min(past, key=lambda c: c.step or 0).name)
    return names


def check_invariants(cps: list[Checkpoint], actions: list[Action], policy: Policy,
                     now: float) -> None:
    remote = {t.name for t in policy.tiers if t.name != HOT}
    by_name = {c.name: c for c in cps}
    after = {c.name: c for c in apply_model(cps, actions, policy)}
    newest = newest_complete(cps)
    milestone_names = independent_milestones(cps, policy)
    for a in actions:
        c = by_name[a.checkpoint]
        assert c.busy is None, f"{a} touches a busy checkpoint"
        if c.step is None:
            assert a.kind == "copy", f"{a} on a pointer"
        if a.kind == "delete":
            assert newest is None or c.name != newest.name, "deleted the newest complete"
            assert c.name not in milestone_names, "deleted a milestone"
            assert not c.in_use
        if a.kind in ("evict", "delete"):
            assert not c.in_use
        if a.kind == "copy" and a.blocked is None:
            assert a.source in by_name[a.checkpoint].held, f"{a}: source does not hold it"
    for name, c in by_name.items():
        if name not in after:
            continue
        had = c.held & remote
        if had:
            assert after[name].held & remote, f"{name}: last committed copy removed"
        if HOT in c.held | c.partial and HOT not in after[name].held | after[name].partial:
            assert after[name].held & remote, f"{name}: evicted with no remote copy"
    assert newest is None or newest.name in after


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_plan_invariants_and_convergence(data: st.DataObject) -> None:
    policy = data.draw(policies())
    cps = data.draw(histories(policy))
    now = T0 + data.draw(st.integers(0, 40 * 24)) * 3600.0
    for _ in range(4):
        actions = plan(cps, policy, now)
        check_invariants(cps, actions, policy, now)
        runnable = [a for a in actions if a.blocked is None]
        if not runnable:
            break
        cps = apply_model(cps, actions, policy)
    else:
        pytest.fail(f"no fixpoint after 4 rounds: {plan(cps, policy, now)}")
    # At the fixpoint every complete checkpoint is where its rules want it.
    selected = select(cps, policy, now)
    newest = newest_complete(cps)
    loc = {t.name: t.location for t in policy.tiers}
    remote = [t.name for t in policy.tiers if t.name != HOT]
    blocked = {a.checkpoint for a in plan(cps, policy, now)}
    for c in cps:
        if c.busy is not None or c.step is None or c.name in blocked or not c.held & set(remote):
            continue
        wanted = {t for t in selected if c.name in selected[t]}
        if not wanted and not c.in_use:
            assert newest is not None and c.name == newest.name
            continue
        if not wanted:
            continue
        expected = set()
        for t in remote:
            if t in wanted and not any(loc[e] == loc[t] for e in expected):
                expected.add(t)
        if not expected:
            assert len(c.held & set(remote)) >= 1
            continue
        assert c.held & set(remote) == expected, (c, expected)
        if HOT not in wanted and not c.in_use:
            assert HOT not in c.held | c.partial
    # Pointers are wherever checkpoint data is.
    data_locations = {loc[t] for c in cps if c.step is not None for t in c.held if t != HOT}
    for c in cps:
        if c.step is None and c.held and c.name not in blocked:
            assert data_locations <= {loc[t] for t in c.held}


def test_busy_checkpoints_are_untouched() -> None:
    policy = Policy((TierPolicy(HOT, KeepRules(last=0), HOT, HOT),
                     TierPolicy("warm", KeepRules(last=1), "memory:w", "memory")))
    cps = [ckpt(1, 0, {"hot", "warm"}, busy="uploading"),
           ckpt(2, 1, {"hot", "warm"}), ckpt(3, 2, {"hot", "warm"}, busy="writing")]
    actions = plan(cps, policy, T0 + 10 * 3600)
    assert [(a.kind, a.checkpoint) for a in actions] == [("evict", "step_2")]


def test_newest_complete_kept_even_if_nothing_selects_it() -> None:
    policy = Policy((TierPolicy(HOT, KeepRules(), HOT, HOT),
                     TierPolicy("warm", KeepRules(hourly=timedelta(hours=1)), "memory:w",
                                "memory")))
    cps = [ckpt(1, 0, {"hot", "warm"}), ckpt(2, 1, {"hot", "warm"})]
    actions = plan(cps, policy, T0 + 100 * 3600)
    assert [(a.kind, a.checkpoint) for a in actions] == [("delete", "step_1")]


def test_colocated_tiers_transition_in_place_and_archives_block() -> None:
    policy = Policy((
        TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
        TierPolicy("warm", KeepRules(last=1), "s3:e:b/p", "s3:e"),
        TierPolicy("cold", KeepRules(last=2), "s3:e:b/p", "s3:e", "GLACIER"),
        TierPolicy("deep", KeepRules(last=3), "s3:e:b/p", "s3:e", "DEEP_ARCHIVE"),
    ))
    cps = [ckpt(1, 0, {"cold"}), ckpt(2, 1, {"warm"}), ckpt(3, 2, {"hot", "warm"})]
    actions = plan(cps, policy, T0 + 3 * 3600)
    kinds = {(a.kind, a.checkpoint, a.tier, a.source, a.blocked is not None) for a in actions}
    assert kinds == {("copy", "step_2", "cold", "warm", False),
                     ("copy", "step_1", "deep", "cold", True)}
