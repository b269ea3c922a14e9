"""The reference a many-node program is checked against: what the job did, as a plain dict of
path -> bytes, and the programs themselves (hypothesis strategies).

A *program* is a list of operations, each made by one node, in the job's order: the job's
barriers order them (an operation starts once the one before it returned). What the store and
every node must end with is what a single POSIX tree would hold after the same operations in
that order (``Reference``), under the rules ckptfs states for many nodes
(docs/SEMANTICS.md, "Many nodes, one checkpoint"); tests/model_run.py plays the job's part of
those rules (a node changes a file another node wrote once that version is in the store and
it sees it; a renamed or removed directory takes every file closed in it before).

Hard links are a node's own: the names are one file on the node that linked them, separate
files everywhere else. So only that node writes through them (the generator keeps to it);
any node may remove a name.

Contents are unique per close (``content``), so the bytes of an object say which close made
them: the invariants "no object holds bytes never closed under its name" and "no marker before
the files closed before it" are checked on the store at every put and copy.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from ckptfs.config import DEFAULT_COMMIT_MARKERS

CHECKPOINTS = ("step1", "step2", "step1.tmp", "step2.tmp")
SUBDIR = "m"
NAMES = ("a", "b", ".metadata")


def is_marker(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_COMMIT_MARKERS)


def content(cid: int, path: str) -> bytes:
    """The bytes of close number ``cid`` (unique: the bytes name the close)."""
    unit = f"<{cid}:{path}>".encode()
    return unit * (1 + (cid * 7919) % 40)


@dataclass(frozen=True)
class Op:
    """One operation of a program. ``kind``: write, rename, exchange, unlink, rmtree, link,
    evict, kill, power, fault, slow, skew (the node's wall clock off by ``n`` seconds),
    pause, sync, plan, apply."""

    kind: str
    node: int = 0
    a: str = ""
    b: str = ""
    n: int = 0

    def __repr__(self) -> str:
        args = ", ".join(repr(x) for x in (self.a, self.b) if x)
        extra = f", n={self.n}" if self.n else ""
        return f"Op({self.kind!r}, {self.node}{', ' + args if args else ''}{extra})"


@dataclass
class Reference:
    """A POSIX tree of files and directories, with what the checker needs besides."""

    files: dict[str, int] = field(default_factory=dict)  # path -> content id
    dirs: set[str] = field(default_factory=set)
    writer: dict[str, int] = field(default_factory=dict)  # path -> node of its last close
    # Hard links: path -> (node, group); the names of a group on that node share one file.
    links: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The node of the last rename or removal at each path (the job's order for namespaces).
    moved_by: dict[str, int] = field(default_factory=dict)
    # Names removed from a link group by a node other than the group's: (node, path).
    unlinked_from: dict[tuple[int, int], set[tuple[int, str]]] = field(default_factory=dict)
    history: dict[str, set[int]] = field(default_factory=dict)  # contents ever at a path
    # A marker's content -> (when it became a marker, {name in its directory: content id}).
    markers: dict[int, tuple[int, dict[str, int]]] = field(default_factory=dict)
    # When each path got its content (a count of operations): a marker covers a file only
    # while the file has the content it had when the marker was made.
    arrived: dict[str, int] = field(default_factory=dict)
    # path -> the node that exchanged it there: that node uploads it again from its copy.
    exchanged: dict[str, int] = field(default_factory=dict)
    clock: int = 0
    closed_at: dict[int, str] = field(default_factory=dict)  # content id -> path at its close
    closed_by: dict[int, int] = field(default_factory=dict)  # content id -> node that closed it
    next_cid: int = 1  # the content id of the next close
    next_group: int = 1

    def copy(self) -> Reference:
        return replace(self, files=dict(self.files), dirs=set(self.dirs),
                       writer=dict(self.writer), links=dict(self.links),
                       moved_by=dict(self.moved_by),
                       unlinked_from={k: set(v) for k, v in self.unlinked_from.items()},
                       history={k: set(v) for k, v in self.history.items()},
                       markers=dict(self.markers), closed_at=dict(self.closed_at),
                       closed_by=dict(self.closed_by),
                       arrived=dict(self.arrived), exchanged=dict(self.exchanged))

    # -- questions ---------------------------------------------------------------------------

    def is_dir(self, path: str) -> bool:
        return path == "" or path in self.dirs

    def parent_ok(self, path: str) -> bool:
        """Whether ``path`` can be made (``mkdir -p`` of its parents, no file in the way)."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self.files:
                return False
        return path not in self.dirs

    def under(self, path: str) -> list[str]:
        """Files and directories at or under ``path``."""
        return [p for p in (*self.files, *self.dirs) if p == path or p.startswith(path + "/")]

    def bytes_of(self, path: str) -> bytes:
        return content(self.files[path], self.closed_at[self.files[path]])

    def expected(self) -> dict[str, bytes]:
        return {p: self.bytes_of(p) for p in self.files}

    # -- operations --------------------------------------------------------------------------

    def write(self, node: int, path: str) -> int:
        parts = path.split("/")
        for i in range(1, len(parts)):
            self.dirs.add("/".join(parts[:i]))
        cid = self.next_cid
        self.next_cid += 1
        self.closed_at[cid] = path
        self.closed_by[cid] = node
        group = self.links.get(path)
        names = [p for p, g in self.links.items() if g == group] if group else [path]
        for name in names:
            self.files[name] = cid
            self.writer[name] = node
            self.exchanged.pop(name, None)
            self.history.setdefault(name, set()).add(cid)
            self.arrived[name] = self.clock
        if is_marker(path):
            self._marker(path)
        return cid

    def _marker(self, path: str, moved: bool = False) -> None:
        """``path`` became a commit marker (closed, or renamed to a marker's name): it covers
        the files of its directory closed before. A marker moved keeps what it covered."""
        directory, _, _ = path.rpartition("/")
        if not directory or (moved and self.files[path] in self.markers):
            return
        node = self.writer.get(path)
        # Markers of different nodes do not wait for each other (docs/SEMANTICS.md): another
        # node's marker is no file this one covers.
        self.markers[self.files[path]] = (self.clock, {
            p[len(directory) + 1:]: c for p, c in self.files.items()
            if p.rpartition("/")[0] == directory and p != path
            and not (is_marker(p) and self.writer.get(p) != node)})

    def rename(self, node: int, src: str, dst: str) -> None:
        """``rename(2)`` of a file or a directory (over a file, or an empty directory)."""
        if src in self.links and self.links.get(dst) == self.links[src]:
            return  # two names of one file: POSIX does nothing, both stay
        moves = {p: dst + p[len(src):] for p in self.under(src)}
        if dst in self.files:
            self._drop(dst, node)
        self.dirs.discard(dst)
        files = {moves[p]: self.files.pop(p) for p in list(self.files) if p in moves}
        # The renaming node carries the move: its queue orders it (a marker moved is its).
        writers = {moves[p]: node for p in list(self.writer) if p in moves}
        for p in moves:
            self.writer.pop(p, None)
        links = {moves[p]: self.links.pop(p) for p in list(self.links) if p in moves}
        exchanged = {moves[p]: self.exchanged.pop(p) for p in list(self.exchanged)
                     if p in moves}
        self.exchanged.update(exchanged)
        dirs = {moves[p] for p in self.dirs if p in moves}
        self.dirs -= set(moves)
        self.dirs |= dirs
        self.files.update(files)
        self.writer.update(writers)
        self.links.update(links)
        for old, new in moves.items():
            self.moved_by[old] = self.moved_by[new] = node
            if new in files:
                self.history.setdefault(new, set()).add(files[new])
                self.arrived[new] = self.clock
        for new in files:
            if is_marker(new):
                self._marker(new, moved=True)

    def exchange(self, node: int, a: str, b: str) -> None:
        self.files[a], self.files[b] = self.files[b], self.files[a]
        self.writer[a] = self.writer[b] = node  # it uploads both again
        self.exchanged[a] = self.exchanged[b] = node
        for p in (a, b):
            self.moved_by[p] = node
            self.history.setdefault(p, set()).add(self.files[p])
            self.arrived[p] = self.clock
            if is_marker(p):
                self._marker(p, moved=True)

    def _drop(self, path: str, node: int) -> None:
        self.files.pop(path, None)
        self.writer.pop(path, None)
        self.exchanged.pop(path, None)
        group = self.links.pop(path, None)
        if group is not None and group[0] != node:
            self.unlinked_from.setdefault(group, set()).add((node, path))

    def unlink(self, node: int, path: str) -> None:
        self._drop(path, node)
        self.moved_by[path] = node

    def rmtree(self, node: int, path: str) -> None:
        for p in self.under(path):
            self._drop(p, node)
            self.dirs.discard(p)
            self.moved_by[p] = node

    def link(self, node: int, src: str, dst: str) -> None:
        group = self.links.get(src)
        if group is None:
            group = (node, self.next_group)
            self.next_group += 1
        self.links[src] = self.links[dst] = group
        self.files[dst] = self.files[src]
        self.writer[dst] = self.writer[src]
        self.history.setdefault(dst, set()).add(self.files[dst])
        self.arrived[dst] = self.clock
        if is_marker(dst):
            self._marker(dst, moved=True)

    def can(self, op: Op) -> bool:
        """Whether ``op`` is a valid next operation of the job."""
        k, a, b = op.kind, op.a, op.b
        if k == "write":
            if a in self.links and self.links[a][0] != op.node:
                return False  # a hard link is written through only on its node
            return self.parent_ok(a)
        if k == "unlink":
            return a in self.files
        if k == "rmtree":
            return a in self.dirs
        if k == "rename":
            if a in self.files:
                if b in self.dirs or not self.is_dir(b.rpartition("/")[0]) or b == a:
                    return False
                return not any(p in self.links and self.links[p][0] != op.node
                               for p in (a, b))
            if a in self.dirs:
                if b == a or b.startswith(a + "/") or b in self.files:
                    return False
                if b in self.dirs and any(p != b for p in self.under(b)):
                    return False  # not empty
                if any(p in self.links for p in self.under(a)):
                    return False  # keeps link groups simple
                return self.is_dir(b.rpartition("/")[0])
            return False
        if k == "exchange":
            return a in self.files and b in self.files and a != b and \
                a not in self.links and b not in self.links
        if k == "link":
            return a in self.files and b not in self.files and b not in self.dirs and \
                self.is_dir(b.rpartition("/")[0]) and \
                (a not in self.links or self.links[a][0] == op.node)
        return True

    def apply(self, op: Op) -> None:
        self.clock += 1
        if op.kind == "write":
            self.write(op.node, op.a)
        elif op.kind == "rename":
            self.rename(op.node, op.a, op.b)
        elif op.kind == "exchange":
            self.exchange(op.node, op.a, op.b)
        elif op.kind == "unlink":
            self.unlink(op.node, op.a)
        elif op.kind == "rmtree":
            self.rmtree(op.node, op.a)
        elif op.kind == "link":
            self.link(op.node, op.a, op.b)


# -- programs ------------------------------------------------------------------------------------


def _paths(ref: Reference) -> list[str]:
    """Paths a write may go to."""
    out = []
    for c in CHECKPOINTS:
        for name in (*NAMES, "n{node}.done"):
            out.append(f"{c}/{name}")
        out.append(f"{c}/{SUBDIR}/a")
    return out


@st.composite
def programs(draw: st.DrawFn, *, max_ops: int = 24, max_nodes: int = 8,
             power: bool = True) -> tuple[int, list[Op]]:
    """A node count and a program valid against the reference (retention's deletions, which
    depend on what the nodes see, are left out of this check; the runner skips what they made
    invalid)."""
    nodes = draw(st.sampled_from([2, 2, 2, 3, 3, 4, 5, max_nodes]))
    ref = Reference()
    ops: list[Op] = []
    plans = 0
    kinds = ["write"] * 8 + ["rename"] * 3 + ["pause"] * 3 + ["unlink", "rmtree", "rmtree",
             "link", "exchange", "evict", "kill", "fault", "slow", "skew", "sync", "plan",
             "apply"]
    if power:
        kinds.append("power")
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(kinds))
        node = draw(st.integers(0, nodes - 1))
        op: Op | None = None
        if kind == "write":
            path = draw(st.sampled_from(_paths(ref))).replace("{node}", str(node))
            op = Op("write", node, path)
        elif kind == "rename":
            if draw(st.booleans()) and ref.dirs:
                src = draw(st.sampled_from(sorted(d for d in ref.dirs if "/" not in d)
                                           or sorted(ref.dirs)))
                dst = draw(st.sampled_from([*CHECKPOINTS, src.removesuffix(".tmp") + ".old"]))
                op = Op("rename", node, src, dst)
            elif ref.files:
                src = draw(st.sampled_from(sorted(ref.files)))
                directory = src.rpartition("/")[0]
                name = draw(st.sampled_from((*NAMES, "c", ".metadata.tmp")))
                where = draw(st.sampled_from(sorted({directory, *ref.dirs})))
                op = Op("rename", node, src, f"{where}/{name}" if where else name)
        elif kind == "exchange" and len(ref.files) >= 2:
            a, b = draw(st.lists(st.sampled_from(sorted(ref.files)), min_size=2, max_size=2,
                                 unique=True))
            op = Op("exchange", node, a, b)
        elif kind == "unlink" and ref.files:
            op = Op("unlink", node, draw(st.sampled_from(sorted(ref.files))))
        elif kind == "rmtree" and ref.dirs:
            op = Op("rmtree", node, draw(st.sampled_from(sorted(ref.dirs))))
        elif kind == "link" and ref.files:
            src = draw(st.sampled_from(sorted(ref.files)))
            where = draw(st.sampled_from(sorted(ref.dirs)))
            op = Op("link", node, src, f"{where}/l{draw(st.integers(1, 2))}")
        elif kind == "evict":
            op = Op("evict", node, draw(st.sampled_from(("", *CHECKPOINTS))))
        elif kind in ("kill", "power"):
            op = Op(kind, node, n=draw(st.sampled_from([0, 2, 30])))
        elif kind == "fault":
            op = Op("fault", node, n=draw(st.integers(1, 6)))
        elif kind == "slow":
            op = Op("slow", node, n=draw(st.sampled_from([0, 1, 4])))
        elif kind == "skew":
            op = Op("skew", node, n=draw(st.sampled_from([-3600, -90, 0, 90, 3600])))
        elif kind == "pause":
            op = Op("pause", n=draw(st.sampled_from([1, 3, 10, 40])))
        elif kind == "sync":
            op = Op("sync", node)
        elif kind == "plan":
            op = Op("plan", node, draw(st.sampled_from(CHECKPOINTS[:2])), n=plans)
            plans += 1
        elif kind == "apply" and plans:
            op = Op("apply", n=draw(st.integers(0, plans - 1)))
        if op is None or not ref.can(op):
            continue
        ref.apply(op)
        ops.append(op)
    return nodes, ops
