"""What nodes share through the store: node registration and barriers
(``coordination``), leases, the records of changes to other nodes' objects (``peers``) and
this node's run identity (``noderun``). Imports ``state`` and ``store``.
"""
