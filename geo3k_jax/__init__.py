"""geo3k_jax: the JAX/Flax learner of geo3k-rl (Qwen-VL models, sharded GRPO step, numerics
check against torch). The package holds no code yet: its issue is open. The shared core it will
build on (`common/`) is already framework-free."""
