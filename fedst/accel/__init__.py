"""How a training or evaluation step uses the device: mixed precision, TF32, cuDNN autotuning,
fused optimizers, optional ``torch.compile``, and losses kept on the device between host syncs.

The config fields (``train.amp_dtype``, ``train.compile``, ``train.tf32``,
``train.cudnn_benchmark``, ``train.deterministic``; fedst/experiment/sections.py TrainConfig) are read
once where a site or the server sets up; everything below takes plain arguments. On the CPU every
choice here is a no-op (fp32, no scaler, unfused optimizers), so CPU results do not depend on these
settings. :func:`device_facts` reads back what a process really uses (device, card, autocast dtype,
TF32, cuDNN autotuning, deterministic algorithms, compile) for its start-of-run log line and the
run's ``device.jsonl``; :class:`PhasePeaks` and :func:`memory_usage` report resident and GPU memory.

The modules: precision.py (``train.amp_dtype`` -> :class:`Precision`), device.py (the device, its
CUDA settings and :class:`DeviceFacts`), steps.py (optimizers, compile, channels-last, the
optimizer step, :class:`LossLog`), compiled.py (a whole training iteration compiled, with static
input buffers and CUDA graphs under ``reduce-overhead``: :class:`CompiledStep`), transfer.py (a state's tensors to the host in one copy per
device, :func:`bulk_to_host`), memory.py (resident and GPU memory for the run log). Every
name is imported from ``fedst.accel``.

Layer: the root; imports fedst.config (ConfigError) and nothing else of fedst.

A site step with these helpers (the shape of fedst/federation/site.py and serq.py)::

    configure_device(device, tf32=cfg.tf32, cudnn_benchmark=cfg.cudnn_benchmark,
                     deterministic=cfg.deterministic)  # once
    precision = resolve_precision(cfg.amp_dtype, device)
    scaler = precision.grad_scaler()          # None unless fp16
    optimizer = torch.optim.AdamW(params, lr, weight_decay=wd, **fused_optimizer_options(device))
    losses = LossLog()
    for ...:
        with precision.autocast():
            loss = loss_fn(model(clips).float(), masks)
        optimizer_step(loss, optimizer, scaler, model.parameters(), max_grad_norm)
        losses.append(loss)                  # no .item(): stays on the device
    values = losses.values()                 # one host sync per phase
"""

from fedst.accel.compiled import FALLBACK_WINDOW, CompiledStep
from fedst.accel.device import (
    CUBLAS_WORKSPACE,
    DeviceFacts,
    configure_device,
    cuda_unavailable_reason,
    device_facts,
    device_name,
    resolve_device,
    set_tf32,
)
from fedst.accel.memory import REPLY_MEMORY_KEYS, PhasePeaks, memory_usage, release_free_memory
from fedst.accel.precision import (
    NATIVE_BF16_CAPABILITY,
    Precision,
    native_bf16,
    resolve_precision,
)
from fedst.accel.steps import (
    LossLog,
    apply_gradients,
    backward_pass,
    begin_step,
    clips_channels_last,
    first_non_finite,
    fused_optimizer_options,
    kept,
    match_parameter_layouts,
    maybe_compile,
    optimizer_step,
    use_channels_last,
    uses_cuda_graphs,
)
from fedst.accel.transfer import HostCopy, bulk_to_host, standalone
from fedst.schema.accel import AMP_DTYPES, COMPILE_MODES, CUDA_GRAPH_MODES, compile_mode

__all__ = [
    "AMP_DTYPES",
    "COMPILE_MODES",
    "CUBLAS_WORKSPACE",
    "CUDA_GRAPH_MODES",
    "FALLBACK_WINDOW",
    "NATIVE_BF16_CAPABILITY",
    "REPLY_MEMORY_KEYS",
    "CompiledStep",
    "DeviceFacts",
    "HostCopy",
    "LossLog",
    "PhasePeaks",
    "Precision",
    "apply_gradients",
    "backward_pass",
    "begin_step",
    "bulk_to_host",
    "clips_channels_last",
    "compile_mode",
    "configure_device",
    "cuda_unavailable_reason",
    "device_facts",
    "device_name",
    "first_non_finite",
    "fused_optimizer_options",
    "kept",
    "match_parameter_layouts",
    "maybe_compile",
    "memory_usage",
    "native_bf16",
    "optimizer_step",
    "release_free_memory",
    "resolve_device",
    "resolve_precision",
    "set_tf32",
    "standalone",
    "use_channels_last",
    "uses_cuda_graphs",
]
