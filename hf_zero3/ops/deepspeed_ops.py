"""The DeepSpeed ops a ds_config makes the engine build, each checked before the run: compatible here, built
(in the wheel or torch's JIT cache) or buildable, and with `--build-ops` built now. A missing op otherwise fails
minutes into the first step, or hangs on a build lock a killed build left behind.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import time
from pathlib import Path

from hf_zero3.ops.doctor import Result

# Reported, not required, when neither --config nor --ops says which ops the run needs.
DEFAULT_OPS = ("cpu_adam", "fused_adam", "async_io")


def needed_ops(config: dict) -> dict[str, str]:
    """The DeepSpeed ops a ds_config makes the engine build, with the reason (as engine.py chooses them)."""
    zero = config.get("zero_optimization") or {}
    devices = {key: (zero.get(key) or {}).get("device", "none")
               for key in ("offload_optimizer", "offload_param")}
    optimizer = config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    cpu_optimizer = devices["offload_optimizer"] in ("cpu", "nvme")
    ops = {}
    if cpu_optimizer:
        op = {"adagrad": "cpu_adagrad", "lion": "cpu_lion"}.get(kind, "cpu_adam")
        ops[op] = f"optimizer offloaded to {devices['offload_optimizer']}"
    elif kind in ("adam", "adamw") and not (optimizer.get("params") or {}).get("torch_adam", False):
        ops["fused_adam"] = f"DeepSpeed {optimizer['type']} without offload"
    elif kind in ("lamb", "lion"):
        ops[f"fused_{kind}"] = f"DeepSpeed {optimizer['type']} without offload"
    to_nvme = [key for key, device in devices.items() if device == "nvme"]
    if to_nvme:
        ops["async_io"] = f"{' and '.join(to_nvme)} to nvme"
    return ops


def _all_ops() -> tuple[dict, dict]:
    """DeepSpeed's op builders for this accelerator and which ship prebuilt, imported without log lines."""
    logging.disable(logging.WARNING)  # "Setting accelerator to CPU ..." would break one line per check
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    finally:
        logging.disable(logging.NOTSET)
    return ALL_OPS, installed_ops


def _jit_cache(name: str) -> Path:
    """Where torch.utils.cpp_extension.load caches an op (its _get_build_directory, without creating it)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                 f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        python = f"py{sys.version_info[0]}{sys.version_info[1]}"
        root = os.path.join(get_default_build_root(), f"{python}_{accel}")
    return Path(root) / name


def _op_fix(name: str, reason: str) -> str:
    if name == "async_io":
        return ("install libaio: `apt install libaio-dev` (RHEL: `dnf install libaio-devel`), "
                "then re-run `ds_report`")
    return (f"run `ds_report` ({reason or 'see its warning'}); JIT builds need g++ and, for CUDA ops, "
            "an nvcc matching torch.version.cuda")


def _arch_list_problem() -> str | None:
    """DeepSpeed's JIT builder parses TORCH_CUDA_ARCH_LIST as `X.Y[+PTX]` only: '9.0a' raises ValueError."""
    import torch

    tokens = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";")
    bad = [t for t in tokens if t.strip() and not re.fullmatch(r"\d+\.\d+(\+PTX)?", t.strip())]
    if not bad:
        return None
    here = sorted({"{}.{}".format(*torch.cuda.get_device_capability(i))
                   for i in range(torch.cuda.device_count())})
    here = here or sorted({re.sub(r"[a-z]+$", "", t.strip()) for t in tokens if t.strip()})
    return f"TORCH_CUDA_ARCH_LIST has {bad} that DeepSpeed cannot parse: export TORCH_CUDA_ARCH_LIST=" \
           f"\"{';'.join(here)}\" before training"


def check_op(name: str, reason: str = "", required: bool = True, build: bool = False) -> Result:
    """Is the op compatible here, already built (wheel or JIT cache), and with `build`, does it build?"""
    ops, installed_ops = _all_ops()
    label = f"op:{name}"
    why = f" (needed: {reason})" if reason else ""
    if name not in ops:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
        return Result("FAIL", label, f"DeepSpeed has no op {name!r} for the {accelerator} accelerator{why}",
                      f"use one of: {', '.join(sorted(ops))}")
    builder = ops[name]
    with contextlib.redirect_stdout(io.StringIO()):  # the builder prints its reason as a warning
        compatible = builder.is_compatible(verbose=True)
    if not compatible:
        status = "FAIL" if required else "WARN"
        detail = f"not compatible with this system{why}" + ("" if required else "; not needed by this run")
        return Result(status, label, detail, _op_fix(name, builder.error_log or ""))
    cache = _jit_cache(name)
    if (cache / "lock").exists():  # torch waits on this lock forever; a killed build leaves it behind
        return Result("WARN", label, f"a build lock {cache / 'lock'} exists{why}", "if no build is running "
                      f"(`pgrep -af ninja`), a killed build left it: `rm {cache / 'lock'}`, else wait for it")
    if installed_ops.get(name):
        state = "prebuilt in the DeepSpeed wheel"
    elif list(cache.glob("*.so")):
        state = f"built (JIT cache {cache})"
    else:
        from torch.utils.cpp_extension import verify_ninja_availability

        try:
            verify_ninja_availability()
        except RuntimeError:
            return Result("FAIL" if required else "WARN", label, f"not built and ninja is missing{why}",
                          "pip install ninja (DeepSpeed JIT-compiles ops with it)")
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder

        problem = _arch_list_problem() if isinstance(builder, CUDAOpBuilder) else None
        if problem:
            status = "FAIL" if required else "WARN"
            return Result(status, label, f"not built, and its JIT build will fail{why}", problem)
        state = "compatible, not built yet: JIT-compiles on first use (~1-2 min; --build-ops builds it now)"
    if not build:
        return Result("OK", label, state + why)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            builder.load(verbose=False)
    except (RuntimeError, ValueError, OSError, ImportError) as e:  # a compiler error is a RuntimeError
        last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
        return Result("FAIL", label, f"build failed{why}: {last[0]}", _op_fix(name, ""))
    return Result("OK", label, f"builds and loads ({time.perf_counter() - start:.1f} s){why}")
