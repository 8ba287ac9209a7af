"""Hardware descriptions and cost formulas (compute roofline, collectives, memory) for autoshard.
Knows nothing of JAX; measured profiles are data files it loads."""
