"""Prompts as a policy sees them: its template or chat template, their token ids, and the check
that each fits the model's context with the response budget (before anything is sampled)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from graftrl.errors import ModelError


def format_prompt(
    tokenizer: PreTrainedTokenizerBase, template: str, chat_template: bool, problem: str
) -> str:
    """The prompt string a policy sees for a problem: its template, or its tokenizer's chat template."""
    if chat_template:
        messages = [{"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return template.format(problem=problem)


_WARNED: set[tuple[str, str]] = set()
"""(policy, folder) pairs whose unused chat template was warned about in this process."""


def check_chat_template(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: bool,
    field: str = "policies[].chat_template",
    warn: Callable[[str], None] | None = None,
) -> None:
    """Refuse (one line, before any weights load) ``chat_template: true`` on a tokenizer that has
    no chat template (transformers would raise deep inside the first prompt); with ``warn``, one
    line, once per process, for a tokenizer whose chat template goes unused (a chat-tuned model
    prompted with a bare template can score far lower: 0.8% against 56% on a ChatML NeoX)."""
    where = getattr(tokenizer, "name_or_path", "") or "its folder"
    has_template = bool(getattr(tokenizer, "chat_template", None))
    flag = field.startswith("--")  # a command's flag, else a config field
    off = f"pass --no-{field[2:]}" if flag else f"set {field} to false"
    on = f"pass {field}" if flag else f"set {field} to true"
    if chat_template and not has_template:
        raise ModelError(
            f"policy {name!r}: {field} is true, but the tokenizer of {where} has no chat template; "
            f"{off} (prompts then use the policy's `template`), or save a chat_template "
            "with the tokenizer (tokenizer.chat_template = ...; save_pretrained)"
        )
    if not chat_template and has_template and warn is not None and (name, where) not in _WARNED:
        _WARNED.add((name, where))
        warn(
            f"policy {name!r}: the tokenizer of {where} has a chat template that goes unused ({field} "
            f"is false, so prompts use the policy's `template`); {on} if the model was tuned on chats"
        )


def encode_formatted(
    tokenizer: PreTrainedTokenizerBase, chat_template: bool, texts: Sequence[str]
) -> list[list[int]]:
    """Token ids of prompts already formatted (``format_prompt``)."""
    # A chat template already spells out its special tokens.
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=not chat_template)["input_ids"]]


def template_name(
    tokenizer: PreTrainedTokenizerBase, template: str, chat_template: bool, field: str = "policies[].template"
) -> str:
    """The template that renders a policy's prompts, for a message: the chat template of its
    tokenizer's folder, or ``field`` with its value."""
    if chat_template:
        return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'its tokenizer'}"
    return f"{field} {template!r}"


def check_prompt_lengths(
    name: str,
    context: int | None,
    format_prompt: Callable[[str], str],
    encode: Callable[[str], list[int]],
    problems: Sequence[tuple[str, str]],
    max_new_tokens: int,
    source: str = "data.train",
    limit: str = "rollout.max_new_tokens",
    template: str = "its template",
    suffix: str | None = None,
    suffix_field: str = "data.prompt_suffix",
) -> None:
    """Refuse (one line) when ``max_new_tokens`` or any prompt + it exceeds a model's context.

    problems: (prompt id, problem text with its suffix); ``format_prompt`` applies the policy's
    template, ``encode`` tokenizes the formatted prompt; ``limit`` names the setting of
    ``max_new_tokens`` in the message. A prompt that does not fit would fail deep inside the forward
    pass (an IndexError for absolute positions) or allocate its quadratic attention first; it is
    refused up front, naming the prompt ids, rather than silently skipped. The message shows the
    first such prompt as rendered (shortened) and names what made it: ``template`` (which template
    rendered it, ``template_name``) and ``suffix``, the text ``suffix_field`` appended to every
    problem (``training.sampling.with_suffix``), with the fix when the problem alone would fit.
    """
    if context is None:
        return
    check_response_budget(name, context, max_new_tokens, limit)
    budget = context - max_new_tokens
    # A prompt far longer than the budget is measured on a prefix: tokenizing megabytes to learn
    # that they do not fit would itself take long (a token rarely spans more than 64 characters).
    prefix = (budget + _MARGIN) * 64

    def measure(text: str) -> tuple[int, bool]:
        """(tokens, exact): a prompt far over the budget is counted on its prefix only."""
        if len(text) > prefix and (head := len(encode(text[:prefix]))) > budget + _MARGIN:
            return head - _MARGIN, False
        return len(encode(text)), True

    too_long: list[tuple[str, str]] = []
    for prompt_id, problem in problems:
        text = format_prompt(problem)
        # A token covers at least one byte (special tokens aside): short prompts need no tokenizing.
        if len(text.encode("utf-8")) + _MARGIN <= budget:
            continue
        length, exact = measure(text)
        if length > budget:
            too_long.append((prompt_id, problem))
            if len(too_long) == 1:
                first = (text, f"{length} tokens" if exact else f"over {length} tokens")
    if too_long:
        rendered, length = first
        ids = ", ".join(repr(i) for i, _ in too_long[:5]) + (" ..." if len(too_long) > 5 else "")
        made = [template]
        fix = f"remove or shorten them, or lower {limit}"
        problem = too_long[0][1]
        if suffix and problem.endswith(f" {suffix}"):
            alone, _ = measure(format_prompt(problem[: -len(suffix) - 1]))
            made.append(f"{suffix_field} {repr(suffix[:32]) + ('...' if len(suffix) > 32 else '')} appended")
            if alone <= budget:
                unset = (
                    f"pass {suffix_field} ''"
                    if suffix_field.startswith("--")
                    else f"set {suffix_field}: null"
                )
                made.append(f"{alone} tokens without it")
                fix = f"the suffix makes them too long: {unset} (or a shorter suffix), or lower {limit}"
        raise ModelError(
            f"{source}: {len(too_long)} prompt(s) do not fit the context of policy {name!r} ({context} "
            f"tokens) with {limit} {max_new_tokens} (ids {ids}); prompt {too_long[0][0]!r} is {length} as "
            f"rendered ({'; '.join(made)}): {_shorten(rendered, 60)}; {fix}"
        )


def _shorten(text: str, keep: int) -> str:
    """``text`` quoted on one line (newlines escaped); its first and last ``keep`` characters
    where it is longer."""
    if len(text) <= 2 * keep + 20:
        return repr(text)
    return f"{text[:keep]!r} ... {text[-keep:]!r} ({len(text):,} characters)"


def check_response_budget(
    name: str, context: int | None, max_new_tokens: int, limit: str = "rollout.max_new_tokens"
) -> None:
    """Refuse (one line) a response budget that leaves no room for a prompt in the context."""
    if context is not None and max_new_tokens >= context:
        raise ModelError(
            f"{limit} ({max_new_tokens}) leaves no room for a prompt in policy {name!r}, whose context "
            f"is {context} tokens (max_position_embeddings): lower {limit}"
        )


_MARGIN = 16
"""Tokens of slack for special tokens and a token cut at a prefix's end."""


def quiet_length_warning(tokenizer: PreTrainedTokenizerBase) -> None:
    """Silence transformers' "sequence length is longer than ..." warning: graftrl measures prompts
    against the context itself (``check_prompt_lengths``) and refuses those that do not fit."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def check_prompts_fit(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    context: int | None,
    template: str,
    chat_template: bool,
    problems: Sequence[tuple[str, str]],
    max_new_tokens: int,
    source: str,
    limit: str,
    suffix: str | None = None,
    suffix_field: str = "data.prompt_suffix",
    template_field: str = "policies[].template",
) -> None:
    """``check_prompt_lengths`` for a model folder's tokenizer and context, without its weights;
    ``suffix`` (named ``suffix_field``) and ``template_field`` as the message names them."""
    quiet_length_warning(tokenizer)
    check_prompt_lengths(
        name,
        context,
        lambda problem: format_prompt(tokenizer, template, chat_template, problem),
        lambda text: encode_formatted(tokenizer, chat_template, [text])[0],
        problems,
        max_new_tokens,
        source,
        limit,
        template_name(tokenizer, template, chat_template, template_field),
        suffix,
        suffix_field,
    )


def fit_hint(
    build: Callable[[str], str],
    hint: str,
    prompt_tokens: Callable[[str], int],
    budget: int | None,
) -> tuple[str, bool] | None:
    """The longest head of ``hint`` whose prompt fits ``budget`` tokens (the context less the
    response budget), as (prompt problem text, whether the hint was cut); None when not even a
    one-character hint fits.

    ``build`` makes the problem text of a hint (the method's template), ``prompt_tokens`` counts
    the tokens of a problem text as the policy formats and encodes it; ``budget`` None: the model's
    context is unknown, nothing is cut. The head is found by bisection on characters, so a hint of
    any tokenizer costs about log2(len(hint)) encodings, and a cut never splits a character.
    """
    if budget is None or prompt_tokens(build(hint)) <= budget:
        return build(hint), False
    low, high = (
        0,
        len(hint),
    )  # hint[:low] fits (low = 0 stands for "nothing tried fits"), hint[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        if prompt_tokens(build(hint[:middle])) <= budget:
            low = middle
        else:
            high = middle
    if low == 0:
        return None
    return build(hint[:low].rstrip()), True
