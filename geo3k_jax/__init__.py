"""geo3k_jax: the JAX/Flax learner of geo3k-rl (Qwen-VL models, sharded GRPO step, in-process
rollout engine, numerics check against torch).

One folder per component, each importing only the folders listed before it: `core` (mesh,
batches, slices), `kernels` (attention), `models` (Flax Qwen-VL, checkpoints), `learner` and
`engine` (which never import each other), `tpu` (compiling for TPU slices) and `check` (JAX
against torch). The entry points `train`, `main` and `aot` sit at the top and may import any
folder. tests/test_jax_layout.py holds the order."""
