"""The cross-backend numerics check, JAX against torch on the same weights and batch
(`numerics`), and the real multi-turn trajectories it compares on (`check_batch`). May import
every other folder of geo3k_jax."""
