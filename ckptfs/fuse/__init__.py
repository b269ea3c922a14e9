"""The kernel face: the FUSE request handlers over the engine, the passthrough of the
data path, and what /proc/self/mountinfo says of a mount. Imports ``engine`` and below.
"""
