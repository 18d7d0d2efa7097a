"""The shared core of geo3k-rl: data, environment, reward, multi-turn rollout, GRPO math, batching.

Plain Python + numpy (plus PIL and the tokenizer/image-processor side of transformers, imported
lazily where needed). Nothing here imports torch, jax, flax, optax or orbax.
"""
