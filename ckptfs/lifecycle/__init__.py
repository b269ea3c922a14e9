"""What happens to checkpoints over time: what a checkpoint is, retention's plan and
apply, pins, restores from an archive class, and the offline eviction. Imports ``engine`` and
below.
"""
