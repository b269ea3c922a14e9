"""This node's local state: the journal (SQLite, the truth about every inode), the
namespace cached over it, the staging directory's data files and the journal's WAL
checkpoints. Imports the store layer (for the shapes of what it records) and the root.
"""
