"""Every config field of geo3k-rl with its default. Other configs start from `get_config()`.

Sections whose keys mirror a dataclass of `common/` (env -> EnvConfig, reward -> RewardConfig,
rollout -> RolloutConfig, loss -> LossConfig) are converted with `configs.to_dataclass`; a test
keeps the two in sync. The dict is locked: a misspelled key, here or on the command line
(`--config.rollout.n_samples=4`), is an error.
"""

import ml_collections
from ml_collections.config_dict import FieldReference, placeholder


# Partition rules, first match wins: (regex on the checkpoint key, one mesh axis per dimension).
# Column-parallel projections split their output rows over `tensor`, row-parallel ones their
# input columns; FSDP takes the other dimension. Unmatched parameters (norms, biases of
# row-parallel layers, the patch embedding) are replicated.
JAX_RULES = (
    (r"(embed_tokens|lm_head)\.weight$", ("tensor", "fsdp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj|attn\.qkv|linear_fc1|mlp\.0)\.weight$",
     ("tensor", "fsdp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj|attn\.qkv|linear_fc1|mlp\.0)\.bias$",
     ("tensor",)),
    (r"(o_proj|down_proj|attn\.proj|linear_fc2|mlp\.2)\.weight$", ("fsdp", "tensor")),
    # a MoE block's stacked experts (E, out, in): experts over `expert`, then as the projections
    # above (the router, E x hidden, replicated)
    (r"mlp\.experts\.gate_up_proj$", ("expert", "tensor", "fsdp")),
    (r"mlp\.experts\.down_proj$", ("expert", "fsdp", "tensor")),
)


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # the run's sampling and data order (not the tiny model's or synthetic set's)

    # Geometry3K in a public HF layout (parquet or `datasets.save_to_disk`), or the synthetic set.
    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # parquet file/folder or Hub dataset name; empty: the synthetic set
    c.data.train_split = "train"  # split name to train on
    c.data.test_split = "test"  # split name to evaluate on
    c.data.skip_bad_rows = False  # True: count and skip unusable rows; False: stop at the first
    c.data.overlap = "refuse"  # a test problem that repeats a train one: refuse | drop it
    # tool: the scoring tool's system prompt and schema (multi-turn); brief: the same task in one
    # short system sentence, no schema (a tiny model primed on the call); boxed: "reason, then
    # the final answer in \boxed{}" and no tool (single-turn, SFT). common.prompts.PROMPT_STYLES
    c.data.prompt_style = "tool"
    c.data.synthetic_dir = "data/synthetic"  # where the synthetic set is generated when path is ""
    # The synthetic set's seed (the test split's is this + 10,000), not the run's `seed`: runs of
    # every seed read the same problems.
    c.data.synthetic_seed = 0
    c.data.synthetic_train_size = 512  # problems in the synthetic train split
    c.data.synthetic_test_size = 64  # problems in the synthetic test split
    c.data.synthetic_image_size = "112"  # one size "112" or a range "112,224"
    # comma-separated common.synthetic.FAMILIES, each problem drawing one uniformly (a family
    # named twice is drawn twice as often); empty: all of them, once
    c.data.synthetic_families = ""

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # HF checkpoint folder or Hub name (Qwen2.5-VL, Qwen3-VL, -MoE); "": tiny
    # With no path, a tiny checkpoint is built once into `tiny_dir` (geo3k_torch.tiny).
    c.model.tiny_dir = "data/tiny-qwen3_vl-small"
    # the tiny checkpoint's architecture: qwen3_vl | qwen2_5_vl | qwen3_vl_moe (Qwen3-VL with
    # sparse MoE decoder layers, as Qwen3-VL-30B-A3B; the torch learner trains it)
    c.model.tiny_arch = "qwen3_vl"
    c.model.tiny_vocab = "small"  # its tokenizer: small (a few hundred tokens) | qwen
    c.model.tiny_seed = 0  # the tiny checkpoint's init, pretraining and priming (not `seed`)
    # A new tiny checkpoint's vision pretraining (geo3k_torch.pretrain), before the priming:
    # steps of its vision tower classifying perception figures, then of captions with it frozen
    # (off: with it the quick CPU run still ends at chance, docs/results.md's third attempt).
    c.model.tiny_see_steps = 0  # vision tower classification steps
    c.model.tiny_caption_steps = 0  # caption steps, tower frozen
    c.model.tiny_prime_steps = 0  # supervised tool-call format steps for a new tiny checkpoint
    c.model.tiny_prime_later_steps = 0  # steps before those, on second turns only (the reading)
    c.model.tiny_prime_vision = True  # False: the priming leaves the vision tower as it is
    c.model.tiny_prime_answer = "letter"  # its random calls answer a choice's letter | value
    # A later turn's primed call: any choice | new (one no earlier call of the episode gave, the
    # earlier calls distinct) | new_after_repeats (as new, the earlier calls possibly repeating)
    # | cyclic (as new_after_repeats, the next listed choice after the last one given)
    c.model.tiny_prime_retry = "any"
    # How the tool reaches the model: auto (the template's own tool support where it has it,
    # else the schema in the system prompt, as for Qwen2.5-VL) | template | system_prompt.
    c.model.tool_format = "auto"

    # The environment (common.env.EnvConfig).
    c.env = ml_collections.ConfigDict()
    c.env.max_turns = 3  # assistant turns an episode may take (feedback between them)
    c.env.end_on_correct = True  # a correct tool call ends the episode
    c.env.end_on_no_tool_call = True  # a turn without a tool call ends the episode
    # One grading setting for the environment's verdicts AND the reward (they cannot disagree):
    c.env.rel_tol = 0.0  # relative tolerance for numeric answers (0: exact)
    c.env.grade_timeout_s = 5.0  # time limit of grading one answer (math-verify in a worker)
    c.env.accept_choice_letter = True  # "B" counts as choice B's value on choice problems
    c.env.feedback_role = "tool"  # tool | user: how feedback on a tool call enters the chat

    # The episode reward (common.reward.RewardConfig).
    c.reward = ml_collections.ConfigDict()
    c.reward.source = "tool_or_boxed"  # where an answer may come from: tool | boxed | tool_or_boxed
    c.reward.turn_discount = 1.0  # a solve on turn t earns turn_discount ** (t - 1)
    c.reward.format_bonus = 0.0  # added once for at least one well-formed tool call
    # Subtracted once per turn that repeats an answer the environment already rejected.
    c.reward.repeat_penalty = 0.0
    # Added to a solve on a turn after a miss, the policy's own or a forced one (SCoRe's bonus
    # for progress between attempts).
    c.reward.progress_bonus = 0.0
    c.reward.fn = ""  # "package.module:function" with score_episode's signature: your own reward

    # Multi-turn sampling (common.rollout.RolloutConfig).
    c.rollout = ml_collections.ConfigDict()
    c.rollout.n_samples = 8  # episodes per prompt: the GRPO group size
    c.rollout.max_response_tokens = 1024  # new tokens per assistant turn, at most
    c.rollout.max_context_tokens = 4096  # an episode's whole length (prompt, turns, feedback)
    c.rollout.temperature = 1.0  # sampling temperature of the training episodes
    c.rollout.top_p = 1.0  # nucleus sampling mass (1: off)
    c.rollout.max_retries = 2  # engine failures retried per request before it is aborted
    c.rollout.export_style = "concat"  # one trajectory per episode | individual: one per turn
    c.rollout.schedule = "episode"  # episode (each episode at its own pace) | lockstep

    # Where rollouts come from: the in-process engine of the learner's framework (local: torch
    # for geo3k_torch, JAX for geo3k_jax), the torch engine (torch: for the JAX learner, reloads
    # its exported weights every step), or SGLang servers (GPU machines).
    c.engine = ml_collections.ConfigDict()
    c.engine.backend = "local"  # local | torch | sglang
    # The in-process torch engine: most decode slots, and the KV cache of the slots (rows x
    # (longest prompt + max new tokens)); a larger request is refused.
    c.engine.local_max_batch = 256
    c.engine.local_kv_budget_gb = 24.0  # GiB of KV cache the torch engine's slots may take
    c.engine.local_cuda_graphs = True  # on CUDA, replay each decode step as a CUDA graph
    # The decode step's fast paths (geo3k_torch.decode), each off = its plain twin, the one the
    # tests compare against. Off until measured on a GPU (scripts/gpu_check.py, engine_torch).
    c.engine.local_graph_sampling = False  # the graph samples too (seeded generator registered)
    c.engine.local_keep_slots = False  # keep slots and graphs across calls (memory stays held)
    c.engine.local_attention_bucket = 0  # attend up to the longest position in buckets (0: all)
    c.engine.local_compile = False  # torch.compile the step (needs local_keep_slots)
    c.engine.local_compile_backend = "inductor"  # "aot_eager": traced, no new kernels (tests)
    c.engine.sglang_urls = ""  # comma-separated running servers; empty: launch them here
    # Launched here (common.sglang.placement): colocated, one server per sglang_gpus_per_server
    # (its tp) learner GPUs, each process generating through the one on its GPU; otherwise
    # sglang_servers servers on GPUs of their own from sglang_base_gpu (-1: the first GPU after
    # the learners'). mem_fraction: SGLang's --mem-fraction-static, the share of a GPU for its
    # weights and KV cache (0.6: slime's colocated Geometry3K multi-turn recipe).
    c.engine.sglang_servers = 1
    c.engine.sglang_gpus_per_server = 1  # SGLang --tp-size
    # SGLang --ep-size: a MoE model's experts split into this many groups over a server's GPUs
    # (ep = sglang_gpus_per_server: each GPU holds E / ep whole experts); 1: every GPU holds a
    # tp slice of every expert. Divides sglang_gpus_per_server and the model's expert count.
    c.engine.sglang_ep_size = 1
    c.engine.sglang_base_gpu = -1  # first GPU of dedicated servers (-1: after the learners')
    c.engine.sglang_mem_fraction = 0.6  # SGLang --mem-fraction-static
    # Weight sync: auto (bf16 in memory for colocated servers the learner can hand tensors to,
    # else files) | tensor | disk (bf16 safetensors from the torch learner); bucket size.
    c.engine.sglang_weight_sync = "auto"
    c.engine.sglang_bucket_mb = 512.0  # MB of weights per in-memory update call
    c.engine.sglang_attention_backend = ""  # empty: SGLang's default
    c.engine.sglang_port_base = 30000  # launched servers listen on this port and up
    c.engine.sglang_timeout_s = 600.0  # one request's time limit
    c.engine.sglang_max_retries = 3  # retries of a failed request
    c.engine.sglang_max_concurrency = 256  # requests in flight per process
    c.engine.sglang_colocated = False  # release the servers' memory during training
    # Launch to ready, all servers together (loading a checkpoint takes minutes). The other
    # processes wait for the launching ones in a collective meanwhile (the gather of the
    # servers' URLs): keep this below the torch learner's collective timeout
    # (train.collective_timeout_s, 1800 s), or the waiting processes time out first.
    c.engine.sglang_startup_timeout_s = 900.0
    # One readiness probe: SGLang's health check sleeps 1 s, generates, gives up after 20 s.
    c.engine.sglang_health_timeout_s = 60.0
    # Colocated release: after aborting, wait this long for /flush_cache to say "idle".
    c.engine.sglang_idle_timeout_s = 120.0
    # Compare SGLang's expanded prompt ids with ours exactly: off | first (the run's first
    # request, and on demand) | every request (costs a prompt-sized list per answer).
    c.engine.sglang_check_prompt_ids = "first"
    # The in-process JAX engine: requests decoding at once (rows of its KV cache, each of
    # rollout.max_context_tokens), and the share of a device's memory its cache and weights may
    # take (checked at start: a cache that would not fit stops the run with the numbers).
    c.engine.slots = 32  # JAX engine: requests decoding at once
    c.engine.kv_memory_fraction = 0.9  # JAX engine: device memory share for cache and weights
    # The JAX engine's largest prefill: at most this many work rows (0: the slots) of at most
    # this many new tokens each (0: the context); a request with more new tokens (a long
    # prompt, an evicted session prefilled whole) is prefilled alone. They bound the prefill's
    # memory (`python -m geo3k_jax.aot` compiles them).
    c.engine.prefill_rows = 0
    c.engine.prefill_tokens = 0
    # Compile the JAX engine's every program (`JaxEngine.compile_set`: a prefill with and one
    # without images and an insert for each prefill shape, the decode) before the first
    # rollout, in parallel; off: each at its first use (the same bounded set).
    c.engine.warm_up = False

    # GRPO (common.grpo.LossConfig) and the advantage options.
    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2  # PPO ratio clip below 1
    c.loss.clip_high = 0.28  # PPO ratio clip above 1 (DAPO's clip-higher)
    c.loss.dual_clip = placeholder(float)  # None: off
    c.loss.kl_coef = 0.0  # weight of the KL term to the initial policy (0: no reference model)
    c.loss.kl_estimator = "k3"  # k1 | k2 | k3 (Schulman's estimators)
    c.loss.tis_cap = placeholder(float)  # None: no truncated importance sampling
    c.loss.agg = "token-mean"  # token-mean | seq-mean-token-mean: how token losses average
    # A MoE model's (qwen3_vl_moe, torch learner) Switch load-balancing loss over the trained
    # tokens, per layer averaged, added with this weight (0: off; transformers' default 0.001)
    c.loss.router_aux_coef = 0.0
    # A MoE model's learner routes each token to the experts the engine routed it to (Rollout
    # Routing Replay, Ma et al. 2025): engine and learner otherwise may pick other experts for
    # the same token, a log-prob mismatch that destabilises GRPO on MoE models. The engine
    # records its routing (SGLang gets --enable-return-routed-experts); the router's weights
    # still learn through the replayed experts' scores.
    c.loss.routing_replay = False
    c.advantage = ml_collections.ConfigDict()
    c.advantage.normalize_std = True  # divide by the group's reward std (False: Dr. GRPO)
    c.advantage.filter_equal_groups = True  # dynamic sampling: drop groups with equal rewards
    # True: the tokens of turn t are scored against the group's episodes that reached turn t
    # (common.grpo.turn_advantages); False: every token against the whole group
    c.advantage.turn_baseline = False

    c.train = ml_collections.ConfigDict()
    c.train.device = "auto"  # auto | cpu | cuda
    c.train.steps = 100  # GRPO steps (one rollout each)
    c.train.prompts_per_step = 16  # prompts per rollout, over all processes
    # Packed tokens per micro-batch (per process), or "auto" (the torch learner): the largest
    # size, and the activation checkpointing mode, that the device's free memory holds
    # (geo3k_torch.memory measures the activations at start-up and says what it chose and why).
    # (An int or "auto": typed `object`, so --config.train.micro_batch_tokens takes either.)
    c.train.micro_batch_tokens = FieldReference(8192, field_type=object)
    # auto: the fastest checkpointing mode whose micro-batch reaches this many tokens wins, else
    # the mode of the largest micro-batch.
    c.train.micro_batch_target_tokens = 32768
    # auto: the share of the free memory left unplanned (fragmentation, what colocated SGLang
    # servers keep while released, images larger than the probe's).
    c.train.micro_batch_margin = 0.1
    # A group's samples share its prompt in the micro-batches: the learner computes the prompt
    # and encodes its images once per group (common.batching; exact, see tests/test_shared_prefix).
    c.train.share_prefix = True
    # Optimizer steps per rollout, each on a consecutive share of its micro-batches, against
    # the behaviour policy's log-probs (1: the anchor recipe; >1: the ratio and clipping act).
    c.train.updates_per_rollout = 1
    # The share of each step's prompts whose groups all start from the same forced wrong first
    # call (a uniformly random wrong choice, scored by the environment, masked from the loss):
    # their retries compete after one miss, which a retry keyed on the first answer cannot win.
    c.train.forced_miss_fraction = 0.0
    # Rollouts generated ahead while the learner trains, at most this many updates old
    # (0: the synchronous loop; >= 1 needs an engine with its own weights; see common.pipeline).
    c.train.max_staleness = 0
    # Trained tokens whose (tokens x vocabulary) logits exist at once in the learner's LM head
    # (per micro-batch in torch, per row in JAX); 0 = all of them.
    c.train.logprob_chunk = 1024
    # The torch learner's LM head forms the loss's gradient in the forward pass, a chunk at a
    # time (geo3k_torch.head): no head recomputed in the backward pass, no logits kept.
    c.train.fused_head = False
    c.train.lr = 1e-6  # AdamW learning rate (peak, after warmup)
    c.train.lr_schedule = "constant"  # constant | linear | cosine
    c.train.warmup_steps = 0  # linear warmup from 0 to lr
    c.train.min_lr_ratio = 0.0  # the decaying schedules end at lr x this
    c.train.beta1 = 0.9  # AdamW
    c.train.beta2 = 0.98  # AdamW
    c.train.eps = 1e-8  # AdamW
    c.train.weight_decay = 0.1  # AdamW, decoupled
    # Train the language model alone: the vision tower (its merger included) is not updated.
    c.train.freeze_vision = False
    c.train.grad_clip = 1.0  # global gradient norm clip
    # CUDA: bf16 compute over fp32 master weights (FSDP2's MixedPrecisionPolicy, or on one GPU
    # its arithmetic without FSDP: train.fsdp), the KL reference and the local engine in bf16.
    # CPU always trains in fp32.
    c.train.bf16 = True
    # One GPU: auto trains a plain model, bf16 copies of fp32 master weights made once per step
    # (geo3k_torch.precision); always: FSDP2 at world size 1 too (casts every micro-batch).
    # Several processes always shard with FSDP2.
    c.train.fsdp = "auto"
    # A MoE model's experts split over this many processes (it divides the world and the experts;
    # 1: off): tokens travel to their experts by all-to-all, FSDP2 shards the rest over the world
    # and the expert slabs over the remaining ranks (geo3k_torch.expert_parallel). Torch learner
    # only: the JAX learner splits experts over jax.mesh.expert.
    c.train.expert_parallel = 1
    # On CUDA: recompute each layer in the backward pass (full), only its elementwise work
    # (selective: matmul and attention outputs kept), or nothing (none).
    c.train.activation_checkpointing = "full"
    # Whether that covers the vision tower's blocks too: they hold a micro-batch's patches, far
    # fewer than its tokens, so False trades little memory for no recomputation of launch-bound
    # work (the GPU check's learner rows measure it).
    c.train.checkpoint_vision = True
    # torch.compile each text decoder layer and each vision block as one region, checkpointing
    # inside (the torch learner and its KL reference; geo3k_torch.model.compile_layers). Off until
    # a GPU check shows it pays: scripts/gpu_check.py's learner rows measure both.
    c.train.compile = False
    c.train.compile_backend = "inductor"  # torch.compile's backend (aot_eager: no code generation)
    c.train.resume = False  # continue from the workdir's newest complete checkpoint
    # How long a torch collective waits for the other ranks; above the SGLang start-up wait
    # (engine.sglang_startup_timeout_s), which rank 0 may spend while the others wait.
    c.train.collective_timeout_s = 1800.0

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10  # steps; 0 = never
    c.eval.max_prompts = 64  # of the test split; 0 = all
    c.eval.n_samples = 1  # sampled episodes per prompt (besides one greedy)
    c.eval.blank_images = False  # also run greedy with every image blanked (white): blank/* keys
    # also run greedy after a forced first call that answers a uniformly random wrong choice
    # (the environment's own feedback), beside the best figure-blind retry: forced/* keys
    c.eval.forced_miss = False

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True  # TensorBoard events in the workdir
    c.log.wandb_project = ""  # empty: no wandb
    c.log.dump_rollouts = True  # every trajectory to rollouts/step_<N>.jsonl
    c.log.plot_every = 1  # redraw curve.png every this many steps (0: never)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10  # steps; the last step is always saved
    c.checkpoint.keep = 2  # newest complete checkpoints kept
    # Where they go: "" is <workdir>/checkpoints; an object store URL (gs://bucket/run) with the
    # JAX learner (orbax writes there; the torch learner needs a shared POSIX path).
    c.checkpoint.dir = ""

    # The JAX learner (geo3k_jax): mesh, partition rules and the cross-backend check.
    c.jax = ml_collections.ConfigDict()
    # -1: the rest; expert: a MoE model's experts split over it (a data axis for the rest)
    c.jax.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})
    c.jax.rules = JAX_RULES  # partition rules (above)
    c.jax.pad_to = 128  # the check's packed rows are padded to a multiple of this
    c.jax.compute_dtype = "float32"  # float32 | bfloat16 (fp32 parameters and optimizer state)
    c.jax.remat = False  # recompute each decoder layer and vision block in the backward pass
    # what a rematerialised layer keeps: full (nothing) | projections (the dense projections'
    # outputs: geo3k_jax.models.layers.REMAT_POLICIES)
    c.jax.remat_policy = "full"
    # auto | splash | windowed (auto: splash on TPU; geo3k_jax.kernels.splash)
    c.jax.attention = "auto"
    # Learner row lengths (geo3k_jax.core.buckets.Ladder): lengths an octave (a power of two) and
    # how much longer a compiled shape may be than a slice needs; finer pads less, compiles more.
    c.jax.row_rungs = 4
    c.jax.reuse_slack = 1.5  # a compiled row may be this much longer than needed
    # Or one slice shape for the whole run (a TPU compile takes minutes): rows of the micro-batch
    # budget with room for `targets` trained tokens, `patches` image patches, `window` own keys
    # per query block (0: the whole row) and `prefix_window` shared-prompt keys; a slice that
    # needs more is an error naming the setting. targets = 0: shapes follow the data (above).
    c.jax.slice = ml_collections.ConfigDict(
        {"targets": 0, "patches": 0, "window": 0, "prefix_window": 0})
    c.jax.compilation_cache_dir = "data/jax_cache"  # persistent XLA cache; "" = off
    c.jax.distributed = False  # jax.distributed.initialize() first (multi-host slices)
    c.jax.platform = ""  # "tpu": refuse to start where JAX sees another platform; "" = any
    # At start, compile the learner's step (its one slice shape, jax.slice) and the JAX engine's
    # largest programs on the run's devices and refuse when, together, they do not fit a
    # device's memory (its own, or jax.hbm_gib GiB): `python -m geo3k_jax.aot`'s budget.
    c.jax.hbm_check = False
    c.jax.hbm_gib = 0.0
    # Device memory between a step's phases (geo3k_jax.learner.phases), with
    # train.max_staleness = 0: free the JAX engine's KV cache and weights during the learner's
    # step (no result changes; ignored, with a line saying so, where rollouts overlap training),
    # and keep the learner's Adam moments ("moments") or its whole state ("all") in host memory
    # during rollouts.
    c.jax.free_engine = True
    c.jax.offload = "none"  # none | moments | all
    c.jax.check = ml_collections.ConfigDict()
    c.jax.check.dtype = "float32"  # float32 | bfloat16 (both backends' weights in that dtype)
    c.jax.check.prompts = 3  # synthetic problems; each episode answers wrong, then right
    c.jax.check.samples = 2  # episodes per problem
    c.jax.check.images = "1,2"  # images per problem, cycled (the diagram, plus other diagrams)
    c.jax.check.image_sizes = "40-200"  # pixel range of each image's width and height
    c.jax.check.micro_batch_tokens = 0  # packing budget; 0 = half the sequences' total
    c.jax.check.seed = 0  # the check's problems and weights
    # auto | on | off: both sides' float32 log-probs also measured against transformers in
    # float64 (auto: float32 checks of checkpoints of at most 1 GiB; geo3k_jax.check.numerics)
    c.jax.check.float64_reference = "auto"

    c.lock()
    return c
