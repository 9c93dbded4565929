"""A trainable policy: any Hugging Face causal LM and its tokenizer, loaded by path.

The policy owns its tokenization: prompts go through its own template, peer response texts are
re-tokenized with its own tokenizer (algorithm.md §2.2), and every log-prob it reports is on those ids.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from graftrl.core.logprobs import chunked_token_logprobs
from graftrl.errors import ModelError, UserError
from graftrl.models.model_loading import (
    check_finite_weights,
    context_of,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    zero_dropout,
)
from graftrl.models.prompts import (
    check_chat_template,
    check_prompt_lengths,
    encode_formatted,
    format_prompt,
    quiet_length_warning,
    template_name,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config fields that rescale or soft-cap the logits after the LM head (Gemma 2/3, Cohere, Granite,
# ...): the chunked log-prob, which applies the bare LM head, is not exact for those models.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def token_micro_batches(shapes: Sequence[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Group rows (in the given order) so each group's padded size stays within ``max_tokens``.

    shapes: (prompt length, response length) per row, best sorted by total length. A group pads
    prompts to its longest prompt and responses to its longest response (``Policy.pad``), so its
    size is rows x (max prompt + max response). Rows are packed greedily in order; a row alone
    over the budget forms its own group. Returns lists of positions into ``shapes``.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    widest_prompt = widest_response = 0
    for position, (prompt, response) in enumerate(shapes):
        prompt_width, response_width = max(widest_prompt, prompt), max(widest_response, max(response, 1))
        if current and (len(current) + 1) * (prompt_width + response_width) > max_tokens:
            groups.append(current)
            current, prompt_width, response_width = [], prompt, max(response, 1)
        current.append(position)
        widest_prompt, widest_response = prompt_width, response_width
    if current:
        groups.append(current)
    return groups


@dataclass
class PaddedBatch:
    """Left-padded prompts followed by right-padded responses, the layout generation uses.

    input_ids, attention_mask, position_ids: [B, Lp + Lr]; response_mask: [B, Lr] marks real
    response tokens. The logits predicting response token j sit at column Lp - 1 + j.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    prompt_width: int


class Policy:
    """Model + tokenizer + prompt template + optimizer; the trainer's unit of learning."""

    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        template: str = "{problem}",
        chat_template: bool = False,
        temperature: float = 1.0,
        micro_batch_size: int = 64,
        compute_dtype: torch.dtype | None = None,
        *,
        micro_batch_tokens: int | None = None,
        logprob_chunk_tokens: int | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.chat_template = chat_template
        self.temperature = temperature
        """Sampling temperature; training log-probs use the same logits / T (as verl does)."""
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        """Padded-token budget of a micro-batch (None: ``micro_batch_size`` rows each)."""
        self.logprob_chunk_tokens = logprob_chunk_tokens
        """Response positions per LM-head chunk in ``response_logprobs`` (None: all at once)."""
        self.compute_dtype = compute_dtype
        """Autocast dtype for forward passes (None: the parameters' dtype)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._head = _plain_lm_head(model)
        self._head_checked = False
        if tokenizer.eos_token_id is None:
            where = getattr(tokenizer, "name_or_path", "") or "its folder"
            raise ModelError(
                f"policy {name!r}: the tokenizer of {where} has no eos_token (a response could never "
                "end); set `eos_token` in its tokenizer_config.json, or tokenizer.eos_token = ... and "
                "save_pretrained"
            )
        self._lent_pad = tokenizer.pad_token_id is None
        """The tokenizer has no pad token: graftrl pads with its eos, and saves it without one."""
        if self._lent_pad:
            tokenizer.pad_token = tokenizer.eos_token

    @classmethod
    def from_pretrained(
        cls,
        name: str,
        path: str,
        *,
        dtype: str = "float32",
        device: str = "auto",
        param_dtype: str = "float32",
        attn_implementation: str | None = None,
        disable_dropout: bool = True,
        **kwargs,
    ) -> Policy:
        """Load model and tokenizer from a local folder (or hub id when online).

        ``dtype`` is the compute dtype: with bfloat16/float16 the forward passes run under autocast
        while the parameters and AdamW state stay in ``param_dtype`` (float32 master weights, as
        verl's FSDP mixed precision) — in pure bf16 an update of lr 1e-6 rounds away.
        ``attn_implementation`` goes to transformers (``sdpa``, ``eager``, ``flash_attention_2``, ...);
        None keeps its default for the model. ``disable_dropout`` zeroes the model's dropout
        (``zero_dropout``), so the trainer's log-probs are the sampler's.
        """
        tokenizer = load_tokenizer(name, path)
        check_chat_template(name, tokenizer, kwargs.get("chat_template", False))  # before the weights
        model = load_causal_lm(name, path, _DTYPES[param_dtype], attn_implementation)
        if disable_dropout:
            zero_dropout(model)
        check_finite_weights(name, path, model)
        if dtype != param_dtype:
            kwargs.setdefault("compute_dtype", _DTYPES[dtype])
        model.to(resolve_device(device))
        model.config.use_cache = True
        return cls(name, model, tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int | None:
        """Positions the model can attend over (``max_position_embeddings``/``n_positions``), if known."""
        return context_of(self.model.config)

    def check_prompt_lengths(
        self,
        problems: Sequence[tuple[str, str]],
        max_new_tokens: int,
        source: str = "data.train",
        limit: str = "rollout.max_new_tokens",
        suffix: str | None = None,
    ) -> None:
        """Refuse (one line) when ``max_new_tokens`` or any prompt + it exceeds the model's context
        (``check_prompt_lengths``, with this policy's template and tokenizer; ``suffix``: the
        ``data.prompt_suffix`` the problems carry, which the message names)."""
        # This check replaces transformers' own "sequence length is longer than ..." warning.
        quiet_length_warning(self.tokenizer)
        check_prompt_lengths(
            self.name,
            self.context_length,
            self.format_prompt,
            lambda text: self.encode_formatted([text])[0],
            problems,
            max_new_tokens,
            source,
            limit,
            template_name(self.tokenizer, self.template, self.chat_template),
            suffix,
        )

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def configure_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in backward (HF's non-reentrant checkpointing).

        It acts only in training mode; generation and scoring run in eval mode with the KV cache.
        """
        model = self.model
        if not model.supports_gradient_checkpointing:
            raise UserError(
                f"train.gradient_checkpointing: {type(model).__name__} ({self.name}) does not support it; "
                "set train.gradient_checkpointing: false"
            )
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = True  # for generate; training forwards pass use_cache=False

    @property
    def chunks_logprobs(self) -> bool:
        """Whether ``response_logprobs`` takes the chunked path (configured and exact for this model)."""
        return self.logprob_chunk_tokens is not None and self._head is not None

    @torch.no_grad()
    def _check_head(self, last_hidden: Tensor, last_logits: Tensor) -> bool:
        """Once per policy: are the model's logits the bare LM head of its last hidden state?

        last_hidden: [B, H]; last_logits: [B, V], the model's own. If not (a logit transform no
        config field names), the policy keeps the unchunked path from now on.
        """
        self._head_checked = True
        assert self._head is not None
        ours = torch.nn.functional.linear(last_hidden, self._head.weight, self._head.bias).float()
        tolerance = 1e-4 if ours.dtype == last_hidden.dtype == torch.float32 else 2e-2
        if torch.allclose(ours, last_logits.float(), rtol=tolerance, atol=tolerance):
            return True
        warnings.warn(
            f"policy {self.name!r}: {type(self.model).__name__}'s logits are not its LM head applied to "
            "its last hidden state; train.logprob_chunk_tokens is ignored (unchunked log-probs)",
            stacklevel=3,
        )
        self._head = None
        return False

    # ----- tokenization -------------------------------------------------------------------
    def format_prompt(self, problem: str) -> str:
        """The prompt string this policy sees for a problem (its own template or chat template)."""
        return format_prompt(self.tokenizer, self.template, self.chat_template, problem)

    def encode_prompts(self, problems: Sequence[str]) -> list[list[int]]:
        return self.encode_formatted([self.format_prompt(p) for p in problems])

    def encode_formatted(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of prompts already formatted (``format_prompt``)."""
        return encode_formatted(self.tokenizer, self.chat_template, texts)

    def encode_response(self, text: str, finished: bool) -> list[int]:
        """Re-tokenize a response string (possibly another model's) on this policy's vocabulary.

        A response that ended with EOS gets this policy's EOS appended, so the receiver also
        learns where to stop; a length-truncated one does not.
        """
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return [*ids, self.eos_token_id] if finished else ids

    def decode_response(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_responses(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """``decode_response`` of every row, in one tokenizer call."""
        return self.tokenizer.batch_decode([list(ids) for ids in rows], skip_special_tokens=True)

    # ----- batching -----------------------------------------------------------------------
    def pad(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> PaddedBatch:
        pad_id = int(self.tokenizer.pad_token_id)
        prompt_width = max(len(p) for p in prompts)
        response_width = max(1, max(len(r) for r in responses))
        rows, masks, response_rows, response_masks = [], [], [], []
        for prompt, response in zip(prompts, responses, strict=True):
            left = prompt_width - len(prompt)
            right = response_width - len(response)
            rows.append([pad_id] * left + list(prompt) + list(response) + [pad_id] * right)
            masks.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
            response_rows.append(list(response) + [pad_id] * right)
            response_masks.append([1] * len(response) + [0] * right)
        device = self.device
        attention_mask = torch.tensor(masks, device=device)
        # Absolute-position models (GPT-2) need positions that skip the left padding.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return PaddedBatch(
            input_ids=torch.tensor(rows, device=device),
            attention_mask=attention_mask,
            position_ids=position_ids,
            response_ids=torch.tensor(response_rows, device=device),
            response_mask=torch.tensor(response_masks, device=device, dtype=torch.bool),
            prompt_width=prompt_width,
        )

    def response_logprobs(self, batch: PaddedBatch) -> Tensor:
        """Per-token log-probs of the response tokens under logits / temperature. Returns [B, Lr]."""
        width = batch.response_ids.shape[1]
        inputs = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "use_cache": False,
        }
        columns = slice(batch.prompt_width - 1, batch.prompt_width - 1 + width)
        with self.autocast():
            if self.chunks_logprobs:
                # The model's own forward (so wrappers such as FSDP see a normal call) with the LM
                # head on one column only, then the head a chunk of positions at a time on its
                # input, the last hidden state: no [B, Lr, V] logits, forward or backward.
                out = self.model(**inputs, logits_to_keep=1, output_hidden_states=True)
                hidden = out.hidden_states[-1]  # [B, Lp + Lr, H]
                if not self._head_checked and not self._check_head(hidden[:, -1], out.logits[:, -1]):
                    return self.response_logprobs(batch)  # the unchunked path
                head = self._head
                assert head is not None and self.logprob_chunk_tokens is not None
                return chunked_token_logprobs(
                    hidden[:, columns],
                    head.weight,
                    head.bias,
                    batch.response_ids,
                    self.temperature,
                    self.logprob_chunk_tokens,
                )
            if self._keeps_logits:
                # The LM head runs only on the width + 1 last columns (those predicting response
                # tokens, and the final one): no vocab-sized projection or softmax on the prompt.
                logits = self.model(**inputs, logits_to_keep=width + 1).logits[:, :width]
            else:  # a model whose forward has no `logits_to_keep`
                logits = self.model(**inputs).logits[:, columns]
        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)

    def micro_batches(self, count: int) -> Iterator[slice]:
        for start in range(0, count, self.micro_batch_size):
            yield slice(start, min(start + self.micro_batch_size, count))

    def micro_batch_groups(self, shapes: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Micro-batches of rows given their (prompt, response) lengths, as positions into ``shapes``:
        ``micro_batch_tokens`` padded tokens each when set, else ``micro_batch_size`` rows."""
        if self.micro_batch_tokens is not None:
            return token_micro_batches(shapes, self.micro_batch_tokens)
        positions = list(range(len(shapes)))
        return [positions[part] for part in self.micro_batches(len(shapes))]

    @torch.no_grad()
    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[Tensor]:
        """Per-token log-probs (current weights, no grad) of each response, in its own length."""
        # Sort by length so micro-batches carry little padding.
        order = sorted(range(len(responses)), key=lambda i: len(prompts[i]) + len(responses[i]))
        by_index: dict[int, Tensor] = {}
        shapes = [(len(prompts[i]), len(responses[i])) for i in order]
        with self.eval_mode():
            for group in self.micro_batch_groups(shapes):
                idx = [order[k] for k in group]
                batch = self.pad([prompts[i] for i in idx], [responses[i] for i in idx])
                logprobs = self.response_logprobs(batch).cpu()
                for row, i in enumerate(idx):
                    by_index[i] = logprobs[row, : len(responses[i])]
        return [by_index[i] for i in range(len(responses))]

    def frozen_copy(self) -> Policy:
        """A gradient-free copy of the current weights (a reference policy for KL penalties)."""
        import copy

        model = copy.deepcopy(self.model).eval()
        model.requires_grad_(False)
        copy_policy = Policy(
            f"{self.name}-reference",
            model,
            self.tokenizer,
            self.template,
            self.chat_template,
            self.temperature,
            self.micro_batch_size,
            self.compute_dtype,
            micro_batch_tokens=self.micro_batch_tokens,
            logprob_chunk_tokens=self.logprob_chunk_tokens,
        )
        copy_policy._lent_pad = self._lent_pad
        return copy_policy

    # ----- checkpoint ---------------------------------------------------------------------
    def save(self, directory: str) -> None:
        self.model.save_pretrained(directory)
        self.save_tokenizer(directory)

    def save_tokenizer(self, directory: str) -> None:
        """The tokenizer as it was loaded: the eos that pads a tokenizer without a pad token is
        not written into the folder (every load lends it again), so a checkpoint's tokenizer files
        are the starting folder's."""
        if not self._lent_pad:
            self.tokenizer.save_pretrained(directory)
            return
        self.tokenizer.pad_token = None
        try:
            self.tokenizer.save_pretrained(directory)
        finally:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for forward passes (a no-op without a compute dtype)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)


def _plain_lm_head(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The LM head when the logits are ``head(last hidden state)`` with nothing after it, else None.

    True of the usual decoder-only causal LMs (Llama, Qwen, Mistral, GPT-2, OLMo, SmolLM3, ...).
    None when the head is not a Linear or the config rescales / soft-caps the logits; the first
    chunked call also checks the model's own last-column logits against it (``_check_head``).
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    configs = [model.config]
    text_config = getattr(model.config, "get_text_config", None)
    if callable(text_config):
        configs.append(text_config())
    for config in configs:
        if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
    return head
