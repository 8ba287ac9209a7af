"""Pure combinatorial optimisation for autoshard: the intra-operator sharding ILP and the
inter-operator stage DP. Knows nothing of JAX; inputs are frozen dataclasses of numpy arrays."""
