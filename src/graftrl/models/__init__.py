"""Models: a policy and what it does without a trainer.

Owns the Hugging Face policy wrapper (``policy``: load, score log-probs, save; ``model_loading``:
the folder checked, one-line errors; ``prompts``: templates and the context check), the rollout
engines (``rollout`` for transformers ``generate``, with ``behaviour``: the distribution it draws
from, ``shared_prefill``: each prompt's forward pass once, ``kv_cache``: one buffer per call,
``compiled_decode``: a compiled decode step; ``rollout_vllm`` for vLLM, ``vllm_weights`` the
weights it takes, ``vllm_process`` its process hygiene), answer extraction (``answers``), the verifier (``rewards``; its worker
processes: ``verify_worker``; ``worker_pool``: killable workers fed chunks with deadlines, the
function verifier's too), the memory estimate (``memory``) and a served peer (``served``: the client of an OpenAI-compatible
endpoint; ``served_groups``: its answers as store rows). May import ``core``,
``storage``, ``config`` and the foundation modules; never evaluation, training or reporting.
"""
