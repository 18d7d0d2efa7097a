"""The attention kernels: the Pallas splash kernel (`splash`), windowed attention over packed
rows in XLA (`windowed`) and the engine's decode attention over paged keys (`ragged`). Imports
only `geo3k_jax.core`."""
