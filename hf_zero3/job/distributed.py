"""Process-group set-up that the stock stack leaves to the user, done before TrainingArguments exist.

On a CPU-only machine DeepSpeed needs gloo initialised *before* TrainingArguments is created (else it
sees world size 1 and fails on batch math); a single process started without a launcher needs the
RANK/WORLD_SIZE/MASTER_* variables (else DeepSpeed looks for MPI); the DeepSpeed launcher leaves
OMP_NUM_THREADS unset, so every rank grabs every core and the run slows down ~3x; and DeepSpeed's CPU
all-reduce leaves its shared-memory buffers in /dev/shm after every run (`release_shm_buffer_names`).
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")


def free_port() -> int:
    """A TCP port that is free on this host right now (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class LaunchError(ValueError):
    """Launch settings, or a way of starting the processes, that cannot work; one line per problem, each naming
    its fix."""


MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
"""Set by mpirun/mpiexec (Open MPI, MPICH/Intel MPI, PMIx, MVAPICH), e.g. under `deepspeed --launcher openmpi`."""


def is_world_process_zero() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def launched_world_size() -> int | None:
    """The world size the launcher started, before any process group exists: None where only MPI or srun knows it."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if any(name in os.environ for name in MPI_VARIABLES) or int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return None
    return 1


def local_world_size(default: int) -> int:
    """Ranks on this node as the launcher says: DeepSpeed's launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE;
    `default` when neither does (one process, or a launcher that says nothing). LOCAL_SIZE first: on CPU, Accelerate
    sets LOCAL_WORLD_SIZE to 1 under DeepSpeed's launcher when the TrainingArguments are made."""
    text = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(text) if text else default


def gather_from_ranks(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's small `record`, ordered by rank, on every rank (all ranks call it at the same point); just
    `[record]` without a process group."""
    import torch.distributed as dist  # torch takes a second to import: the launcher and the CLI never gather

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def fail_together(problem: str | None, error: type[Exception]) -> None:
    """Raise `error` on every rank when any rank has a problem (all ranks call it at the same point): one rank
    raising alone would leave the others waiting in their next collective."""
    problems = list(dict.fromkeys(r["problem"] for r in gather_from_ranks({"problem": problem}) if r["problem"]))
    if problems:
        raise error("\n".join(problems))


def prepare_process_group(on_cpu: bool, use_deepspeed: bool, timeout_s: float | None = None) -> None:
    """Fill in single-process launcher variables and, on CPU, start DeepSpeed's gloo process group.

    `timeout_s` (the run's `ddp_timeout`): how long a collective waits for a rank that does not answer before it
    fails. The Trainer passes `ddp_timeout` on only to a process group it starts itself; the one started here
    would otherwise wait DeepSpeed's default of 30 minutes for a node whose network is cut."""
    from datetime import timedelta

    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "WORLD_SIZE" not in os.environ:
        if any(name in os.environ for name in MPI_VARIABLES):
            import importlib.util

            if importlib.util.find_spec("mpi4py") is None:
                raise LaunchError("this rank was started by MPI, which sets no RANK/WORLD_SIZE; DeepSpeed reads them "
                                  "through mpi4py, which is not installed: pip install mpi4py on every node")
            import deepspeed

            # MPI launchers set no RANK/WORLD_SIZE: DeepSpeed reads them from MPI and exports them.
            deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None, auto_mpi_discovery=True, **timeout)
        elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
            raise LaunchError("srun started several tasks but no launcher set RANK/WORLD_SIZE: start one task per "
                               "node running the DeepSpeed launcher (scripts/slurm/train.sbatch) or torchrun")
        else:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not on_cpu:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        local_ranks = local_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if use_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", **timeout)
        release_shm_buffer_names()


def shm_buffer_path(rank: int) -> Path:
    """The /dev/shm file of DeepSpeed's CPU all-reduce buffer of `rank` (deepspeed/ops/csrc/cpu/comm/shm.cpp)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer_names() -> None:
    """Remove this rank's all-reduce buffer name from /dev/shm once every rank has mapped the buffer.

    Why: DeepSpeed 0.19's CPU SHM all-reduce creates one ~69 MB buffer per rank in /dev/shm and never unlinks
    it, so every CPU run leaves RAM behind until reboot (300 runs filled a 24 GB test machine). Each rank maps
    every other rank's buffer while DeepSpeed initialises; after a barrier all have, so each rank unlinks its
    own name: the mappings stay valid, and the memory goes when the last rank exits, even on kill -9.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    shm_buffer_path(dist.get_rank()).unlink(missing_ok=True)


@contextmanager
def process_group_released(*clean_errors: type[BaseException]) -> Iterator[None]:
    """Tear the process group down, threads joined, when the body returns or raises one of `clean_errors`.

    Why: otherwise gloo's worker and transport threads and rank 0's TCPStore thread are still running when the
    interpreter exits, and the C++ objects that own them are destroyed (or not) in no set order while Python shuts
    down; a thread destroyed before it is joined aborts the process ("terminate called without an active
    exception", exit 134) instead of exiting with our code. `destroy_process_group` alone does not stop them: a
    ZeRO-3 model (parameters hold the group) lives on in reference cycles and in the failed frames' locals, so
    those are dropped and collected here, and the group's destructor joins its threads now.

    `clean_errors` are the errors every rank raises at the same point with no collective in flight. After any other
    error a peer may be inside a collective that a teardown would wait for, so the process exits as it is.
    """
    try:
        yield
    except clean_errors as error:
        traceback.clear_frames(error.__traceback__)  # the failed run's locals: model, trainer
        _tear_down_process_group()
        raise
    _tear_down_process_group()


def _tear_down_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        comm = sys.modules.get("deepspeed.comm.comm")
        if getattr(comm, "cdb", None) is not None:  # DeepSpeed's: also drops the groups it keeps (its world clone)
            comm.destroy_process_group()
        else:
            dist.destroy_process_group()
        gc.collect()  # the last references sit in cycles; the group's destructor joins its threads


def release_engine(trainer) -> None:
    """Destroy the Trainer's DeepSpeed engine once the run has done its last collective (Accelerate's
    `free_memory`, which the Trainer itself calls only before a new training).

    Why: ZeRO-3 hangs its gradient hooks on autograd nodes; their closures hold the optimizer and through it the
    engine, the model and the process groups. Python's collector cannot see into autograd nodes, so that cycle is
    never collected: the groups and their gloo threads lived on after `destroy_process_group` until the interpreter
    exit, where destroying them aborted a finished rank now and then ("terminate called without an active
    exception": exit 134, 250 under DeepSpeed's launcher). `engine.destroy()` removes the hooks, so the teardown's
    collection frees the engine and the groups, and their threads are joined before the interpreter exits.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.free_memory()
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:  # ZeRO-3 puts the model on this module-level stack when it sets up, and never pops it
        offload.FWD_MODULE_STACK[:] = [m for m in offload.FWD_MODULE_STACK if m is not trainer.model]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:  # a class-level lru_cache keyed by (coordinator, submodule): every layer, for ever
        method = coordinator.PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        for cell in [*(method.__closure__ or ()), None]:  # under DeepSpeed's instrument_w_nvtx wrapper
            cached = method if cell is None else cell.cell_contents
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    restore_torch_linear()


def restore_torch_linear() -> None:
    """Give torch.nn.functional.linear back once a ZeRO-3 run is over: `zero.Init` replaces it with DeepSpeed's
    `zero3_linear_wrap` (and the run with `model.zero3_linear`) for the rest of the process ("this will persist unless
    manually reset"), a function for partitioned weights that a later model in the same process (a notebook, a
    second `main`) without ZeRO-3 should not run through."""
    init = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(init, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    functional = sys.modules.get("torch.nn.functional")
    if original is not None and functional is not None:
        functional.linear = original


def exit_process(code: int) -> None:
    """End a training process with `code` once its work is done, skipping the C++ teardown of the interpreter.

    Why: a finished run tears its process groups down before this (`release_engine`, `process_group_released`:
    no gloo or TCPStore thread is left), but a rank that stops on an error that leaves them up (a non-finite run,
    a failed save: a peer may be inside a collective, so nothing waits for it) still has their threads running,
    and destroying those while Python shuts down can abort it ("terminate called without an active exception")
    with -6 instead of its code. Everything a normal exit does for Python still happens first: non-daemon threads
    (a Hub push, a log writer) are joined, atexit functions run and standard streams are flushed; only the static
    destructors are skipped."""
    threading._shutdown()  # what Python's own exit does: wakes idle executor workers, joins non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
