"""The pieces every other part of the JAX side builds on: the device mesh and partition rules
(`sharding`), stacked layer parameters (`stacking`), packed micro-batches as arrays (`batch`) and
as fixed-shape slices (`buckets`), the vision towers' grid bookkeeping (`vision_grid`), the
collectives over processes (`distributed`), the compilation cache (`compiler`) and the wide
dtype of statistics (`dtypes`). Imports no other folder of geo3k_jax."""
