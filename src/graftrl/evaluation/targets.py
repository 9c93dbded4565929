"""What `graftrl eval` evaluates: a run's policies (latest or validation-best checkpoints) or bare
checkpoint folders, each with the prompt format, dtype, device and attention kernel to load it with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.console import warn
from graftrl.errors import CheckpointError
from graftrl.models.policy import Policy
from graftrl.storage.checkpoint import newest_usable, required_files, verify_checkpoint
from graftrl.storage.rundir import MANIFEST, RunDir, checkpoint_step


@dataclass(frozen=True)
class ModelTarget:
    """A checkpoint to evaluate and how to prompt it."""

    label: str
    """Row name in the report."""
    path: str
    """Hugging Face checkpoint folder (model + tokenizer)."""
    policy: str = "model"
    template: str = "{problem}"
    chat_template: bool = False
    dtype: str = "float32"
    device: str = "auto"
    attn_implementation: str | None = None
    """transformers' attention kernel (the run's `policies[].attn_implementation`); None: its default."""
    completed_steps: int | None = None
    """Training steps behind this checkpoint, when known."""

    @classmethod
    def of_policy(cls, spec: Any, **fields: Any) -> ModelTarget:
        """A run's policy (its `policies[]` entry): its name, prompt format, dtype, device and kernel;
        ``fields`` override any of them (another checkpoint folder as ``path``, a ``label``)."""
        values = {
            "label": spec.name,
            "path": spec.path,
            "policy": spec.name,
            "template": spec.template,
            "chat_template": spec.chat_template,
            "dtype": spec.dtype,
            "device": spec.device,
            "attn_implementation": spec.attn_implementation,
        }
        return cls(**{**values, **fields})

    def load(self) -> Policy:
        return Policy.from_pretrained(
            self.policy,
            self.path,
            dtype=self.dtype,
            device=self.device,
            attn_implementation=self.attn_implementation,
            template=self.template,
            chat_template=self.chat_template,
        )


@dataclass
class EvalPlan:
    targets: list[ModelTarget]
    config: Any = None
    """The run's Config when TARGET is a run directory (prompt format, limits, verifier)."""
    default_out: Path = Path("eval")


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _newest_intact(root: Path, policies: list[str]) -> Path:
    """The newest checkpoint that passes its manifest, as ``--resume`` chooses it (damaged newer
    ones are named in a warning each and skipped; nothing is moved); refused when none is intact."""
    usable, damaged = newest_usable(root, required_files(policies))
    if usable is None and not damaged:
        raise FileNotFoundError(
            f"{root}: no checkpoint yet (checkpoints are saved every `checkpoint.every` steps and at the end)"
        )
    if usable is None:
        raise CheckpointError(
            f"no intact checkpoint under {root} ({'; '.join(f'{c.folder.name}: {c.problem}' for c in damaged)}); "
            "restore one from a backup, or evaluate a checkpoint folder directly"
        )
    for check in damaged:
        warn(f"checkpoint {check.folder.name}: {check.problem}; evaluating {usable.folder.name} instead")
    if usable.status == "legacy":
        warn(f"{usable.folder}: written before checkpoint manifests; evaluated unverified")
    return usable.folder


def _verify_best(folder: Path) -> None:
    """A best checkpoint is sealed by a manifest like a checkpoint (one saved before best/ had
    manifests is evaluated unverified, with a warning); a damaged one is refused, naming the file."""
    if not (folder / MANIFEST).is_file():
        warn(f"{folder}: no {MANIFEST} (saved before best checkpoints had one); evaluated unverified")
        return
    check = verify_checkpoint(folder, ["config.json"])
    if not check.usable:
        raise CheckpointError(
            f"best checkpoint {folder}: {check.problem}; evaluate the run's latest checkpoint without "
            "--best, or restore the folder"
        )


def _verify_sealed(folder: Path) -> None:
    """A model folder graftrl sealed (a policy folder of a checkpoint, a best checkpoint: a
    manifest.json in it or in its parent) is verified against that manifest, a damaged one refused."""
    for sealed in (folder, folder.parent):
        if (sealed / MANIFEST).is_file() and not _is_shipped_manifest(sealed / MANIFEST):
            check = verify_checkpoint(sealed)
            if not check.usable:
                raise CheckpointError(
                    f"{sealed}: {check.problem}; evaluate an intact checkpoint (a run folder's newest intact "
                    "one is chosen when you pass the run folder)"
                )
            return


def _is_shipped_manifest(path: Path) -> bool:
    """The manifest of shipped or pinned warm-starts (``embedded.shipped``: their own SHA-256 list,
    checked where they are installed), not a checkpoint's."""
    try:
        return "models" in json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _best_index(path: Path) -> dict[str, Any]:
    try:
        chosen = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{path}: unreadable ({type(error).__name__}); evaluate the run's latest checkpoint without --best"
        ) from None
    if not isinstance(chosen, dict):
        raise CheckpointError(
            f"{path}: not a JSON object; evaluate the run's latest checkpoint without --best"
        )
    return chosen


def _best_steps(path: Path, name: str, entry: Any) -> int:
    """Training steps behind policy ``name``'s best checkpoint, from its best.json entry."""
    completed = entry.get("completed_steps") if isinstance(entry, dict) else None
    if completed is None and isinstance(entry, dict) and isinstance(entry.get("step"), int):
        completed = entry["step"] + 1
    if isinstance(completed, bool) or not isinstance(completed, int) or completed < 0:
        raise CheckpointError(
            f"{path}: field '{name}.completed_steps' is missing or not a count; evaluate the run's latest "
            "checkpoint without --best"
        )
    return completed


def resolve_targets(
    target: str | Path,
    best: bool = False,
    template: str | None = None,
    chat_template: bool | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> EvalPlan:
    """What `graftrl eval TARGET` evaluates.

    - a run directory (holds ``config.yaml``): each policy of the run, from ``best/<policy>/``
      with ``best=True`` (the validation-selected checkpoints), else from the latest
      ``checkpoints/step_N/``; prompt templates and dtypes come from the run's config;
    - a checkpoint folder (holds ``config.json``): that one model;
    - a folder of checkpoint folders (e.g. ``checkpoints/step_000010``): each of them.

    Explicit ``template`` / ``chat_template`` / ``dtype`` / ``device`` override the run's.
    """
    from graftrl.config import load_config

    root = Path(target)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected a run directory or a checkpoint folder)")

    def override(**values: Any) -> dict[str, Any]:
        given = {"template": template, "chat_template": chat_template, "dtype": dtype, "device": device}
        return {**values, **{k: v for k, v in given.items() if v is not None}}

    def policy_target(spec: Any, folder: Path, label: str, completed: int) -> ModelTarget:
        """One policy's checkpoint, with the run's template/dtype/device unless overridden."""
        return ModelTarget.of_policy(
            spec, **override(label=label, path=str(folder), completed_steps=completed)
        )

    files = RunDir(root)
    if files.is_run():
        config = load_config(files.config)
        specs = {p.name: p for p in config.policies}
        targets: list[ModelTarget] = []
        if best:
            best_file = files.best_index
            if not best_file.is_file():
                raise FileNotFoundError(
                    f"{best_file} not found: --best needs a run trained with validation "
                    "(set `validation.files` in the config); evaluate the latest checkpoint without --best"
                )
            chosen = _best_index(best_file)
            for name, spec in specs.items():
                if name not in chosen or not _is_checkpoint(files.best / name):
                    raise FileNotFoundError(f"{files.best / name}: no best checkpoint for policy {name!r}")
                completed = _best_steps(best_file, name, chosen[name])
                _verify_best(files.best / name)
                targets.append(
                    policy_target(spec, files.best / name, f"{name} (best, {completed} steps)", completed)
                )
            return EvalPlan(targets, config, files.evaluation(best=True))
        latest = _newest_intact(files.checkpoints, list(specs))
        completed = checkpoint_step(latest) or 0
        for name, spec in specs.items():
            targets.append(policy_target(spec, latest / name, f"{name} ({completed} steps)", completed))
        return EvalPlan(targets, config, files.evaluation(best=False))

    folders = [root] if _is_checkpoint(root) else sorted(p for p in root.iterdir() if _is_checkpoint(p))
    for folder in folders:
        _verify_sealed(folder)
    if not folders:
        raise FileNotFoundError(
            f"{root}: neither a run directory (config.yaml) nor a Hugging Face checkpoint folder (config.json)"
        )
    targets = [
        ModelTarget(
            **override(
                label=folder.name,
                path=str(folder),
                policy=folder.name,
                template="{problem}",
                chat_template=False,
                dtype="float32",
                device="auto",
            )
        )
        for folder in folders
    ]
    return EvalPlan(targets, None, Path("runs") / "eval" / root.name)
