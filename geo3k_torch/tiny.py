"""Build a tiny, randomly initialised Qwen-VL checkpoint that loads like a downloaded one.

    python -m geo3k_torch.tiny --arch qwen3_vl --vocab small --out data/tiny-qwen3_vl-small
    python -m geo3k_torch.tiny --arch qwen2_5_vl --vocab qwen --out /tmp/tiny --hidden-size 64
    python -m geo3k_torch.tiny --arch qwen3_vl_moe --vocab small --out data/tiny-qwen3_vl_moe-small

The directory holds what `AutoModelForImageTextToText.from_pretrained` and
`common.processor.load_processor` read from a real Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE download
(the MoE model: Qwen3-VL's vision tower, processor and chat template; a sparse MoE block in
every decoder layer, as Qwen3-VL-30B-A3B has them, with a few experts): config.json,
generation_config.json, model.safetensors (float32, tied embeddings), tokenizer.json and
tokenizer_config.json (`Qwen2Tokenizer`, eos `<|im_end|>`, pad `<|endoftext|>`),
chat_template.jinja (`common.chat_template`), processor_config.json and preprocessor_config.json
(the PIL image processor's settings; the processor class is named as in real checkpoints), and
video_preprocessor_config.json (read only where torchvision exists). Token ids in the configs come
from the tokenizer (`common.tokenizer`): the small vocabulary has 2,048 ids; the Qwen one 151,643
plus special tokens, with the embedding padded to 151,936 rows like the real models. The same
arguments and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from common.chat_template import CHAT_TEMPLATE
from common import tokenizer as toks
from common.processor import MODEL_TYPES, family

ARCHS = MODEL_TYPES  # qwen3_vl, qwen2_5_vl, qwen3_vl_moe
QWEN_PADDED_VOCAB = 151936  # vocab_size of Qwen3-VL-2B / Qwen2.5-VL-3B (rows past the tokenizer unused)
DEFAULT_PATCH = {"qwen3_vl": 16, "qwen2_5_vl": 14}
PROCESSOR_CLASS = {"qwen3_vl": "Qwen3VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
VIDEO_PROCESSOR_CLASS = {"qwen3_vl": "Qwen3VLVideoProcessor", "qwen2_5_vl": "Qwen2VLVideoProcessor"}
# (keyed by `common.processor.family`: qwen3_vl_moe has qwen3_vl's)
# Qwen3-VL normalises pixels to [-1, 1]; Qwen2.5-VL uses CLIP's mean and std.
IMAGE_MEAN_STD = {"qwen3_vl": ([0.5] * 3, [0.5] * 3),
                  "qwen2_5_vl": ([0.48145466, 0.4578275, 0.40821073],
                                 [0.26862954, 0.26130258, 0.27577711])}


@dataclasses.dataclass(frozen=True)
class TinySizes:
    """Model and image sizes. None means: derived from the others (see `resolved`)."""

    hidden_size: int = 128
    intermediate_size: int | None = None  # 3 * hidden_size
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_depth: int = 2
    vision_hidden: int = 64
    experts: int = 4  # qwen3_vl_moe: experts per MoE block (Qwen3-VL-30B-A3B: 128)
    experts_per_token: int = 2  # and how many each token is routed to (30B-A3B: 8)
    moe_intermediate_size: int | None = None  # each expert's; about 3/8 of hidden_size, a multiple of 8 (30B-A3B: 768 of 2048)
    vision_heads: int | None = None  # vision_hidden // 32 (at least 1)
    vision_intermediate: int | None = None  # 2 * vision_hidden
    patch_size: int | None = None  # 16 for qwen3_vl, 14 for qwen2_5_vl
    spatial_merge: int = 2
    window_size: int | None = None  # qwen2_5_vl: 2 x 2 merged patches, in pixels
    min_pixels: int | None = None  # 4 merged patches: (2 * patch * merge) ** 2
    max_pixels: int | None = None  # 64 merged patches: (8 * patch * merge) ** 2
    max_position_embeddings: int = 32768
    init_std: float = 0.02

    def resolved(self, arch: str) -> TinySizes:
        """A copy with every None filled in for `arch`, checked for consistency."""
        patch = self.patch_size or DEFAULT_PATCH[family(arch)]
        unit = patch * self.spatial_merge  # pixels per merged patch side
        out = dataclasses.replace(
            self, patch_size=patch,
            intermediate_size=self.intermediate_size or 3 * self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size or max(8, 3 * self.hidden_size // 64 * 8),
            vision_heads=self.vision_heads or max(1, self.vision_hidden // 32),
            vision_intermediate=self.vision_intermediate or 2 * self.vision_hidden,
            window_size=self.window_size or 2 * unit,
            min_pixels=self.min_pixels or (2 * unit) ** 2,
            max_pixels=self.max_pixels or (8 * unit) ** 2)
        checks = [
            (out.hidden_size % out.heads == 0, "hidden_size must be a multiple of heads"),
            (out.heads % out.kv_heads == 0, "heads must be a multiple of kv_heads"),
            ((out.hidden_size // out.heads) % 8 == 0, "head_dim must be a multiple of 8"),
            (out.vision_hidden % out.vision_heads == 0, "vision_hidden must divide by vision_heads"),
            ((out.vision_hidden // out.vision_heads) % 4 == 0, "vision head dim must divide by 4"),
            (out.window_size % unit == 0, f"window_size must be a multiple of {unit}"),
            (unit * unit <= out.min_pixels <= out.max_pixels, "need unit**2 <= min <= max pixels"),
            (out.vision_depth >= 1 and out.layers >= 1, "depths must be positive"),
            (arch != "qwen3_vl_moe" or 1 <= out.experts_per_token <= out.experts,
             "need 1 <= experts_per_token <= experts"),
            # torch's grouped matmul (the experts' kernel) takes rows of 16-byte multiples
            (arch != "qwen3_vl_moe" or out.moe_intermediate_size % 8 == 0,
             "moe_intermediate_size must divide by 8"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}: {out}")
        return out


def mrope_section(head_dim: int, arch: str) -> list[int]:
    """[t, h, w] rotary frequency counts summing to head_dim / 2, in the real models' ratios:
    Qwen2.5-VL 16/24/24 of 64 (contiguous blocks); Qwen3-VL 24/20/20 of 64, interleaved
    t,h,w,t,h,w,... so h and w may take at most a third of the frequencies each."""
    half = head_dim // 2
    if arch == "qwen2_5_vl":
        t = max(1, round(half / 4))
        h = (half - t) // 2
        return [t, h, half - t - h]
    hw = max(1, min(round(half * 20 / 64), half // 3))
    return [half - 2 * hw, hw, hw]


def deepstack_indexes(vision_depth: int, text_layers: int) -> list[int]:
    """Qwen3-VL vision blocks whose features are added to the first text layers: up to three,
    evenly spaced like the real [5, 11, 17] of 24 blocks, never more than the text layers."""
    n = max(1, min(3, vision_depth - 1, text_layers))
    return sorted({max(0, round((k + 1) * vision_depth / (n + 1)) - 1) for k in range(n)})


def fullatt_indexes(vision_depth: int) -> list[int]:
    """Qwen2.5-VL vision blocks with full (not windowed) attention: every quarter of the depth,
    the last block included, like the real [7, 15, 23, 31] of 32."""
    period = max(2, vision_depth // 4)
    return sorted({vision_depth - 1} | {i for i in range(period - 1, vision_depth, period)})


def make_config(arch: str, ids: dict[str, int], vocab_size: int, s: TinySizes):
    """The transformers config of a tiny `arch` model; `ids` maps special tokens to ids."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    head_dim = s.hidden_size // s.heads
    text = dict(vocab_size=vocab_size, hidden_size=s.hidden_size,
                intermediate_size=s.intermediate_size, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                max_position_embeddings=s.max_position_embeddings, rms_norm_eps=1e-6,
                initializer_range=s.init_std, tie_word_embeddings=True,
                bos_token_id=ids[toks.PAD_TOKEN], eos_token_id=ids[toks.EOS_TOKEN],
                pad_token_id=ids[toks.PAD_TOKEN], dtype="float32")
    vision = dict(depth=s.vision_depth, hidden_size=s.vision_hidden, num_heads=s.vision_heads,
                  intermediate_size=s.vision_intermediate, out_hidden_size=s.hidden_size,
                  patch_size=s.patch_size, spatial_merge_size=s.spatial_merge,
                  temporal_patch_size=2, initializer_range=s.init_std)
    top = dict(image_token_id=ids[toks.IMAGE_TOKEN], video_token_id=ids[toks.VIDEO_TOKEN],
               vision_start_token_id=ids[toks.VISION_START_TOKEN],
               vision_end_token_id=ids[toks.VISION_END_TOKEN], tie_word_embeddings=True,
               dtype="float32")
    rope = {"rope_type": "default", "mrope_section": mrope_section(head_dim, arch)}
    if arch == "qwen3_vl_moe":  # Qwen3-VL-30B-A3B's layout: every decoder layer sparse
        text.update(num_experts=s.experts, num_experts_per_tok=s.experts_per_token,
                    moe_intermediate_size=s.moe_intermediate_size, decoder_sparse_step=1,
                    mlp_only_layers=[], router_aux_loss_coef=0.001)
    if family(arch) == "qwen3_vl":
        text.update(head_dim=head_dim, rope_parameters={**rope, "mrope_interleaved": True,
                                                        "rope_theta": 5_000_000.0})
        vision.update(hidden_act="gelu_pytorch_tanh", num_position_embeddings=256,
                      deepstack_visual_indexes=deepstack_indexes(s.vision_depth, s.layers))
        kind = Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig
        return kind(text_config=text, vision_config=vision, **top)
    if arch == "qwen2_5_vl":
        text.update(rope_parameters={**rope, "rope_theta": 1_000_000.0})
        vision.update(hidden_act="silu", window_size=s.window_size, tokens_per_second=2,
                      fullatt_block_indexes=fullatt_indexes(s.vision_depth))
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def save_processor(out: Path, arch: str, tok, s: TinySizes) -> None:
    """Write the tokenizer, chat template and image-processor configs of a checkpoint.

    `tok` is a `tokenizers.Tokenizer`. The files name the real processor class (the image-only
    subclass used to write them exists only in `common.processor`), and preprocessor_config.json
    repeats the image settings, with min/max_pixels, for readers of the pre-5.x layout."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from common.processor import image_only_processor_classes

    hf_tok = Qwen2Tokenizer(tokenizer_object=tok, eos_token=toks.EOS_TOKEN,
                            pad_token=toks.PAD_TOKEN, unk_token=None, bos_token=None,
                            model_max_length=s.max_position_embeddings)
    arch = family(arch)
    mean, std = IMAGE_MEAN_STD[arch]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=s.patch_size, temporal_patch_size=2, merge_size=s.spatial_merge,
        min_pixels=s.min_pixels, max_pixels=s.max_pixels, image_mean=mean, image_std=std)
    processor = image_only_processor_classes()[arch](
        image_processor=image_processor, tokenizer=hf_tok, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    image_processor.save_pretrained(str(out))
    extra = {"preprocessor_config.json": {"min_pixels": s.min_pixels,
                                          "max_pixels": s.max_pixels}}
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = out / name
        data = json.loads(path.read_text())
        data.update(extra.get(name, {}), processor_class=PROCESSOR_CLASS[arch])
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    # Read only where torchvision exists (AutoProcessor builds the video processor from it).
    video = {"video_processor_type": VIDEO_PROCESSOR_CLASS[arch], "patch_size": s.patch_size,
             "temporal_patch_size": 2, "merge_size": s.spatial_merge, "image_mean": mean,
             "image_std": std, "processor_class": PROCESSOR_CLASS[arch]}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2,
                                                                   sort_keys=True) + "\n")


def build_tiny_checkpoint(out_dir: str | Path, arch: str = "qwen3_vl", vocab: str = "small",
                          seed: int = 0, **sizes) -> Path:
    """Build a tiny `arch` checkpoint with the `vocab` tokenizer into `out_dir`; returns it.

    `sizes` are `TinySizes` fields (hidden_size=128, layers=2, heads=4, kv_heads=2,
    vision_depth=2, vision_hidden=64, patch_size, spatial_merge=2, window_size, min_pixels,
    max_pixels, ...). Weights: `torch.manual_seed(seed)`, normal(0, init_std) init, float32."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from geo3k_torch.checkpoint import save_published

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    s = TinySizes(**sizes).resolved(arch)
    tok = toks.build_tokenizer(vocab, family(arch))
    ids = toks.special_token_ids(tok)
    vocab_size = QWEN_PADDED_VOCAB if vocab == "qwen" else tok.get_vocab_size()
    config = make_config(arch, ids, vocab_size, s)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[toks.PAD_TOKEN], pad_token_id=ids[toks.PAD_TOKEN],
        eos_token_id=[ids[toks.EOS_TOKEN], ids[toks.PAD_TOKEN]])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_published(model, out)
    save_processor(out, arch, tok, s)
    return out


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=ARCHS, default="qwen3_vl")
    p.add_argument("--vocab", choices=toks.VOCABS, default="small")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)
    for field in dataclasses.fields(TinySizes):
        kind = float if field.name == "init_std" else int
        p.add_argument("--" + field.name.replace("_", "-"), type=kind, default=None,
                       help=f"default: {field.default}")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)
    sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(TinySizes)
             if getattr(args, f.name) is not None}
    start = time.perf_counter()
    out = build_tiny_checkpoint(args.out, arch=args.arch, vocab=args.vocab, seed=args.seed,
                                **sizes)
    files = sorted(p for p in out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"built {args.arch}/{args.vocab} in {time.perf_counter() - start:.1f} s: {out} "
          f"({total / 2**20:.1f} MiB)")
    for p in files:
        print(f"  {p.name:28s} {p.stat().st_size:>12,d} B")


if __name__ == "__main__":
    main()
