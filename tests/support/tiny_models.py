"""Tiny random causal LMs built from configs, saved as local Hugging Face folders (seconds, no hub)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def tiny_config(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3NextConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=VOCAB - 1, bos_token_id=0, tie_word_embeddings=True)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if arch == "gemma3":
        # 5 sliding-window layers then 1 full; a window of 8 is exceeded within the first prompt.
        return Gemma3TextConfig(head_dim=8, sliding_window=8, pad_token_id=0,
                                **{**common, "num_hidden_layers": 6})
    if arch == "qwen3_5":
        # Hybrid: 3 Gated DeltaNet (linear-attention) layers, then 1 full-attention layer.
        return Qwen3_5TextConfig(head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                                 linear_key_head_dim=8, linear_value_head_dim=8,
                                 **{**common, "num_hidden_layers": 4})
    if arch == "qwen3_next":
        # Hybrid as qwen3_5, with a mixture-of-experts MLP in every layer (4 experts, 2 per token).
        return Qwen3NextConfig(head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               **{**common, "num_hidden_layers": 4})
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, varied: bool = False):
    """`varied=False`: the tied head sharpened, so greedy decoding falls into loops prompt lookup can predict
    (the output repeats the last token). `varied=True`: an LM head of its own, random, so greedy text follows
    the context (many distinct tokens, no loop) and a cache that keeps a rejected draft or loses a kept token
    changes what comes next -- what the rollback tests need."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        if varied:
            # With tied embeddings the residual stream of a random model is mostly its input token's embedding,
            # which the same matrix then scores highest: a head of its own breaks that echo.
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(torch.randn(head.weight.shape))
        else:
            model.get_output_embeddings().weight.mul_(8.0)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                # Random A_log decays the recurrent state to nothing within a token; a slow decay makes
                # the state carry over, so a wrong state rollback changes the logits.
                layer.linear_attn.A_log.fill_(-3.0)
    return model.eval()


def save_tiny_model(arch: str, root: Path, seed: int = 0) -> Path:
    path = root / f"tiny-{arch}"
    if not (path / "config.json").exists():
        tiny_model(arch, seed).save_pretrained(path)
    return path


@torch.inference_mode()
def plain_greedy(model, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Reference: re-run the whole sequence every step (no cache, no speculation), take the argmax."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


def tiny_char_tokenizer():
    """A tokenizer for the tiny models' vocabulary: the 95 printable ASCII characters (ids 0..94, byte-level
    symbols as GPT-2's, so a space is its own token) and the eos "</s>" (95, the tiny configs' eos): JSON can be
    written with it, which the structured-output tests need."""
    tok = char_tokenizer(list(range(32, 127)))
    assert len(tok) == VOCAB
    return tok


def char_tokenizer(codes: list[int]):
    """A token per character of `codes` (ids in that order, byte-level symbols as GPT-2's) and the eos "</s>"
    after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {symbols[c]: i for i, c in enumerate(codes)}
    vocab["</s>"] = len(codes)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
