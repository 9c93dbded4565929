"""Measure whether the embedded models give GRAFT something to do.

For a batch of RL prompts, sample ``n`` responses per prompt from each model, score them with the
0/1 reward, and report per model (as receiver R, with the other as source S):

- pass rate per family and all-fail fraction;
- complementarity: among R's all-fail prompts, the share where S's group is mixed
  (``1 <= k_S < n``, GRAFT's candidate set) and where S solves it at least once;
- for S's responses on GRAFT's candidates: the compatibility score
  ``s = exp(lbar_R - lbar_S)`` (mean per-token log-prob, terminal EOS excluded on both sides;
  ``lbar_S`` on S's generated token ids, ``lbar_R`` on R's tokenization of the text after R's
  template) and the share with ``s > delta``.

Run ``python -m graftrl.embedded.probe --cache-dir DIR`` (warm-starts the models if needed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import Problem, make_problems, reward
from graftrl.embedded.warmstart import REPORT_NAME, sample_responses

__all__ = ["mean_logprobs", "probe_complementarity"]


def mean_logprobs(
    model: Any, prompts: Sequence[list[int]], responses: Sequence[list[int]], batch_size: int = 256
) -> list[float]:
    """Mean per-token log-prob of each response (token ids, no EOS) after its prompt ids.

    Empty responses give ``nan``.
    """
    import torch

    pad = int(model.config.pad_token_id or 0)
    out: list[float] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            ps, rs = prompts[i : i + batch_size], responses[i : i + batch_size]
            seqs = [p + r for p, r in zip(ps, rs, strict=True)]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, : len(s)] = 1
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for j, (p, r) in enumerate(zip(ps, rs, strict=True)):
                if not r:
                    out.append(math.nan)
                    continue
                pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)
                out.append(float(logp[j, pos, torch.tensor(r)].mean()))
    return out


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"p10": q(0.1), "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "p90": q(0.9),
            "mean": sum(xs) / len(xs)}


def probe_complementarity(
    paths: Mapping[str, str | Path],
    problems: Sequence[Problem],
    n: int = 8,
    temperature: float = 1.0,
    delta: float = 0.8,
    seed: int = 0,
    max_new_tokens: int = 32,
) -> dict[str, Any]:
    """Sample ``n`` responses per problem from each of the two models at ``paths`` and report
    pass rates, all-fail fractions, complementarity and compatibility (see module docstring).

    ``paths`` maps spec name (a key of ``MODEL_SPECS``, for the template) to a saved folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(paths) != 2:
        raise ValueError("probe_complementarity needs exactly two models")
    torch.manual_seed(seed)
    names = list(paths)
    models = {k: AutoModelForCausalLM.from_pretrained(str(paths[k])) for k in names}
    toks = {k: AutoTokenizer.from_pretrained(str(paths[k])) for k in names}
    templates = {k: MODEL_SPECS[k]["template"] for k in names}
    texts: dict[str, list[list[str]]] = {}
    ids: dict[str, list[list[list[int]]]] = {}
    rewards: dict[str, list[list[float]]] = {}
    for k in names:
        texts[k], ids[k] = sample_responses(
            models[k], toks[k], templates[k], problems, n=n, temperature=temperature,
            max_new_tokens=max_new_tokens, return_ids=True,
        )
        rewards[k] = [[reward(t, p.answer) for t in ts] for p, ts in zip(problems, texts[k], strict=True)]
    # the source's own mean log-prob on its generated ids (EOS excluded)
    lbar_src: dict[str, list[list[float]]] = {}
    for k in names:
        prompt_ids = [toks[k].encode(templates[k].format(problem=p.problem), add_special_tokens=False)
                      for p in problems]
        flat_p = [prompt_ids[i] for i in range(len(problems)) for _ in range(n)]
        flat_r = [r for group in ids[k] for r in group]
        flat = mean_logprobs(models[k], flat_p, flat_r)
        lbar_src[k] = [flat[i * n : (i + 1) * n] for i in range(len(problems))]

    report: dict[str, Any] = {"n": n, "temperature": temperature, "delta": delta, "prompts": len(problems)}
    for r_name, s_name in ((names[0], names[1]), (names[1], names[0])):
        k_r = [int(sum(x)) for x in rewards[r_name]]
        k_s = [int(sum(x)) for x in rewards[s_name]]
        fams = sorted({p.family for p in problems})
        per_family = {}
        for f in fams:
            idx = [i for i, p in enumerate(problems) if p.family == f]
            per_family[f] = {
                "pass_rate": sum(k_r[i] for i in idx) / (n * len(idx)),
                "all_fail": sum(k_r[i] == 0 for i in idx) / len(idx),
                "all_pass": sum(k_r[i] == n for i in idx) / len(idx),
            }
        fail = [i for i in range(len(problems)) if k_r[i] == 0]
        cand = [i for i in fail if 1 <= k_s[i] < n]
        solved = [i for i in fail if k_s[i] >= 1]
        # receiver's mean log-prob on its own tokenization of the source's texts
        tok_r, tmpl_r = toks[r_name], templates[r_name]
        flat_p, flat_r, flat_src, flat_ok = [], [], [], []
        for i in cand:
            pr = tok_r.encode(tmpl_r.format(problem=problems[i].problem), add_special_tokens=False)
            for j in range(n):
                flat_p.append(pr)
                flat_r.append(tok_r.encode(texts[s_name][i][j], add_special_tokens=False))
                flat_src.append(lbar_src[s_name][i][j])
                flat_ok.append(rewards[s_name][i][j])
        lbar_r = mean_logprobs(models[r_name], flat_p, flat_r) if flat_p else []
        s_all, s_ok, s_bad = [], [], []
        for lr_, ls_, ok in zip(lbar_r, flat_src, flat_ok, strict=True):
            s = 0.0 if (math.isnan(lr_) or math.isnan(ls_)) else math.exp(lr_ - ls_)
            s_all.append(s)
            (s_ok if ok else s_bad).append(s)
        share = lambda xs: (sum(x > delta for x in xs) / len(xs)) if xs else float("nan")  # noqa: E731
        report[f"{s_name}->{r_name}"] = {
            "receiver": r_name,
            "source": s_name,
            "receiver_pass_rate": sum(k_r) / (n * len(problems)),
            "receiver_per_family": per_family,
            "receiver_all_fail": len(fail) / len(problems),
            "candidates": len(cand),
            "complementarity_mixed": len(cand) / len(fail) if fail else float("nan"),
            "complementarity_solved": len(solved) / len(fail) if fail else float("nan"),
            "peer_responses": len(s_all),
            "peer_correct_share": (sum(flat_ok) / len(flat_ok)) if flat_ok else float("nan"),
            "s_gt_delta": share(s_all),
            "s_gt_delta_correct": share(s_ok),
            "s_gt_delta_incorrect": share(s_bad),
            "s_quantiles": _quantiles(s_all),
            "s_quantiles_correct": _quantiles(s_ok),
        }
    return report


def _main() -> None:
    import argparse

    from graftrl.embedded.warmstart import prepare_embedded_models

    ap = argparse.ArgumentParser(description="Probe complementarity and compatibility of the embedded models.")
    ap.add_argument("--cache-dir", default="/tmp/graftrl-embedded")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--problem-seed", type=int, default=12345)
    args = ap.parse_args()
    paths = prepare_embedded_models(args.cache_dir, quick=args.quick, seed=args.seed)
    problems = make_problems(None, args.prompts, seed=args.problem_seed)
    rep = probe_complementarity(paths, problems, seed=args.seed)
    rep["warmstart"] = {
        k: {f: json.loads((Path(p) / REPORT_NAME).read_text())[f]
            for f in ("steps", "train_seconds", "seconds", "accuracy", "reached_target")}
        for k, p in paths.items()
    }
    print(json.dumps(rep, indent=2, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    _main()
