"""Which attention implementation a run calls on its target, and why not another.

`choose_attention` turns the user's choice ("auto" or one of `ATTENTION_CHOICES`) into the
implementation a step calls (`models.attention.IMPLEMENTATIONS`) for a target (`AttentionTarget`:
the platform and GPU generation the run compiles for) and the rows its batches hold (`Rows`):
"plain" (no segment ids), "padded" (one document per row, then padding: `data.pack: false`) or
"packed" (several documents per row: `data.pack: true`). An explicit choice that cannot run is
refused with the reason, before anything is built; the planner plans the same choice
(`memory/working_set.py`).

"auto" is cuDNN's fused kernel wherever it masks exactly what the rows need
(`cudnn_refusal` finds nothing against it): rows of one document by their lengths on any
cuDNN GPU ("cudnn_padded"), packed rows by cuDNN's packed layout on Hopper and later ("cudnn"),
and blockwise otherwise. A family's scores decide too (`ScoreForm`, `score_form`): neither fused
kernel takes a softcap (Gemma 2) or sinks (gpt-oss), Pallas takes no sliding window, and cuDNN's
packed layout (jax's private API) none either. cuDNN's public call takes a window
(`local_window_size`), but is not used with one (`WINDOWED_CUDNN_REFUSAL`): on an H200
(2026-11-28, `benchmarks/results/gpu_h200_2026-11-28.md`) Gemma-3-1B's step through it
disagreed with blockwise's (first gradient norm 0.577 against 0.909) while the same call alone,
at the same head dim and window, agreed within bf16 rounding; until a GPU shows the step equal,
a windowed model runs blockwise (its tiles skip what the window masks). Pallas is never chosen
by "auto": it has not been timed on a GPU here, and jax#24934 reports it slower than cuDNN on
Hopper; name it to use it.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax

from featherweight.errors import StepConfigError
from featherweight.models.attention import ATTENTION_CHOICES, PLAIN, ScoreForm
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import Rows, cudnn_packed_refusal


class AttentionTarget(NamedTuple):
    """What a step is compiled for: the platform ("cpu", "gpu", "tpu") and, for an NVIDIA GPU,
    its compute capability ("8.0" A100, "8.9" Ada, "9.0" H100); None elsewhere. Every function
    that chooses an attention or plans a step takes it as an argument (`featherweight plan
    --target h100` plans for an H100 on a machine without one); their default is this
    process's device (`of_device`).

    `local`: the step is built in this process for its own device, so a cuDNN call needs
    cuDNN's library to load here. A target named for planning (`plan --target h100`) is planned
    as `train` runs on it, where jax's CUDA wheels bring cuDNN: its library is not looked for
    in this process."""

    platform: str
    compute_capability: str | None = None
    local: bool = False

    @classmethod
    def of_device(cls, device: jax.Device | None = None) -> AttentionTarget:
        """The target of `device` (default: the first device, the one a run computes on)."""
        device = device or jax.devices()[0]
        return cls(device.platform, getattr(device, "compute_capability", None), local=True)

    @property
    def one_memory(self) -> bool:
        """Whether the device's memory is the host's (XLA:CPU): a byte placed on the host is a
        byte of the same memory, and moving it there saves nothing."""
        return self.platform == "cpu"

    @property
    def compiler(self) -> str:
        """The XLA compiler of the target ("xla-cpu", "xla-gpu"): whose working-set calibration
        a plan for it uses."""
        return f"xla-{self.platform}"

    @property
    def hopper_or_later(self) -> bool:
        """An NVIDIA GPU of compute capability 9.0 or later."""
        capability = self.compute_capability
        return capability is not None and int(capability.split(".")[0]) >= 9

    def __str__(self) -> str:
        if self.compute_capability is None:
            return self.platform
        return f"{self.platform} (compute capability {self.compute_capability})"


@functools.lru_cache(maxsize=1)
def cudnn_library_refusal() -> str | None:
    """Why this process cannot build cuDNN attention (None when it can): jax lowers a cuDNN call
    only where it can load cuDNN's library, which a machine compiling for a GPU without one (XLA's
    deviceless compiler, `jax[cuda12-local]`) need not have."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except (ImportError, RuntimeError) as error:
        return f"cuDNN's library cannot be loaded in this process ({error})"
    return None


def _nvidia_refusal(target: AttentionTarget, kernel: str) -> str | None:
    if target.platform != "gpu" or target.compute_capability is None:
        return f"{kernel} needs an NVIDIA GPU, the target is {target}"
    return None


def score_form(config: ModelConfig) -> ScoreForm:
    """How `config`'s family forms its attention scores, as far as a kernel must take it: the
    scale, the softcap, the window when any layer slides and it is shorter than the model's
    context (Phi-3.5-mini's 262,144 over 131,072 positions masks nothing), and its sinks."""
    window = config.sliding_window
    if config.windows == "none" or window >= config.max_position_embeddings:
        window = None
    return ScoreForm(config.attention_scale, config.attn_softcap, window, config.attention_sinks)


def _softcap_refusal(form: ScoreForm, kernel: str) -> str | None:
    """Why `kernel` cannot form these scores: a softcap, or sinks (neither fused kernel takes
    either); None when it can."""
    if form.sinks:
        return f"{kernel} takes no attention sinks (this model's softmax has a sink per head)"
    if form.softcap is None:
        return None
    return (
        f"{kernel} takes no softcap on the attention scores (this model caps them at "
        f"{form.softcap:g}: attn_logit_softcapping)"
    )


WINDOWED_CUDNN_REFUSAL = (
    "cuDNN's attention is not used with a sliding window (this model's is {window}): on an H200 a "
    "windowed model's step through it did not match blockwise's gradients; use blockwise"
)


def cudnn_refusal(
    target: AttentionTarget,
    dtype: str,
    head_dim: int,
    rows: Rows,
    backward: bool = True,
    check_library: bool = True,
    form: ScoreForm = PLAIN,
) -> str | None:
    """Why cuDNN's fused attention cannot run this call exactly (None when it can): an NVIDIA GPU,
    bf16 or fp16, head dim a multiple of 8 and <= 128 (<= 256 on Hopper and later; Ampere/Ada's
    backward stops at 128), causal, scores without a softcap, sinks or sliding window (`form`;
    the window: module docstring); packed rows only on Hopper and later, through a jax whose
    private cuDNN API takes the packed layout; and (`check_library`) cuDNN's library loadable here,
    for the call to be built at all."""
    refusal = _nvidia_refusal(target, "cuDNN") or _softcap_refusal(form, "cuDNN's fused attention")
    if refusal:
        return refusal
    if dtype not in ("bfloat16", "float16"):
        return f"cuDNN's fused attention needs bfloat16 or float16, the dtype is {dtype}"
    limit = 256 if target.hopper_or_later else 128
    if head_dim % 8 or head_dim > limit:
        why = (
            ""
            if target.hopper_or_later or head_dim > 256
            else " (Ampere/Ada: the backward stops at 128)"
        )
        work = "training" if backward else "the forward pass"
        return (
            f"head dim {head_dim} is not a multiple of 8 up to {limit} on {target}{why} for {work}"
        )
    if rows == "packed" and not target.hopper_or_later:
        return (
            f"cuDNN keeps packed rows apart only on Hopper and later, the target is {target}; "
            "set data.pack: false (one document per row) or use blockwise"
        )
    if rows == "packed" and cudnn_packed_refusal():
        return cudnn_packed_refusal()
    if form.window is not None:
        return WINDOWED_CUDNN_REFUSAL.format(window=form.window)
    return cudnn_library_refusal() if check_library else None


def pallas_refusal(target: AttentionTarget, head_dim: int, form: ScoreForm = PLAIN) -> str | None:
    """Why jax's Pallas Triton flash attention cannot run on `target` (None when it can): an
    NVIDIA GPU (elsewhere it runs only in interpret mode, for tests), a head dim that is a
    power of two from 16 (the kernel's tiles are powers of two), and scores with no softcap,
    sinks or sliding window (`form`: the kernel takes none of them)."""
    kernel = "the Pallas (Triton) attention kernel"
    refusal = _nvidia_refusal(target, kernel) or _softcap_refusal(form, kernel)
    if refusal:
        return refusal
    if form.window is not None:
        return f"{kernel} takes no sliding window (this model's is {form.window})"
    try:
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError as error:
        return f"this jax ({jax.__version__}) has no Pallas GPU attention ({error})"
    wanted = ("segment_ids", "sm_scale", "causal", "block_sizes", "interpret")
    missing = [name for name in wanted if name not in inspect.signature(attention.mha).parameters]
    if missing:
        return f"this jax's ({jax.__version__}) Pallas attention `mha` lacks {', '.join(missing)}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the Pallas attention kernel needs a head dim that is a power of two from 16, not {head_dim}"
    return None


def choose_attention(
    choice: str,
    target: AttentionTarget,
    dtype: str,
    head_dim: int,
    rows: Rows,
    backward: bool = True,
    check_library: bool = True,
    form: ScoreForm = PLAIN,
) -> str:
    """The implementation `choice` means on `target` for batches of `rows` of a model whose
    scores are formed as `form` (`score_form`): "auto" is cuDNN where
    `cudnn_refusal` finds nothing against it and blockwise otherwise; an explicit choice is
    kept (cudnn as "cudnn_padded" for rows of one document), or refused with the reason when it
    cannot run (`StepConfigError`). `check_library=False` decides for the target alone, as if
    cuDNN's library were here (the choice table; a target's own machine)."""
    if choice == "flash":
        raise StepConfigError(
            "memory.attention: flash is gone (it only changed the plan); use blockwise (tiled "
            "attention on every backend), cudnn or pallas (NVIDIA GPUs) or auto"
        )
    if choice not in ATTENTION_CHOICES:
        raise StepConfigError(
            f"memory.attention={choice!r} is unknown; use one of {', '.join(ATTENTION_CHOICES)}"
        )
    cudnn = "cudnn_padded" if rows == "padded" else "cudnn"
    if choice == "auto":
        refusal = cudnn_refusal(target, dtype, head_dim, rows, backward, check_library, form)
        return "blockwise" if refusal else cudnn
    refusal = {
        "cudnn": lambda: cudnn_refusal(
            target, dtype, head_dim, rows, backward, check_library, form
        ),
        "pallas": lambda: pallas_refusal(target, head_dim, form),
    }.get(choice, lambda: None)()
    if refusal:
        raise StepConfigError(f"memory.attention={choice} cannot run: {refusal}")
    return cudnn if choice == "cudnn" else choice
