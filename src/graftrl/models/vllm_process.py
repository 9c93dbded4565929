"""Process hygiene around an in-process vLLM engine (``graftrl.models.rollout_vllm``).

In-process, vLLM shares the trainer's process: its global RNGs, environment, ``torch`` thread
setting, loggers and ``torch.distributed`` group. These context managers let an engine start,
sample and shut down while leaving that state as the trainer had it. They import vLLM lazily.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the global RNG states (``random``, numpy, torch CPU and CUDA) after a block.

    In-process, vLLM shares the trainer's global generators: it seeds them at start-up, and its
    sampler draws from them on every step even when all requests carry their own seeds.
    """
    import numpy as np

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def in_process_vllm() -> Iterator[None]:
    """Build the next engine in this process, and leave the process as it was.

    - vLLM freezes its environment variables once an engine has started (``enable_envs_cache``),
      so the cache is dropped first, or a second engine would reuse the first one's values.
    - vLLM seeds the global RNGs with the engine seed: the trainer's streams are put back.
    - The CPU worker replaces ``torch.set_num_threads`` with a no-op (it pins threads in its own
      process); in the trainer's process that would silently drop the trainer's own settings.
    - With no tokenizer loaded (prompts arrive as ids) vLLM's chat-template warm-up logs a
      traceback on every start; that warning is muted.
    """
    import vllm.envs as envs

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    set_num_threads = torch.set_num_threads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    envs.disable_envs_cache()
    try:
        with preserved_rng(), quiet("vllm.renderers.base"):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Raise vLLM loggers to ERROR for a block (routine messages repeated at every call)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def keep_distributed_state() -> Iterator[None]:
    """Let one engine shut down without tearing down the state the other open engines use.

    ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory``, which destroys vLLM's
    process-global model-parallel groups and the ``torch.distributed`` group that all in-process
    engines share; the next step of any other engine would fail. Only its memory part runs here.
    """
    import vllm.v1.engine.core as core

    full = core.cleanup_dist_env_and_memory

    def release_memory(*args: object, **kwargs: object) -> None:
        gc.unfreeze()
        gc.collect()

    core.cleanup_dist_env_and_memory = release_memory
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = full
