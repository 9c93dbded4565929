"""A KV cache for ``generate`` that writes each step into one buffer sized for the whole call.

transformers' ``DynamicLayer`` grows its keys and values with ``torch.cat`` at every decoding step:
each step copies the whole cache so far and allocates a new tensor (on CPU, fresh pages for every
allocation above glibc's mmap threshold, so page faults too). For the embedded models that copying
was most of a rollout. ``PreallocatedLayer`` allocates ``capacity`` positions once and writes each
step's keys and values in place; attention reads a view of the filled part. The forward calls, the
tensors' values and the random draws are those of the ``DynamicLayer`` path, so the samples are the
same bit for bit (``tests/test_rollout_cache.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor
from transformers import PreTrainedModel

try:  # transformers >= 4.56 (the layered cache)
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - older transformers: generate's own cache
    DynamicCache = DynamicLayer = None  # type: ignore[assignment,misc]


class PreallocatedLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """A full-attention cache layer whose keys/values [B, H, L, D] are views of [B, H, capacity, D]
    buffers (grown by doubling if a call ever writes past ``capacity``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._key_buffer: Tensor | None = None
        self._value_buffer: Tensor | None = None
        self._length = 0

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if self._key_buffer is None or self.keys is not self._key_view:
            # First call (or the layer was cropped / reordered by other code): the base class
            # initialises its own state and concatenates; the buffers start from its result.
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self._adopt(keys, values)
            return self.keys, self.values
        end = self._length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._adopt(self.keys, self.values, end)
        self._key_buffer[:, :, self._length : end].copy_(key_states)
        self._value_buffer[:, :, self._length : end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _adopt(self, keys: Tensor, values: Tensor, needed: int = 0) -> None:
        """New buffers holding ``keys``/``values`` with room for max(capacity, 2 x needed) positions."""
        length = keys.shape[-2]
        size = max(self.capacity, length, 2 * needed if needed else 0)
        self._key_buffer = keys.new_empty((*keys.shape[:-2], size, keys.shape[-1]))
        self._value_buffer = values.new_empty((*values.shape[:-2], size, values.shape[-1]))
        self._key_buffer[:, :, :length].copy_(keys)
        self._value_buffer[:, :, :length].copy_(values)
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self._length = length
        self.keys = self._key_view = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which ``generate`` and the forward take a cache (``cache`` since
    transformers 5.2x, ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def dynamic_cache(model: PreTrainedModel) -> Any | None:
    """An empty ``DynamicCache`` as ``generate`` would make for ``model``, or None for models whose
    cache ``generate`` builds another way (encoder-decoder, non-cache or custom-cache models)."""
    if DynamicCache is None or not getattr(model, "_supports_default_dynamic_cache", lambda: False)():
        return None
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    try:
        return DynamicCache(config=model.config.get_text_config(decoder=True))
    except (TypeError, ValueError, AttributeError):
        return None


def preallocated_cache(model: PreTrainedModel, capacity: int) -> Any | None:
    """A ``DynamicCache`` for ``model`` whose full-attention layers are ``PreallocatedLayer``s of
    ``capacity`` positions (prompt width + max new tokens), or None when the model's cache is not
    built of plain ``DynamicLayer``s (sliding-window, linear-attention or non-cache models:
    ``generate`` then makes its own)."""
    cache = dynamic_cache(model)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in layers]
    return cache


__all__ = ["PreallocatedLayer", "cache_argument", "dynamic_cache", "preallocated_cache"]
