"""The top: the daemon's assembly (``mount``), the control socket and its client, metrics,
the CLI and the fstab mount helper. Imports any layer below.
"""
