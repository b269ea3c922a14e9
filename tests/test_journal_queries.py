"""Hot journal queries answer from an index, and the range that replaces a
prefix scan selects exactly the keys with the prefix."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ckptfs.state.journal import Journal, _prefix_end

# Keys as the store has them: any code point SQLite can hold (no lone surrogates).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)


@given(prefix=TEXT, keys=st.lists(TEXT, max_size=20))
def test_prefix_range_is_exactly_startswith(prefix: str, keys: list[str]) -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE k (key TEXT)")
    db.executemany("INSERT INTO k VALUES (?)", [(k,) for k in keys])
    end = _prefix_end(prefix)
    if end is None:
        got = [r[0] for r in db.execute("SELECT key FROM k WHERE key >= ?", (prefix,))]
    else:
        got = [r[0] for r in db.execute("SELECT key FROM k WHERE key >= ? AND key < ?",
                                        (prefix, end))]
    assert sorted(got) == sorted(k for k in keys if k.startswith(prefix))


def test_prefix_end_of_the_last_code_point() -> None:
    assert _prefix_end("") is None
    assert _prefix_end("a\U0010ffff") == "b"
    assert _prefix_end("\U0010ffff") is None
    assert _prefix_end("x\ud7ff") == "x\ue000"   # the next code point SQLite can store


def test_hot_queries_use_an_index(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    try:
        db = journal._db
        for query, args in [
            ("SELECT ino FROM inodes WHERE remote_key = ? AND parent IS NOT NULL", ("k",)),
            ("SELECT ino FROM inodes WHERE uploading_key >= ? AND uploading_key < ?",
             ("a/", "a0")),
            ("SELECT ino FROM inodes WHERE remote_key >= ? AND remote_key < ?", ("a/", "a0")),
            ("SELECT ino FROM inodes WHERE state IN (?, ?)", ("staged", "uploading")),
        ]:
            plan = " ".join(str(r) for r in db.execute("EXPLAIN QUERY PLAN " + query, args))
            assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, (query, plan)
    finally:
        journal.close()
