"""ckptfs: a FUSE filesystem for training checkpoints (local NVMe first, shared store after)."""

__version__ = "0.1.0"
