"""The disk tier: one record file per chunk, an in-memory index, one writer thread per tier."""
