import os, time
from pathlib import Path
from tests.test_upload_mount import bucket, write, sync, Bucket  # noqa

def test_dir_rename_sync(mounter, bucket, tmp_path):
    m = mounter("p", config=bucket.config(tmp_path / "c.toml", faults={"latency": "1s"}))
    write(m.path / "a.tmp" / "f", b"f")
    sync(m)
    os.rename(m.path / "a.tmp", m.path / "a")
    took = sync(m)
    print("sync took", took, bucket.sizes())
    assert "a.tmp/" not in bucket.sizes()

def test_pointer_rename(mounter, bucket, tmp_path):
    m = mounter("p", config=bucket.config(tmp_path / "c.toml", faults={"bandwidth": 2_000_000}))
    write(m.path / "step_1" / "__0_0.distcp", os.urandom(1000))
    write(m.path / "step_1" / ".metadata", b"m")
    write(m.path / "latest", b"step_1")
    sync(m)
    write(m.path / "step_2" / "__0_0.distcp", os.urandom(4_000_000))
    write(m.path / "step_2" / ".metadata", b"m")
    write(m.path / "latest.tmp", b"step_2")
    os.rename(m.path / "latest.tmp", m.path / "latest")
    seen = []
    for _ in range(20):
        seen.append("latest" in bucket.sizes())
        time.sleep(0.1)
    print(seen)
    sync(m)
    assert all(seen)
