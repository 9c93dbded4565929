"""A pair of architectures and tokenizers graftrl's other tests never use, as a new user brings
them (issue 46): a Gemma2 with a SentencePiece-style Unigram tokenizer and no pad token, and a
GPT-NeoX with a byte-level BPE, a ChatML chat template and a config.json eos that differs from
its tokenizer's. Tiny (hidden 32, 2 layers), random, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The ChatML template (Qwen's, OpenHermes'): what the NeoX tokenizer ships with."""


def build_gemma2_neox_pair(root: Path) -> dict[str, Path]:
    """``{"gemma2": folder, "neox": folder}`` under ``root`` (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        PreTrainedTokenizerFast,
    )

    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    corpus += [f"Q: {a}+{b}\nA: the sum is \\boxed{{{a + b}}}" for a in range(10) for b in range(10)]
    # Gemma2: a fixed Unigram vocabulary (the trainer's would differ per process), no pad token.
    specials = ["<bos>", "<eos>", "<unk>"]
    words = ["▁Q:", "▁A:", "▁the", "▁sum", "▁is", "▁\\boxed{", "}", "+", "="]
    chars = sorted(set("".join(corpus).replace(" ", "")) | {"▁"})
    vocab = [(s, 0.0) for s in specials] + [(w, -2.0) for w in words]
    vocab += [(c, -5.0) for c in chars if c not in words]
    unigram = Tokenizer(models.Unigram(vocab, unk_id=specials.index("<unk>")))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    gemma_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=unigram, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    # NeoX: a byte-level BPE with ChatML's specials and template; config.json's eos is <|endoftext|>,
    # the tokenizer's <|im_end|>.
    chat_specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=chat_specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    neox_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
    )  # fmt: skip
    neox_tokenizer.chat_template = CHATML
    gemma_config = Gemma2Config(
        vocab_size=len(gemma_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        sliding_window=64, bos_token_id=gemma_tokenizer.bos_token_id,
        eos_token_id=gemma_tokenizer.eos_token_id, pad_token_id=None,
    )  # fmt: skip
    neox_config = GPTNeoXConfig(
        vocab_size=len(neox_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=256, rotary_pct=0.5,
        bos_token_id=neox_tokenizer.bos_token_id,
        eos_token_id=neox_tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )  # fmt: skip
    paths = {}
    for name, tokenizer, config, model_class in (
        ("gemma2", gemma_tokenizer, gemma_config, Gemma2ForCausalLM),
        ("neox", neox_tokenizer, neox_config, GPTNeoXForCausalLM),
    ):
        torch.manual_seed(1)
        model = model_class(config)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths
