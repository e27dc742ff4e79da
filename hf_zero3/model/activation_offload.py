"""Activation offloading to host memory for HF causal LMs under the stock Trainer: what DeepSpeed's
`activation_checkpointing.cpu_checkpointing` promises, made real for models that never call DeepSpeed's
checkpointing API.

How it works. `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves for backward. While the
decoder stack (`model.get_decoder()`, e.g. `LlamaModel`) runs forward in training mode, each saved tensor of at least
`min_bytes` is copied to pinned host memory on a side CUDA stream (overlapping compute) and the GPU copy is freed once
that copy is done. In backward, when autograd asks for a tensor, it is copied back on a second side stream, and the
tensors saved just before it (which backward needs next) are prefetched, so the copies overlap the compute.

* With gradient checkpointing (HF's, non-reentrant: `torch.utils.checkpoint` saves each layer's inputs through
  autograd, outside the layer's own recompute hooks) the tensors saved are the checkpointed layer inputs (plus the
  final norm's): exactly the activation memory that grows with layers x tokens. It moves to the host; a few layer
  inputs are on the GPU at a time in backward. Measured (8B, 2 x H200,
  benchmarks study activation-offload): none left after forward, ~4 at the backward peak,
  no throughput cost at 4k and 16k tokens.
* Without checkpointing every saved tensor above `min_bytes` moves: far more bytes, so PCIe bound; the planner says so.

Why wrap the decoder's `forward` (one instance attribute, undone by `disable`) and nothing else:
* the Trainer stays stock: `compute_loss` runs inside `Trainer.training_step`, where no callback reaches; the model's
  forward is the one place every training forward passes, under DeepSpeed, torchrun or a plain script alike;
* the hooks are only active during the decoder's forward; unpacking needs no context (the packed objects carry what
  they need), so backward, the optimizer step and evaluation (`model.eval()` or no grad: the wrapper steps aside) are
  untouched;
* the lm_head and the loss stay outside: their saved tensors (the logits, Liger's in-forward gradients) are needed
  first in backward, so moving them would only add PCIe time.

ZeRO-3: parameters are gathered and released by DeepSpeed's module hooks, and autograd saves the weight tensors of
linear layers. Those are never copied: `nn.Parameter`s, views of one, and anything carrying DeepSpeed's `ds_id`
are kept as they are (torchtune's OffloadActivations skips parameters for the same reason).

On CPU (the tests) "offloading" copies each saved tensor into a separate buffer and backward reads it from there:
the same hook path, pack, dedupe, unpack, measured by `stats`, without streams.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_MIN_BYTES = 64 * 1024
"""Smaller saved tensors stay where they are: a copy costs a few microseconds of launch whatever its size."""
PREFETCH_FACTOR = 2
"""In backward, tensors saved before the one needed now are fetched until their bytes reach this many times its
size: with checkpointing, the next two layer inputs are on their way while this layer is recomputed."""


@dataclass
class OffloadStats:
    """What the hooks moved: tensors and bytes in the last forward, host bytes held now and at most."""

    tensors: int = 0
    bytes: int = 0
    """Bytes copied to the host in the last forward (deduplicated: a tensor saved twice is copied once)."""
    host_bytes: int = 0
    """Host bytes held now (released as backward frees the saved tensors)."""
    peak_host_bytes: int = 0
    kept_params: int = 0
    """Parameter tensors (ZeRO-3 gathers them) seen and left alone in the last forward."""


class _Packed:
    """One offloaded tensor: its host copy, and on the GPU path the copy events and the fetched tensor."""

    __slots__ = (
        "__weakref__",
        "device",
        "gpu",
        "host",
        "index",
        "nbytes",
        "order",
        "owner",
        "ready",
        "saved_event",
        "shared",
        "used",
    )

    def __del__(self):
        if self.host is not None:
            self.owner._release(self.nbytes)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._is_view() else None
    return (isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter) or hasattr(t, "ds_id")
            or (base is not None and hasattr(base, "ds_id")))


class ActivationOffloader:
    """Saved-tensor hooks that keep saved activations in host memory (see the module docstring).

    Args:
        min_bytes: smaller saved tensors stay on their device.
        use_streams: on CUDA, copy on side streams (False: synchronous copies, for debugging).
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, use_streams: bool = True):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0 (got {min_bytes})")
        self.min_bytes, self.use_streams = min_bytes, use_streams
        self.stats = OffloadStats()
        self._seen: dict[tuple, tuple[Any, int, _Packed]] = {}
        self._order: list[weakref.ref] = []
        self._streams: dict[Any, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    # -- accounting ----------------------------------------------------------------------------------
    def _hold(self, nbytes: int) -> None:
        self.stats.host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)

    def _release(self, nbytes: int) -> None:
        self.stats.host_bytes -= nbytes

    def reset_peak(self) -> None:
        self.stats.peak_host_bytes = self.stats.host_bytes

    # -- the hooks -----------------------------------------------------------------------------------
    def context(self):
        """The hooks for one forward: `with offloader.context(): out = module(...)`."""
        return _Forward(self)

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.device.type not in ("cuda", "cpu") or t.numel() * t.element_size() < max(
                1, self.min_bytes):
            return False
        if _is_parameter(t):
            self.stats.kept_params += 1
            return False
        return True

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloadable(t):
            return t
        # The same memory saved again (a tensor used by two ops, or a view of one, like RoPE's cos in every layer) is
        # copied once. While the tensor it is a view of is alive, its memory cannot have been handed to another.
        root = t._base if t._is_view() else t
        key = (id(root), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is root and seen[1] == t._version:
            seen[2].shared = True
            return seen[2]
        p = _Packed()
        p.host = None  # set with the accounting below: `__del__` releases only what was held
        p.device, p.gpu, p.ready, p.shared, p.used, p.owner = t.device, None, None, False, False, self
        p.nbytes, p.saved_event = t.numel() * t.element_size(), None
        if t.is_cuda and self.use_streams:
            d2h, _ = self._side_streams(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            d2h.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(d2h):
                host.copy_(t, non_blocking=True)
                p.saved_event = torch.cuda.Event()
                p.saved_event.record(d2h)
            t.record_stream(d2h)  # the allocator reuses t's memory only after the copy
        else:  # CPU, or synchronous: a separate host buffer
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t)
        p.index, p.order = len(self._order), self._order
        self._order.append(weakref.ref(p))
        self._seen[key] = (weakref.ref(root), t._version, p)
        self.stats.tensors += 1
        self.stats.bytes += p.nbytes
        p.host = host
        self._hold(p.nbytes)
        return p

    def _unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, _Packed):
            return p
        p.used = True
        if p.device.type != "cuda":
            return p.host
        if not self.use_streams:
            return p.host.to(p.device)
        if p.gpu is None:
            self._fetch(p)
        self._prefetch(p)
        torch.cuda.current_stream(p.device).wait_event(p.ready)
        out = p.gpu
        if not p.shared:  # a tensor saved once is unpacked once: autograd holds it from here
            p.gpu = None
        return out

    # -- CUDA copies ---------------------------------------------------------------------------------
    def _side_streams(self, device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _fetch(self, p: _Packed) -> None:
        _, h2d = self._side_streams(p.device)
        gpu = torch.empty(p.host.shape, dtype=p.host.dtype, device=p.device)  # on the compute stream
        h2d.wait_stream(torch.cuda.current_stream(p.device))
        h2d.wait_event(p.saved_event)
        with torch.cuda.stream(h2d):
            gpu.copy_(p.host, non_blocking=True)
            p.ready = torch.cuda.Event()
            p.ready.record(h2d)
        gpu.record_stream(h2d)
        p.gpu = gpu

    def _prefetch(self, p: _Packed) -> None:
        """Fetch the tensors saved just before `p` (backward runs in reverse) up to PREFETCH_FACTOR x its bytes."""
        ahead, i = 0, p.index - 1
        while i >= 0 and ahead < PREFETCH_FACTOR * p.nbytes:
            q = p.order[i]()
            i -= 1
            if q is None or q.used:
                continue
            if q.gpu is None:
                self._fetch(q)
            ahead += q.nbytes


class _Forward:
    """The saved-tensor hooks for one forward; the dedupe table lives only as long as the forward."""

    def __init__(self, offloader: ActivationOffloader):
        self.offloader = offloader
        self.hooks = torch.autograd.graph.saved_tensors_hooks(offloader._pack, offloader._unpack)

    def __enter__(self):
        o = self.offloader
        o._seen, o._order = {}, []
        o.stats.tensors = o.stats.bytes = o.stats.kept_params = 0
        self.hooks.__enter__()
        return o

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.offloader._seen = {}
        return False


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of an HF causal LM (`LlamaModel` in `LlamaForCausalLM`); the model itself otherwise."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except (AttributeError, ValueError, NotImplementedError):
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def enable(model: torch.nn.Module, min_bytes: int = DEFAULT_MIN_BYTES, use_streams: bool = True) -> ActivationOffloader:
    """Offload the activations the decoder saves in every training forward (model.training and grad enabled).

    Works for `hf-zero3 train` and for any script that builds a stock `Trainer`: call it on the model before
    `Trainer(...)`. Returns the offloader (its `stats` say what moved); `disable(model)` undoes it.
    """
    decoder = decoder_of(model)
    if getattr(decoder, "_hf_zero3_offloader", None) is not None:
        return decoder._hf_zero3_offloader
    offloader = ActivationOffloader(min_bytes, use_streams)
    original = decoder.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not (decoder.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        with offloader.context():
            return original(*args, **kwargs)

    decoder.forward = forward
    decoder._hf_zero3_offloader = offloader
    return offloader


def disable(model: torch.nn.Module) -> None:
    """Undo `enable`: the decoder's own forward again."""
    decoder = decoder_of(model)
    if getattr(decoder, "_hf_zero3_offloader", None) is not None:
        del decoder.forward  # the instance attribute; the class's forward shows through again
        del decoder._hf_zero3_offloader
