"""Compiling for TPUs on a host without one: slices by name and their compile-only devices
(`topology`), what the compiler reports of a program against a chip (`compiled`), and the
engine's programs compiled from shapes (`engine_aot`). May import every folder of geo3k_jax but
`geo3k_jax.check`."""
