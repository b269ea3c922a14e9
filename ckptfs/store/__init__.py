"""The store side, lowest layer: the tiers (one narrow async interface, one module per
kind of store), the checksums that travel with objects (``integrity``), what a store may be
trusted to hold (``trust``) and the check of a store's settings (``check``). Imports only the
package root (``errors``, ``config``).
"""
