"""The in-process rollout engine (`engine`), its prefill and decode steps (`decode`), its KV
cache (`kv_budget`) and the engine as the JAX learner's rollout backend (`backend`). Imports
only `geo3k_jax.core`, `geo3k_jax.kernels` and `geo3k_jax.models`; never `geo3k_jax.learner`."""
