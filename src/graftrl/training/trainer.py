"""Algorithm 1: co-train K policies on a shared prompt stream with GRPO or GRAFT.

Each step: every policy samples n responses per prompt, the verifier scores them, each policy
computes its own GRPO advantages; the method plans which groups each receiver trains on; each
receiver scores the grafted responses on its own tokenization, weighs them, and updates with
peer groups ordered last. The loop knows nothing of two models in particular.

The trainer is the driver: it samples the prompt batch, plans the exchange, logs, checkpoints and
replays stored peers. Everything that touches a policy's weights is a ``PolicyWorker``
(graftrl.training.worker), placed by the backend and driven through its typed ``WorkerGroup``
interface (graftrl.training.backends): in this process or in Ray actors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from graftrl.config import Config, ConfigError, dump_config
from graftrl.console import progress_bar
from graftrl.core import complementarity, group_outcome_fractions, grpo_advantages
from graftrl.errors import CheckpointError
from graftrl.files import atomic_write, folder_bytes, is_disk_full, sha256_file
from graftrl.interrupts import clear as clear_interrupt
from graftrl.interrupts import raise_if_interrupted
from graftrl.methods import GroupOutcomes, build_method
from graftrl.models.policy import Policy
from graftrl.storage.checkpoint import (
    CheckpointCheck,
    check_trainer_state,
    hold_run_lock,
    identity_changes,
    input_changes,
    list_checkpoints,
    rotate,
    set_aside,
    trainer_state,
    verify_checkpoint,
    write_manifest,
)
from graftrl.storage.data import MathProblem, PromptSampler, load_problems
from graftrl.storage.metrics import MetricsLogger
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.rundir import (
    METHOD_STATE,
    STAGING_SUFFIX,
    TRAINER_STATE,
    RunDir,
    append_jsonl,
    checkpoint_step,
)
from graftrl.storage.store import StoreError, TrajectoryStore, TrajectoryWriter
from graftrl.training.backends import Worker, WorkerGroup, make_backend
from graftrl.training.log_schema import metric_keys
from graftrl.training.randomness import PLAN_STREAM, step_seed
from graftrl.training.sampling import PolicyRollout

__all__ = ["Trainer", "step_seed"]


PROBLEMS_IN_CODE = "(problems passed to Trainer)"
"""The data path recorded for a run whose problems were handed over in code."""


class Trainer:
    """Runs Algorithm 1 for a config and writes everything into ``run_dir``."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        problems: Sequence[MathProblem] | None = None,
        policies: Sequence[Policy] | None = None,
        verifier: Any = None,
        step_callback: Callable[[int, dict[str, dict[str, Any]]], None] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.files = RunDir(self.run_dir)
        """Every path of the run folder (graftrl.storage.rundir)."""
        self.problems = list(problems) if problems is not None else load_problems(config.data.train)
        self._problems_in_code = problems is not None
        """Problems handed over in code: the run reads them, not ``data.train`` (which may not exist)."""
        self.method = build_method(config.method, config)
        self.sampler = PromptSampler(self.problems, config.train.batch_prompts, config.seed)
        self.n = config.rollout.n
        self.names = [p.name for p in config.policies]
        if policies is None:  # before any weights load: a clear error when the run cannot fit
            from graftrl.models.memory import check_before_loading

            check_before_loading(config)
        self.backend: WorkerGroup = make_backend(
            config, self.run_dir, self.problems, policies=policies, verifier=verifier, method=self.method
        )
        self.step_callback = step_callback
        self.start_step = 0
        self.force = False
        """Resume even when the config changes the run's identity (``train(force=True)``)."""
        self.resume_changed_inputs: list[str] = []
        """Inputs whose content changed since the checkpoint a forced resume loaded (marked in
        the first resumed step's metrics)."""
        self._inputs: dict[str, dict[str, str]] | None = None
        self.logger: MetricsLogger | None = None
        self.validator = None
        if config.validation.files:  # validation and best-checkpoint selection (graftrl.training.validation)
            from graftrl.training.validation import Validator

            # During training each worker samples and scores its own policy (validation_scores),
            # whatever the backend or rank count; the trainer's validator records the scores and
            # keeps best/ (its verifier serves direct `validate(step, policies)` calls).
            self.validator = Validator(config, self.run_dir, verifier)
        # Trajectory recording (graftrl.storage.store) and stored peers replayed from earlier runs (algorithm.md §2.3).
        self.recorder = None
        if config.store.record:
            self.recorder = TrajectoryWriter(Path(config.store.path or self.files.store))
        self.stored_peers = {peer.name: (peer, TrajectoryStore(peer.path)) for peer in config.peers}
        self._peer_verifier = verifier

    @property
    def policies(self) -> list[Policy]:
        """The policies (``backend: local``; Ray keeps them in their actors)."""
        return self.backend.policies

    @property
    def workers(self) -> list[Worker]:
        """The in-process workers (``backend: local``)."""
        return self.backend.workers

    @property
    def peer_verifier(self) -> Any:
        """The driver's verifier, for re-verifying stored peers' rewards (the given one, else the backend's)."""
        if self._peer_verifier is None:
            self._peer_verifier = self.backend.driver_verifier()
        return self._peer_verifier

    # ----- the loop -----------------------------------------------------------------------
    def train(self, resume: bool = False, force: bool = False) -> None:
        """Run the remaining steps, holding the run folder's lock (RunLockError if another process does).

        ``resume``: continue from the newest intact checkpoint (see ``resume``); ``force``: even
        when the config changes the run's identity (seed, method, n, policies, data).
        """
        with hold_run_lock(self.run_dir):
            self._train(resume, force)

    def _train(self, resume: bool, force: bool) -> None:
        clear_interrupt()  # an interrupt from before this run (same process) is not this run's
        if resume and not force:
            self.check_identity()  # before config.yaml is replaced
        logging = self.config.logging
        self.logger = MetricsLogger(
            self.run_dir,
            logging.tensorboard,
            logging.wandb,
            logging.wandb_project,
            self.config.model_dump(mode="json"),
            keys=metric_keys(),
        )
        if resume:
            self.force = force
            try:
                self.resume()
            except BaseException:
                self.logger.close()
                self.close()
                raise
        atomic_write(self.files.config, dump_config(self.config).encode())
        self.inputs()  # hashed now: an input that vanishes mid-run cannot fail a checkpoint
        total = self.config.train.steps
        every = self.config.checkpoint.every
        try:
            with progress_bar(logging.progress, status=True) as progress:
                task = progress.add_task(
                    f"{self.config.method} train", total=total, completed=self.start_step, status=""
                )
                for step in range(self.start_step, total):
                    raise_if_interrupted()
                    metrics = self.step(step)
                    status = "  ".join(f"{name} r={m['reward_mean']:.2f}" for name, m in metrics.items())
                    progress.update(task, advance=1, status=status)
                    if self.step_callback is not None:
                        self.step_callback(step, metrics)
                    if self.validator is not None and self.validator.due(step):
                        self.validate(step)  # after the step: not part of its timings
                    if (every and (step + 1) % every == 0) or step + 1 == total:
                        raise_if_interrupted()  # an interrupt swallowed during the step stops here
                        self.save_checkpoint(step)
        finally:
            self.logger.close()
            self.close()

    def close(self) -> None:
        """Free engines, verifier pools and Ray actors (local policies stay usable for evaluation)."""
        self.backend.close()

    def step(self, step: int) -> dict[str, dict[str, Any]]:
        """One rollout batch and one update of every policy; returns metrics per model."""
        problems = self.sampler.batch(step)
        self.backend.reset_peak_memory()
        # Every policy samples and scores the step's prompts (concurrently under Ray).
        sampled: dict[str, PolicyRollout] = dict(
            zip(self.names, self.backend.rollout(step, problems), strict=True)
        )
        outcomes = {name: s.outcomes for name, s in sampled.items()}
        records = {name: s.records for name, s in sampled.items()}
        shared = {name: s.shared for name, s in sampled.items()}
        if self.recorder is not None:
            self.recorder.write_step(step, [row for s in sampled.values() for row in s.store_rows])
        stored_info: dict[str, float] = {}
        for name, (stored_outcomes, stored_records, changed) in self._stored_peer_groups(
            step, problems
        ).items():
            outcomes[name], records[name], shared[name] = stored_outcomes, stored_records, stored_outcomes
            stored_info[f"stored_reward_changes/{name}"] = changed

        generator = torch.Generator().manual_seed(step_seed(self.config.seed, step, PLAN_STREAM))
        plans = self.method.plan(outcomes, generator)
        updates = self.backend.update(step, [plans[name] for name in self.names], records, self.method)
        metrics: dict[str, dict[str, Any]] = {}
        for name, update in zip(self.names, updates, strict=True):
            row = update.metrics
            if update.compatibility is not None:
                scores = dataclasses.asdict(update.compatibility)
                append_jsonl(self.files.compatibility, {k: v for k, v in scores.items() if v is not None})
            row.update(self._outcome_metrics(name, outcomes, shared, problems))
            row.update(sampled[name].info)
            row.update(stored_info)
            row.update(plans[name].diagnostics)
            row.update(sampled[name].timings)
            if self.resume_changed_inputs and step == self.start_step:
                row["resume_changed_inputs"] = ", ".join(self.resume_changed_inputs)
            timings = {k: v for k, v in row.items() if k.startswith("time_") and k != "time_step"}
            row["time_step"] = sum(timings.values())
            metrics[name] = row
        for name, row in metrics.items():
            assert self.logger is not None
            self.logger.log({"step": step, "model": name, "method": self.method.name, **row})
        self._log_samples(step, sampled, outcomes)
        return metrics

    def _stored_peer_groups(
        self, step: int, problems: Sequence[MathProblem]
    ) -> dict[str, tuple[GroupOutcomes, list[TrajectoryRecord], float]]:
        """Each stored peer's groups on this step's prompts, rewards re-verified (algorithm.md §2.3).

        A group whose re-verified rewards equal the stored ones keeps its stored (source-computed)
        advantages; one whose rewards changed gets advantages recomputed on its full group.
        """
        out = {}
        n = self.n
        for name, (peer, store) in self.stored_peers.items():
            ids = [p.id for p in problems]
            if peer.match == "step" and step not in store.steps():
                held = store.steps()
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no step {step} (it holds steps "
                    f"{held[0] if held else '-'}..{held[-1] if held else '-'}); train for at most as many "
                    "steps as were recorded, or set `match: prompt_id` to match prompts regardless of step"
                )
            found = store.find_groups(ids, source=name, step=step if peer.match == "step" else None)
            missing = [i for i in ids if i not in found]
            if missing:
                where = f"step {step}" if peer.match == "step" else "any step"
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no group of source {name!r} at {where} for "
                    f"{len(missing)} of the step's {len(ids)} prompts (e.g. {missing[:3]}); record the peer "
                    "with the same data, seed and batch size, or set `match: prompt_id`"
                )
            groups = [sorted(found[i], key=lambda row: row.index) for i in ids]
            sizes = {len(g) for g in groups}
            if sizes != {n}:
                raise StoreError(
                    f"peers[{name}]: stored groups hold {sorted(sizes)} responses; set rollout.n: {n} to match or re-record"
                )
            texts = [row.response for group in groups for row in group]
            answers = [p.answer for p in problems for _ in range(n)]
            rewards = torch.tensor(self.peer_verifier.score(texts, answers), dtype=torch.float32).view(
                len(ids), n
            )
            stored_rewards = torch.tensor([[row.reward for row in g] for g in groups], dtype=torch.float32)
            stored_advantages = torch.tensor(
                [[row.advantage for row in g] for g in groups], dtype=torch.float32
            )
            changed = (rewards != stored_rewards).any(dim=-1)  # [P]
            recomputed = grpo_advantages(
                rewards, self.config.train.adv_eps, self.config.train.adv_std_unbiased
            )
            advantages = torch.where(changed.unsqueeze(-1), recomputed, stored_advantages)
            records = [
                dataclasses.replace(
                    row.to_record(), reward=float(rewards[p, i]), advantage=float(advantages[p, i])
                )
                for p, group in enumerate(groups)
                for i, row in enumerate(group)
            ]
            out[name] = (GroupOutcomes(rewards, advantages), records, float(changed.sum()))
        return out

    def _outcome_metrics(
        self,
        name: str,
        outcomes: dict[str, GroupOutcomes],
        shared: dict[str, GroupOutcomes],
        problems: Sequence[MathProblem],
    ) -> dict[str, Any]:
        """Reward of what the policy trains on; complementarity and per-family figures on the shared batch."""
        own = outcomes[name]
        all_fail, all_pass = group_outcome_fractions(own.rewards)
        row: dict[str, Any] = {
            "reward_mean": float(own.rewards.mean()),
            "all_fail_frac": float(all_fail),
            "all_pass_frac": float(all_pass),
        }
        for peer, other in shared.items():
            if peer != name:
                row[f"complementarity/{peer}"] = float(
                    complementarity(shared[name].successes, other.successes)
                )
        # Per family: does the policy learn a sub-skill it starts near 0 on ("beyond what it samples")?
        families = [p.family for p in problems]
        for family in sorted({f for f in families if f is not None}):
            rows = torch.tensor([f == family for f in families])  # [P]
            rewards = shared[name].rewards[rows]  # [P_family, n]
            row[f"family_reward/{family}"] = float(rewards.mean())
            row[f"family_all_fail/{family}"] = float(group_outcome_fractions(rewards)[0])
        return row

    def _log_samples(
        self, step: int, sampled: dict[str, PolicyRollout], outcomes: dict[str, GroupOutcomes]
    ) -> None:
        count = self.config.logging.log_samples
        if not count:
            return
        n = self.n
        append_jsonl(
            self.files.samples,
            [
                {
                    "step": step,
                    "model": name,
                    "prompt_id": part.problems[row // n].id,
                    "answer": part.problems[row // n].answer,
                    "response": part.records[row].response,
                    "reward": float(outcomes[name].rewards.view(-1)[row]),
                }
                for name, part in sampled.items()
                for row in range(0, min(count * n, len(part.records)), n)
            ],
        )

    # ----- validation ---------------------------------------------------------------------
    def validate(self, step: int) -> list[dict[str, Any]]:
        """Validate every policy now (each in its worker, with its own engine), keep the best checkpoints."""
        assert self.validator is not None
        rows = []
        start = time.perf_counter()
        scores = self.backend.validation_scores()
        seconds = time.perf_counter() - start
        for index, (name, score) in enumerate(zip(self.names, scores, strict=True)):
            rows.append(
                self.validator.record(
                    step,
                    name,
                    score,
                    lambda folder, i=index: self.backend.save_policy(i, folder),
                    seconds,
                )
            )
        self.validator.report(step, rows)
        return rows

    # ----- checkpoints ----------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.files.checkpoints

    def inputs(self) -> dict[str, dict[str, str]]:
        """The content of what the run reads besides its models: the training data (the file, or
        the problems handed to the trainer in code) and every stored peer's store,
        name -> {"path", "sha256"} (hashed once per process)."""
        if self._inputs is None:
            if self._problems_in_code:
                listed = json.dumps([dataclasses.asdict(p) for p in self.problems], sort_keys=True)
                digest = hashlib.sha256(listed.encode()).hexdigest()
                self._inputs = {"data.train": {"path": PROBLEMS_IN_CODE, "sha256": digest}}
            else:
                data = Path(self.config.data.train)
                self._inputs = {"data.train": {"path": str(data), "sha256": sha256_file(data)[0]}}
            for peer, store in self.stored_peers.values():
                self._inputs[f"peers.{peer.name}"] = {"path": str(peer.path), "sha256": store.fingerprint()}
        return self._inputs

    def _required_files(self) -> list[str]:
        return [TRAINER_STATE, METHOD_STATE, *(f"{name}/" for name in self.names)]

    def save_checkpoint(self, step: int) -> Path:
        """Weights, optimizer and method state after ``step``, sealed by a manifest (graftrl.storage.checkpoint).

        Assembled in a staging folder and renamed into place; refused (CheckpointError) when any
        policy's weights or optimizer state hold NaN or inf, so a diverged state never replaces a
        good checkpoint.
        """
        nonfinite = self.backend.nonfinite_state()
        bad = {name: found for name, found in zip(self.names, nonfinite, strict=True) if found}
        if bad:
            kept = list_checkpoints(self.checkpoint_root)
            raise CheckpointError(
                f"step {step}: non-finite values in "
                + "; ".join(f"{name} ({', '.join(found)})" for name, found in bad.items())
                + "; checkpoint not written"
                + (f", the last one is {kept[-1]}" if kept else "")
                + ": lower optim.lr or tighten optim.grad_clip, then --resume"
            )
        completed = step + 1
        final = self.files.checkpoint(completed)
        staging = final.with_name(final.name + STAGING_SUFFIX)
        shutil.rmtree(staging, ignore_errors=True)
        previous = self.latest_checkpoint()
        try:
            staging.mkdir(parents=True)
            self.backend.save([str(staging / name) for name in self.names])
            (staging / METHOD_STATE).write_text(json.dumps(self.method.state_dict()))
            (staging / TRAINER_STATE).write_text(
                json.dumps(trainer_state(completed, self.method.name, self.inputs()))
            )
            write_manifest(staging, completed)  # last: a folder with a manifest is complete
        except Exception as error:
            if not is_disk_full(error):
                raise
            self._refuse_full_disk(step, staging, previous)
        if final.exists():  # only after a fallback re-ran this step; the old one is replaced
            shutil.rmtree(final)
        staging.rename(final)
        rotate(self.checkpoint_root, self.config.checkpoint.keep_last, final)
        return final

    def _refuse_full_disk(self, step: int, staging: Path, previous: Path | None) -> None:
        """The disk filled while ``staging`` was written: remove it, say what a checkpoint needs."""
        written = folder_bytes(staging)
        shutil.rmtree(staging, ignore_errors=True)
        free = shutil.disk_usage(self.checkpoint_root).free
        # The last checkpoint's size is what the next one needs; without one, what was written so far.
        needed = (
            f"about {folder_bytes(previous) / 2**20:.1f} MiB"
            if previous
            else f"over {written / 2**20:.1f} MiB"
        )
        raise CheckpointError(
            f"step {step}: no space left on the device of {self.checkpoint_root} while writing checkpoint "
            f"{staging.name.removesuffix(STAGING_SUFFIX)}: a checkpoint needs {needed}, "
            f"{free / 2**20:.1f} MiB are free; the partial folder was removed"
            + (f" and {previous.name} is intact" if previous else "")
            + ": free space (or lower checkpoint.keep_last), then --resume"
        ) from None

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint folder by name (not verified; ``resume`` verifies)."""
        done = list_checkpoints(self.checkpoint_root)
        return done[-1] if done else None

    def check_identity(self) -> None:
        """Refuse (ConfigError) a resume whose config changes the run's identity vs its config.yaml."""
        saved_path = self.files.config
        if not list_checkpoints(self.checkpoint_root):
            return  # nothing to resume: the run starts over from step 0 anyway
        try:
            saved = yaml.safe_load(saved_path.read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ConfigError(
                f"--resume: cannot read {saved_path} ({error.__class__.__name__}) to check that the config "
                "still describes this run; restore it, or pass --force to resume under the new config"
            ) from None
        changes = identity_changes(
            saved if isinstance(saved, dict) else {}, self.config.model_dump(mode="json")
        )
        if changes:
            raise ConfigError(
                f"--resume: the config changes the run's identity vs {saved_path}: {'; '.join(changes)}; "
                "undo the change, train into another --out, or pass --force to resume anyway"
            )

    def resume(self) -> None:
        """Continue from the newest intact checkpoint (verified against its manifest).

        Damaged newer checkpoints are named, set aside under ``checkpoints/damaged/`` and skipped;
        with none intact the resume is refused (CheckpointError). With no checkpoint at all the run
        starts from step 0. Derived logs and the store are cut back to the resumed step.
        """
        skipped: list[str] = []
        chosen = None
        for folder in reversed(list_checkpoints(self.checkpoint_root)):
            check = verify_checkpoint(folder, self._required_files())
            if check.status == "legacy":
                problem = self._load_legacy(folder)
                if problem is None:
                    _warn(f"{folder}: written before checkpoint manifests; loaded unverified")
                    chosen = folder
                    break
                check = CheckpointCheck(folder, "damaged", problem)
            if check.status == "damaged":
                skipped.append(f"{folder.name}: {check.problem}")
                continue
            self._load(folder, self.force)
            chosen = folder
            break
        if chosen is None and skipped:
            raise CheckpointError(
                f"--resume: no intact checkpoint under {self.checkpoint_root} ({'; '.join(skipped)}); "
                "restore one from a backup, or start over in another --out"
            )
        for line in skipped:
            _warn(f"checkpoint {line}; falling back to {chosen.name if chosen else '-'}")
        for damaged in list_checkpoints(self.checkpoint_root):
            if chosen is not None and (checkpoint_step(damaged) or 0) > self.start_step:
                _warn(f"{damaged.name} set aside as {set_aside(damaged)}")
        if chosen is not None:  # finish a rotation a kill interrupted, so the folder looks uninterrupted
            rotate(self.checkpoint_root, self.config.checkpoint.keep_last, chosen)
        else:
            self.start_step = 0
            _warn(
                f"--resume: no checkpoint in {self.checkpoint_root} yet; starting from step 0 "
                "(earlier log lines move to *.discarded.jsonl)"
            )
        self._truncate_derived(self.start_step - 1)

    def _load(self, folder: Path, force: bool) -> None:
        state = json.loads((folder / TRAINER_STATE).read_text())
        self.start_step = check_trainer_state(folder, state, self.config.train.steps)
        changed = input_changes(state.get("inputs"), self.inputs())
        if changed and not force:
            raise ConfigError(
                f"--resume: {changed[0]}{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} "
                f"changed since {folder.name} was written; restore it, train into another --out, or pass "
                "--force to resume on the new content (the metrics then mark the resumed step)"
            )
        for change in changed:
            _warn(f"--force: {change} changed since {folder.name}; resuming on the new content")
        self.resume_changed_inputs = [change.split(" ", 1)[0] for change in changed]
        self.backend.load([str(folder / name) for name in self.names])
        method_state = json.loads((folder / METHOD_STATE).read_text())
        if state.get("method") == self.method.name:
            self.method.load_state_dict(method_state)
        elif force:
            _warn(
                f"{folder}: method {state.get('method')!r} -> {self.method.name!r}: method state starts fresh"
            )
        else:
            raise CheckpointError(
                f"{folder / TRAINER_STATE}: written by method {state.get('method')!r}, the config says "
                f"{self.method.name!r}; set method: {state.get('method')} or pass --force"
            )

    def _load_legacy(self, folder: Path) -> str | None:
        """Load a checkpoint without a manifest; the problem found (None when it loaded and is finite)."""
        missing = [name for name in self._required_files() if not (folder / name.rstrip("/")).exists()]
        if missing:
            return f"{missing[0]}: missing"
        try:
            self._load(folder, force=True)
        except CheckpointError:
            raise
        except Exception as error:  # an unverifiable folder: any load failure means "damaged"
            first_line = (str(error).splitlines() or [""])[0][:200]
            return f"does not load ({error.__class__.__name__}: {first_line})"
        for name, found in zip(self.names, self.backend.nonfinite_state(), strict=True):
            if found:
                return f"{name}: non-finite values ({', '.join(found)})"
        return None

    def _truncate_derived(self, step: int) -> None:
        """Cut metrics, samples, compatibility and validation logs and the store back to ``step``."""
        for path, torn in self.files.truncate_logs(step).items():
            _warn(f"{path}: {torn} unreadable line(s) (a torn write) moved aside")
        if self.recorder is not None:
            if self.recorder.rebuilt:
                _warn(f"{self.recorder.root}/manifest.json was missing; rebuilt from its step files")
            self.recorder.truncate_after(step)


def _warn(message: str) -> None:
    """A note on the resume, on stderr (the CLI's stdout carries the progress bar)."""
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)
