"""The GRPO learner (`learner`) and device memory between a step's phases (`phases`). Imports
only `geo3k_jax.core`, `geo3k_jax.kernels` and `geo3k_jax.models`; never `geo3k_jax.engine`."""
