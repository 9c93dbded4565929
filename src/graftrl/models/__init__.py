"""Models: a policy and what it does without a trainer.

Owns the Hugging Face policy wrapper (``policy``: load, score log-probs, save), the rollout
engines (``rollout`` for transformers ``generate``, ``rollout_vllm`` for vLLM, ``vllm_process``
its process hygiene), answer extraction (``answers``), the verifier (``rewards``; its worker
processes: ``verify_worker``) and the memory estimate (``memory``). May import ``core``,
``storage``, ``config`` and the foundation modules; never evaluation, training or reporting.
"""
