"""``fadsl.attention``: attention without writing a spec. It picks the spec a target ships
for the GPU, the head dimension and the mask (``Target.shipped``: the tuned examples), loads
it on first use (built once, then cached like any spec) and calls it."""

from __future__ import annotations

from .. import targets
from .._data import data_dir
from .attention import FlashAttention, load

_LOADED: dict[str, FlashAttention] = {}


def _candidates(capability: tuple[int, int]) -> list[targets.Target]:
    """The targets that run on a GPU of ``capability``, the most specific first (a target
    of one architecture before one that runs on every newer GPU)."""
    found = [targets.get(name) for name in targets.names()]
    found = [t for t in found if t.capabilities.runs_on(capability)]
    return sorted(found, key=lambda t: (not t.capabilities.devices[1], t.capabilities.devices[0]))


def shipped_spec(capability: tuple[int, int], head_dim: int, causal: bool) -> str:
    """The example (its name under examples/) that fadsl.attention runs on a GPU of
    ``capability`` for ``head_dim`` and the mask; ValueError naming what no spec covers."""
    candidates = _candidates(capability)
    for target in candidates:
        if (head_dim, causal) in target.shipped:
            return target.shipped[head_dim, causal]
    gpu = f"compute capability {capability[0]}.{capability[1]}"
    if not candidates:
        raise ValueError(f"q is on a GPU of {gpu}; fadsl's kernels need 8.0 or newer")
    covered = sorted({key for t in candidates for key in t.shipped})
    dims = sorted({d for d, c in covered if c == causal})
    mask = "causal=True" if causal else "causal=False"
    raise ValueError(
        f"q.shape[-1] (head_dim) = {head_dim} with {mask}: no shipped spec covers it on a GPU "
        f"of {gpu} (head_dim {', '.join(map(str, dims)) or 'none'} with {mask}); write a spec "
        "for it (examples/ has the shipped ones) and call fadsl.load(spec)"
    )


def attention(
    q, k, v, causal: bool = False, softmax_scale: float | None = None, *, return_lse=False
):
    """softmax(q k^T * softmax_scale [+ causal mask]) v through a shipped spec for q's GPU.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim) in
    bf16 or fp16 on one CUDA device; heads_q a multiple of heads_kv (GQA, MQA). causal:
    FlashAttention's bottom-right aligned mask. softmax_scale: 1 / sqrt(head_dim) if None.
    Returns out, or (out, lse) with ``return_lse`` (lse: float32, natural log, shape
    (batch, heads_q, seqlen_q)). The same checks and messages as a loaded spec's call.
    """
    import torch

    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if q.dim() != 4:
        raise ValueError(
            f"q must be 4-d (batch, seqlen, heads, head_dim), got shape {tuple(q.shape)}"
        )
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    name = shipped_spec(torch.cuda.get_device_capability(q.device), q.shape[-1], causal)
    kern = _LOADED.get(name)
    if kern is None:
        text = data_dir("examples").joinpath(f"{name}.fa").read_text()
        kern = _LOADED[name] = load(text, verbose=False)
    return kern(q, k, v, softmax_scale, return_lse=return_lse)
