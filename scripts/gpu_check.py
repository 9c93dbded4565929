"""Helpers of the one-shot GPU check (scripts/gpu_check.sh, scripts/gpu_wheels.sh).

    python scripts/gpu_check.py wheels [--download .whl]   # the wheels the GPU machine needs
    python scripts/gpu_check.py install --site DIR  # pip-install .whl/*.whl into DIR, check them
    python scripts/gpu_check.py env --json F        # on the machine: versions, requirements, imports

``wheels`` walks graftrl's requirements (pyproject.toml) through this environment's installed
metadata, for the GPU machine's Python (``TARGET``), and keeps what the machine's image lacks
(``MACHINE_PACKAGES``) at the version installed here, plus any package the machine has that a
carried one pins a minimum version of (the machine's own version is not known from here); and the
benchmarks' own wheels (``BENCH_WHEELS``: TRL for the decode stage), pinned.
Runs with the standard library plus ``packaging``; ``env`` needs no graftrl install (src/ on
PYTHONPATH). The summary is scripts/gpu_check_report.py.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import os
import platform
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
"""The GPU machine's interpreter, for the requirements' environment markers."""
GPU_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "any",
)
"""Wheel platform tags that install there (pip matches manylinux_2_N exactly; 'any': pure Python)."""
WHEEL_DIR = Path(os.environ.get("GRAFTRL_WHEEL_DIR") or ROOT / ".whl")
"""The carried wheels (made by scripts/gpu_wheels.sh)."""

# The Python packages of the GPU machine's image ('cuda', nvidia-h200), as the device docs list
# them (read there on 2026-11-17): python3 3.12 with torch 2.11.0+cu130, transformers 5.17.0.
_MACHINE_PACKAGE_NAMES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
    h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
    six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
MACHINE_PACKAGES = frozenset(_MACHINE_PACKAGE_NAMES.split())


BENCH_WHEELS = {"trl": "1.16.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}
"""The decode stage's TRL side (benchmarks/decode_speed.py times TRL's GRPOTrainer sampling): not
graftrl requirements, so not in this venv; pinned to what TRL 1.16 resolves to beside transformers
5.17 (the machine's), less what the machine has. Its minimum versions of the machine's packages are
not carried (datasets 5.2 asks for pyarrow >= 24, a 40 MB wheel; the machine's pyarrow is not known
from here): when TRL does not import there, the stage measures ``generate`` with TRL's settings and
says so."""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def graftrl_requirements() -> list[str]:
    """graftrl's runtime requirements, as pyproject.toml states them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


# ----- wheels ---------------------------------------------------------------------------------------
def carried_packages() -> dict[str, str]:
    """canonical name -> version (installed here) of every wheel the GPU machine needs."""
    from packaging.requirements import Requirement

    carried: dict[str, str] = {}
    pending = [(Requirement(r), "graftrl") for r in graftrl_requirements()]
    while pending:
        requirement, wanted_by = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
            continue
        name = canonical(requirement.name)
        on_machine = name in MACHINE_PACKAGES
        # A package the machine has is carried only when a carried package needs a minimum version.
        if name in carried or (on_machine and (wanted_by == "graftrl" or not requirement.specifier)):
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{name} (needed by {wanted_by}) is not installed in this environment ({sys.executable}): "
                "run the wheel command from graftrl's venv (bash scripts/setup.sh, then .venv/bin/python)"
            ) from None
        if not requirement.specifier.contains(version, prereleases=True):
            raise SystemExit(f"{name} {version} installed here does not satisfy {wanted_by}'s {requirement}")
        carried[name] = version
        pending += [(Requirement(r), name) for r in metadata.requires(name) or []]
    return dict(sorted(carried.items()))


def wheel_pins() -> dict[str, str]:
    """canonical name -> version of every wheel in .whl/: graftrl's (``carried_packages``) and the
    benchmarks' (``BENCH_WHEELS``)."""
    return dict(sorted({**carried_packages(), **BENCH_WHEELS}.items()))


def platform_args() -> list[str]:
    """pip's flags for binary wheels of the GPU machine's interpreter."""
    args = ["--only-binary=:all:", "--python-version", TARGET["python_version"], "--implementation", "cp"]
    return args + [arg for tag in GPU_PLATFORMS for arg in ("--platform", tag)]


def download(dest: Path, limit_mib: float = 16) -> int:
    """Fetch the carried wheels (``wheel_pins``) into an emptied ``dest``; check count and size
    (``limit_mib``: a device call carries 64 MiB in all, the working tree included)."""
    import shutil
    import subprocess

    pins = [f"{name}=={version}" for name, version in wheel_pins().items()]
    print("wheels for the GPU machine: " + " ".join(pins))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), *platform_args()]
    subprocess.run([*command, *pins], check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    for wheel in wheels:
        print(f"  {wheel.name}  {wheel.stat().st_size / 2**10:,.0f} KiB")
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {dest}")
    if len(wheels) != len(pins):
        print(f"expected {len(pins)} wheels, got {len(wheels)}", file=sys.stderr)
        return 1
    if size > limit_mib:
        print(
            f"over {limit_mib} MiB: a device call carries 64 MiB in all, working tree included",
            file=sys.stderr,
        )
        return 1
    return 0


def install(site: Path, for_gpu_python: bool) -> int:
    """pip-install every wheel of .whl/ into ``site`` (no index, no dependencies), then check that
    each one is there; ``for_gpu_python``: for the GPU machine's interpreter (the dry run, which
    also checks that .whl/ holds exactly the wheels the current requirements call for)."""
    import subprocess

    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(site)]
    if for_gpu_python:
        command += platform_args()
    subprocess.run([*command, *map(str, wheels)], check=True)
    present = {
        (canonical(name), version)
        for name, version in (
            d.name.removesuffix(".dist-info").split("-")[:2] for d in site.glob("*.dist-info")
        )
    }
    wanted = {(canonical(w.name.split("-")[0]), w.name.split("-")[1]) for w in wheels}
    missing = sorted(wanted - present)
    if missing:
        print(f"installed into {site}, but no dist-info for {missing}", file=sys.stderr)
        return 1
    if for_gpu_python:
        expected = set(wheel_pins().items())
        if wanted != expected:
            print(
                f"{WHEEL_DIR}/ is stale: it holds {sorted(wanted - expected)} but lacks {sorted(expected - wanted)}; "
                "rerun bash scripts/gpu_wheels.sh",
                file=sys.stderr,
            )
            return 1
    print(f"{len(wheels)} wheels installed into {site}: " + ", ".join(f"{n}=={v}" for n, v in sorted(wanted)))
    return 0


# ----- env (on the GPU machine) ---------------------------------------------------------------------
def _check(checks: list[dict[str, Any]], name: str, func) -> None:
    start = time.perf_counter()
    try:
        detail = func()
        checks.append({"check": name, "ok": True, "detail": detail})
    except Exception as error:
        checks.append({"check": name, "ok": False, "detail": f"{type(error).__name__}: {error}"})
    checks[-1]["seconds"] = round(time.perf_counter() - start, 2)
    mark = "ok  " if checks[-1]["ok"] else "FAIL"
    print(f"{mark} {name}: {checks[-1]['detail']}", flush=True)


def environment(json_path: str | None) -> int:
    from packaging.requirements import Requirement

    checks: list[dict[str, Any]] = []
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for requirement in map(Requirement, graftrl_requirements()):
        name = canonical(requirement.name)

        def installed(requirement=requirement, name=name) -> str:
            version = metadata.version(name)
            where = Path(str(metadata.distribution(name).locate_file(""))).as_posix()
            if not requirement.specifier.contains(version, prereleases=True):
                raise RuntimeError(f"{version} does not satisfy {requirement}")
            return f"{version} ({where})"

        _check(checks, f"requirement {requirement}", installed)

    def cuda() -> str:
        import torch

        info["torch"] = torch.__version__
        if not torch.cuda.is_available():
            if os.environ.get("GRAFTRL_CUDA_TIER_REQUIRE_CUDA") == "1":  # the GPU run
                raise RuntimeError("torch sees no CUDA device")
            return "no CUDA device (the cuda tier then runs only with GRAFTRL_CUDA_TIER_ON_CPU=1)"
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
        info["cuda"] = torch.version.cuda
        x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}, bf16 matmul {float((x @ x).float().abs().mean()):.3f}"

    def apis() -> str:
        # what graftrl's scale paths import, at the machine's torch / transformers versions
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: F401
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        from transformers import LlamaForCausalLM, PreTrainedModel, Qwen2ForCausalLM  # noqa: F401

        missing = [
            m for m in ("unshard", "reshard", "set_reshard_after_forward") if not hasattr(FSDPModule, m)
        ]
        if missing:  # graftrl.training.parallel.gathered calls them
            raise RuntimeError(f"FSDPModule lacks {missing} in this torch")
        for module in (
            "graftrl.config",
            "graftrl.cli",
            "graftrl.training.trainer",
            "graftrl.training.parallel",
            "graftrl.training.ranks",
        ):
            importlib.import_module(module)
        import transformers

        info["transformers"] = transformers.__version__
        checkpointing = hasattr(PreTrainedModel, "activation_checkpointing_enable")
        return f"transformers {transformers.__version__}: activation_checkpointing_enable={checkpointing}"

    def verifier() -> str:
        from graftrl.models.rewards import MathVerifier

        with MathVerifier(short_circuit=False) as math:
            scores = math.score(["so \\boxed{\\frac{1}{2}}", "\\boxed{3}"], ["0.5", "2"])
        if scores != [1.0, 0.0]:
            raise RuntimeError(f"math_verify scored {scores}, expected [1.0, 0.0]")
        return "math_verify in worker processes: [1.0, 0.0]"

    _check(checks, "torch and the GPU", cuda)
    _check(checks, "scale-path APIs", apis)
    _check(checks, "MathVerifier", verifier)
    payload = {"info": info, "checks": checks, "ok": all(c["ok"] for c in checks)}
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=2))
    return 0 if payload["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    wheels = commands.add_parser("wheels", help="print NAME==VERSION of each wheel to carry")
    wheels.add_argument("--download", type=Path, default=None, help="fetch them into this (emptied) folder")
    inst = commands.add_parser("install", help="pip-install the carried wheels into a folder and check them")
    inst.add_argument("--site", required=True, type=Path)
    inst.add_argument("--for-gpu-python", action="store_true", help="for Python 3.12 x86-64 (the dry run)")
    env = commands.add_parser("env", help="versions, requirements and imports on this machine")
    env.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.command == "wheels":
        if args.download is not None:
            return download(args.download)
        for name, version in wheel_pins().items():
            print(f"{name}=={version}")
        return 0
    if args.command == "install":
        return install(args.site, args.for_gpu_python)
    return environment(args.json)


if __name__ == "__main__":
    sys.exit(main())
