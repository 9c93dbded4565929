"""Tokenizers and tiny models for the embedded demo task.

Two heterogeneous specs (different architecture *and* tokenizer), about 1M parameters each:

- ``llama-char``: Llama (RoPE, RMSNorm, SwiGLU) with a character-level tokenizer.
- ``gpt2-bpe``: GPT-2 (learned positions, LayerNorm, GELU) with a byte-level BPE tokenizer
  (digits split individually, so ``\\boxed{`` is merged but numbers are not).

Token conventions (both tokenizers): special tokens ``<bos>``, ``<eos>``, ``<pad>`` (pad != eos).
Encoding adds *no* special tokens: a training/scoring sequence is
``encode(template.format(problem=...)) + encode(response) + [eos_id]``, prompt and response
tokenized separately. ``<bos>`` is registered but not used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

__all__ = [
    "BOS",
    "CHAR_ALPHABET",
    "EOS",
    "MODEL_SPECS",
    "PAD",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_model",
    "build_spec",
    "count_parameters",
]

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
_SPECIALS = [PAD, BOS, EOS, UNK]

#: Characters of the char-level vocabulary: printable ASCII plus newline and tab.
CHAR_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def _wrap(tok: Tokenizer, model_max_length: int = 512) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.padding_side = "right"
    return fast


def build_char_tokenizer(alphabet: str = CHAR_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``alphabet`` (one token per character)."""
    vocab = {t: i for i, t in enumerate(_SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def build_bpe_tokenizer(corpus_texts: Iterable[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus_texts`` (digits kept as single tokens).

    With the 256-byte alphabet and 4 special tokens, ``vocab_size=300`` leaves ~40 merges,
    spent on the frequent non-digit text (``boxed``, template words).
    """
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus_texts), trainer=trainer)
    return _wrap(tok)


def build_model(
    arch: Literal["llama", "gpt2"], tokenizer: PreTrainedTokenizerFast, **size: Any
) -> PreTrainedModel:
    """A randomly initialised causal LM of ``arch`` sized by ``size`` for ``tokenizer``.

    Keyword sizes: ``hidden`` (default 128), ``layers`` (4), ``heads`` (4), ``intermediate``
    (Llama MLP width, default 3 * hidden), ``max_positions`` (64), ``seed`` (0).
    GPT-2 dropouts are 0 (needed for RL: the old and current policies must match).
    """
    import torch

    hidden = int(size.get("hidden", 128))
    layers = int(size.get("layers", 4))
    heads = int(size.get("heads", 4))
    max_pos = int(size.get("max_positions", 64))
    common = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    if arch == "llama":
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=int(size.get("intermediate", 3 * hidden)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=max_pos,
            **common,
        )
        cls: type[PreTrainedModel] = LlamaForCausalLM
    elif arch == "gpt2":
        config = GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=max_pos,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(int(size.get("seed", 0)))
    model = cls(config)
    # The warm-start's `labels=` loss: transformers infers the loss from the class name, which for
    # GPT2LMHeadModel has no "ForCausalLM", so it warns and falls back to ForCausalLMLoss. Naming
    # that same loss here changes nothing but the warning.
    model.loss_type = "ForCausalLM"
    gc = model.generation_config
    gc.eos_token_id = tokenizer.eos_token_id
    gc.pad_token_id = tokenizer.pad_token_id
    gc.bos_token_id = tokenizer.bos_token_id
    return model


def count_parameters(model: PreTrainedModel) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


#: The two embedded model specs. ``template`` is the prompt template (``{problem}`` is the
#: bare problem text); ``size`` goes to :func:`build_model`; ``lr`` is the warm-start rate.
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "llama-char": {
        "arch": "llama",
        "tokenizer": "char",
        "template": "{problem}=",
        "size": {"hidden": 128, "layers": 4, "heads": 4, "intermediate": 384},
        "lr": 3e-3,
    },
    "gpt2-bpe": {
        "arch": "gpt2",
        "tokenizer": "bpe",
        "template": "{problem}=",
        "size": {"hidden": 128, "layers": 4, "heads": 4},
        "lr": 2e-3,
        "bpe_vocab_size": 266,
    },
}


def build_spec(
    spec_name: str, corpus_texts: Iterable[str] = (), seed: int = 0, max_positions: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Tokenizer and fresh model for ``MODEL_SPECS[spec_name]`` (BPE trains on ``corpus_texts``).

    ``max_positions`` (the task's sequence limit) overrides the spec's size when given.
    """
    spec = MODEL_SPECS[spec_name]
    if spec["tokenizer"] == "char":
        tok = build_char_tokenizer()
    else:
        tok = build_bpe_tokenizer(corpus_texts, vocab_size=int(spec.get("bpe_vocab_size", 300)))
    size = dict(spec["size"]) if max_positions is None else {**spec["size"], "max_positions": max_positions}
    model = build_model(spec["arch"], tok, seed=seed, **size)
    return model, tok
