"""Pure-Python scheduling: the block manager and the scheduler (no torch imports here)."""
