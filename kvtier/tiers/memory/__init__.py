"""Memory tiers: slot pools over host (cpu) or device (gpu) memory, their copies and recycled buffers."""
