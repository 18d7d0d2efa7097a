"""The Flax Qwen2.5-VL and Qwen3-VL models: building blocks (`layers`), the language models
(`text`), the vision towers (`vision`), the model for conditional generation and its log-probs
(`model`), and Hugging Face checkpoints in and out (`weights`). Imports only `geo3k_jax.core`
and `geo3k_jax.kernels`."""
