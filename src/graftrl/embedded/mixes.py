"""The embedded pairs' warm-start recipes: each model's family mix per task, the sweeps' knobs that
move them (skill overlap, mastery), and the stop settings.

Data and pure functions only: :mod:`graftrl.embedded.warmstart` trains on them, ``graftrl sweep``
and the mastery experiments (``experiments.sweep``, ``experiments.mastery``) pick points with them, and
each mix enters the fingerprint of the models it gives.
"""

from __future__ import annotations

from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import REGROUPING, get_task

__all__ = [
    "EMBEDDED_MIXES",
    "MASTERY_DEFICIT_SHARE",
    "MASTERY_DRILL_SHARE",
    "MASTERY_WARMSTART",
    "TASK_MIXES",
    "TASK_WARMSTART_SETTINGS",
    "WARMSTART_SETTINGS",
    "exposure_mixes",
    "mastery_mixes",
    "overlap_mixes",
]

#: Family mix per task and spec: each model is strong on some families and weak-but-not-zero on
#: the others. ``EMBEDDED_MIXES`` is the ``arith`` task's (its historical name).
TASK_MIXES: dict[str, dict[str, dict[str, float]]] = {
    "arith": {
        "llama-char": {"add": 0.9, "sub": 0.1},
        "gpt2-bpe": {"add": 0.1, "sub": 0.9},
    },
    # Both models learn the format and the no-regrouping steps; each sees few examples of the
    # other's regrouping step (carry vs borrow), its complementary deficit. The GPT-2 generalises
    # to carries from fewer examples than the Llama to borrows, hence the smaller share
    # (docs/task_design.md, candidates 1-2).
    "worked": {
        "llama-char": {"add": 0.3, "add_carry": 0.45, "sub": 0.225, "sub_borrow": 0.025},
        "gpt2-bpe": {"add": 0.238, "add_carry": 0.012, "sub": 0.3, "sub_borrow": 0.45},
    },
    # Both models learn the skeleton and `lin`; each sees few examples of the other's step (the
    # modulo for the GPT-2, the conditional for the Llama) (docs/task_design.md, "The code task").
    "code": {
        "llama-char": {"lin": 0.35, "mod": 0.635, "cond": 0.015},
        "gpt2-bpe": {"lin": 0.35, "mod": 0.03, "cond": 0.62},
    },
}
EMBEDDED_MIXES = TASK_MIXES["arith"]


def overlap_mixes(task: str, overlap: float) -> dict[str, dict[str, float]]:
    """The task's warm-start mixes at skill overlap ``overlap`` in [0, 1] (``graftrl sweep``'s knob).

    The first model (the Llama) keeps its mix; the second's (the GPT-2's) moves linearly towards
    the first's: ``(1 - overlap) * own + overlap * first``. At 0 the pair has the task's
    complementary deficits; at 1 both were taught the same families, so they lack the same step
    and a peer rarely solves the receiver's all-fail prompts.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"skill overlap must be in [0, 1], got {overlap}")
    first, second = (dict(TASK_MIXES[task][name]) for name in MODEL_SPECS)
    families = sorted(set(first) | set(second))
    moved = {f: round((1 - overlap) * second.get(f, 0.0) + overlap * first.get(f, 0.0), 6) for f in families}
    names = list(MODEL_SPECS)
    # overlap 0 is the task's own pair, mix for mix, so its cached models (fingerprints) are reused
    return {names[0]: first, names[1]: second if overlap == 0 else {f: w for f, w in moved.items() if w > 0}}


#: Share of a mastery pair's warm-start mix given to the fact drills (each drill half of it).
MASTERY_DRILL_SHARE = 0.3

#: Share of a drilled model's mix given to its deficit (the peer's regrouping family): enough that
#: the receiver has seen the step's words and scores its peer's solutions near the gate's δ, too
#: little to learn the step (docs/task_design.md, "The mastery knob").
MASTERY_DEFICIT_SHARE = 0.004

#: A drilled pair's stop settings: trained to a higher sampled accuracy than the task's pair, so
#: the facts and copies are sharper; no wall-clock net (on a busy machine it would stop a run
#: early, and the model would depend on the machine's load).
MASTERY_WARMSTART = {"target_accuracy": 0.7, "max_steps": 800, "max_seconds": 1e9}


def mastery_mixes(task: str, point: str) -> dict[str, dict[str, float]]:
    """The task's warm-start mixes at mastery point ``point`` (``graftrl sweep --knob mastery``).

    ``"default"`` is the task's own pair. A number e gives each model its own regrouping family at
    share e (the carries for the Llama, the borrows for the GPT-2: the step the *other* model
    lacks), the other's regrouping family (its deficit) at the small ``MASTERY_DEFICIT_SHARE``, and
    the single-digit facts of both regrouping families as drills (``MASTERY_DRILL_SHARE``); the
    no-regrouping families as in the task's mix. Each model then knows the facts (with them, 2.5%
    of the other's regrouping step was enough to learn it, docs/task_design.md, hence the much
    smaller deficit share), and how often it carries or borrows right, the step its peer lacks,
    moves with e.
    """
    if point == "default":
        return {name: dict(mix) for name, mix in TASK_MIXES[task].items()}
    exposure = float(point)
    if not 0.0 < exposure <= 1.0:
        raise ValueError(f"mastery point must be 'default' or in (0, 1], got {point!r}")
    drills = get_task(task).drills
    if not drills:
        raise ValueError(f"task {task!r} has no fact drills, so it has no mastery knob")
    out = {}
    for name, mix in TASK_MIXES[task].items():
        own = max((f for f in REGROUPING if f in mix), key=lambda f: mix[f])
        deficit = {f: MASTERY_DEFICIT_SHARE for f in REGROUPING if f != own and MASTERY_DEFICIT_SHARE > 0}
        kept = {f: w for f, w in mix.items() if f not in REGROUPING}
        drilled = {drill: MASTERY_DRILL_SHARE / len(drills) for drill in drills}
        out[name] = {**kept, own: exposure, **deficit, **drilled}
    return out


def exposure_mixes(task: str, exposure: float) -> dict[str, dict[str, float]]:
    """The task's warm-start mixes at deficit exposure ``exposure`` in (0, 1): each model's share of
    its deficit (the step family the other model is strong on, the smaller of the two step shares
    in its mix) set to ``exposure``, its own step family's share moved by the same amount, the
    other families as in the task's mix. The code task's knob (docs/results.md §11): how much of
    the peer's step a receiver has seen."""
    if not 0.0 < exposure < 1.0:
        raise ValueError(f"deficit exposure must be in (0, 1), got {exposure}")
    steps = get_task(task).steps
    if len(steps) != 2:
        raise ValueError(f"task {task!r} has no pair of step families, so it has no exposure knob")
    out = {}
    for name, mix in TASK_MIXES[task].items():
        deficit, own = sorted(steps, key=lambda f: mix.get(f, 0.0))
        moved = round(mix[own] + mix.get(deficit, 0.0) - exposure, 6)
        if moved <= 0:
            raise ValueError(f"deficit exposure {exposure} leaves {name} nothing of its own step {own!r}")
        out[name] = {**mix, own: moved, deficit: exposure}
    return out


#: Stop settings per task: full (demo) and quick (smoke tests). ``WARMSTART_SETTINGS`` is the
#: ``arith`` task's. Stopping is counted in optimizer steps and checks, never in wall-clock seconds,
#: so a warm-start gives the same model on a fast or a busy machine (``max_seconds`` is only a
#: safety net, counted in CPU-seconds of the training steps: a wall-clock net stopped the default
#: pair early, under target, on a machine shared with other runs).
TASK_WARMSTART_SETTINGS: dict[str, dict[str, dict[str, float]]] = {
    "arith": {
        "full": {"target_accuracy": 0.65, "max_steps": 1000, "max_seconds": 900.0},
        "quick": {"target_accuracy": 0.2, "max_steps": 80, "max_seconds": 60.0},
    },
    "worked": {
        "full": {"target_accuracy": 0.6, "max_steps": 600, "max_seconds": 2400.0},
        "quick": {"target_accuracy": 0.2, "max_steps": 80, "max_seconds": 60.0},
    },
    # checked every 20 steps: a code model's sampled accuracy jumps within 40 (0.45 -> 0.91)
    "code": {
        "full": {"target_accuracy": 0.6, "max_steps": 600, "max_seconds": 2400.0, "check_every_steps": 20},
        "quick": {"target_accuracy": 0.2, "max_steps": 80, "max_seconds": 60.0},
    },
}
WARMSTART_SETTINGS = TASK_WARMSTART_SETTINGS["arith"]
