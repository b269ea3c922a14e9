"""The filesystem engine, the FUSE-free core: ``fs`` (every operation), the uploader,
the store listing, the store-key claims, fetches and the upload's yielding to the job. Imports
``cluster``, ``state`` and ``store``.
"""
