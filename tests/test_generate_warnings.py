"""HF generate passes the attention mask; only transformers' dropped-mask false alarm is silenced."""

from __future__ import annotations

import contextlib
import logging

from graftrl.models import rollout
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, SamplingParams, dropped_mask_warning_silenced

MASK_WARNING = "We strongly recommend passing in an `attention_mask`"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _listen() -> tuple[logging.Logger, _Records]:
    logger = logging.getLogger("transformers.modeling_utils")
    records = _Records()
    logger.addHandler(records)
    logging.Logger.warning_once.cache_clear()  # transformers' warn-once memory: start afresh
    return logger, records


def test_only_the_dropped_mask_warning_is_silenced_and_only_inside_the_block():
    logger, records = _listen()
    try:
        with dropped_mask_warning_silenced():
            logger.warning(MASK_WARNING + " since your input_ids may be padded.")
            logger.warning("another transformers warning")
        logger.warning(MASK_WARNING + " since your input_ids may be padded.")
    finally:
        logger.removeHandler(records)
    assert records.messages == [
        "another transformers warning",
        MASK_WARNING + " since your input_ids may be padded.",
    ]


def test_generate_on_unpadded_prompts_prints_no_mask_warning(tiny_checkpoints, monkeypatch):
    policy = Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]))
    prompts = ["1+2", "3+4"]  # equal length: generate drops the all-ones mask
    assert len({len(ids) for ids in policy.encode_prompts(prompts)}) == 1
    params = SamplingParams(n=8, max_new_tokens=80)

    def mask_warnings() -> list[str]:
        logger, records = _listen()
        try:
            batch = HFRolloutEngine(64).generate(policy, prompts, params, seed=0)
        finally:
            logger.removeHandler(records)
        # The false alarm's condition: a finished row fed its pad token to an unmasked forward.
        assert any(batch.finished) and not all(batch.finished)
        return [m for m in records.messages if m.startswith(MASK_WARNING)]

    assert mask_warnings() == []
    monkeypatch.setattr(rollout, "dropped_mask_warning_silenced", contextlib.nullcontext)
    assert len(mask_warnings()) == 1  # without the filter the same call warns
