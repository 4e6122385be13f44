"""Real-model workloads: GPT-2 and LLaMA from Hugging Face transformers.

Each model is built from its config class with random weights (nothing is
downloaded: ``HF_HUB_OFFLINE=1``, see :func:`harness.models.libraries.prepare_offline`)
by the models suite's builders (:func:`harness.models.hf_rows.gpt2_model`,
:func:`~harness.models.hf_rows.llama_model`), in float32 and train mode with
every dropout probability 0 (every subject then runs the same computation,
as the bench's other transformer workloads do) and ``use_cache=False``. The
step feeds one fixed batch of token ids (int64, ``batch x seq``, drawn from
the global RNG when the workload is built) as both ``input_ids`` and
``labels``; the loss is the model's own causal LM loss (cross-entropy of
each next token, a 0-dim float32 tensor).

Sizes (``--size``; default ``full`` on CUDA, ``small`` on CPU):

* ``tiny``: the models suite's rows' configs (2 layers, hidden 32, 4 heads,
  vocabulary 64; LLaMA with 2 KV heads), a batch of 2 x 8 tokens: tests.
* ``small``: 2 layers, hidden 256, 4 heads, vocabulary 8192 (LLaMA:
  intermediate 688), 2 x 128 tokens: a CPU run of a few minutes.
* ``full``: GPT-2 small as ``GPT2Config()`` gives it (12 layers, hidden 768,
  12 heads, vocabulary 50257); LLaMA with 4 layers, hidden 512, 8 heads (8
  KV heads), intermediate 1376, vocabulary 32000; 8 x 512 tokens.

A workload needs transformers (the ``models`` extra); :func:`unavailable`
says why it cannot be built here, and the bench skips it with that reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from harness.models import hf_rows, libraries

from .workloads import WORKLOADS, Workload

SIZES = ("tiny", "small", "full")

_GPT2_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
_LLAMA_NO_DROPOUT = dict(attention_dropout=0.0, use_cache=False)

#: size -> (config keyword arguments, batch, sequence length)
GPT2_SIZES: dict[str, tuple[dict, int, int]] = {
    "tiny": ({**hf_rows.GPT2_CONFIG, **_GPT2_NO_DROPOUT}, hf_rows.BATCH, hf_rows.SEQ),
    "small": (dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=256, **_GPT2_NO_DROPOUT), 2, 128),
    "full": (dict(_GPT2_NO_DROPOUT), 8, 512),  # GPT2Config()'s own sizes
}
LLAMA_SIZES: dict[str, tuple[dict, int, int]] = {
    "tiny": ({**hf_rows.LLAMA_CONFIG, **_LLAMA_NO_DROPOUT}, hf_rows.BATCH, hf_rows.SEQ),
    "small": (
        dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=688, vocab_size=8192, max_position_embeddings=256, **_LLAMA_NO_DROPOUT),
        2, 128,
    ),  # fmt: skip
    "full": (
        dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1376, vocab_size=32000, **_LLAMA_NO_DROPOUT),
        8, 512,
    ),  # fmt: skip
}


def default_size(device: str) -> str:
    """``full`` on CUDA, ``small`` elsewhere."""
    return "full" if device == "cuda" else "small"


def _causal_lm(build: Callable[[dict], nn.Module], sizes: dict, device: str, size: str | None) -> Workload:
    size = size or default_size(device)
    if size not in sizes:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
    config, batch, seq = sizes[size]
    model = build(config).to(device=device, dtype=torch.float32).train()
    ids = torch.randint(model.config.vocab_size, (batch, seq), device=device)
    params = list(model.parameters())

    def step(m: nn.Module) -> torch.Tensor:
        for p in params:
            p.grad = None
        return m(input_ids=ids, labels=ids).loss

    return Workload(model, step, params)


def gpt2(device: str, size: str | None = None) -> Workload:
    """``GPT2LMHeadModel`` at ``size`` (see the module docstring)."""
    return _causal_lm(hf_rows.gpt2_model, GPT2_SIZES, device, size)


def llama(device: str, size: str | None = None) -> Workload:
    """``LlamaForCausalLM`` at ``size`` (see the module docstring)."""
    return _causal_lm(hf_rows.llama_model, LLAMA_SIZES, device, size)


#: name -> ``build(device, size) -> Workload``; on request only (``--workloads``)
MODEL_WORKLOADS: dict[str, Callable[[str, str | None], Workload]] = {"gpt2": gpt2, "llama": llama}
#: every workload name ``--workloads`` accepts
KNOWN: dict[str, Callable] = {**WORKLOADS, **MODEL_WORKLOADS}


def unavailable(name: str) -> str | None:
    """Why workload ``name`` cannot be built here (transformers missing or
    failing to import), or None. Sets ``HF_HUB_OFFLINE=1`` for a model
    workload (and prepares torchvision's import:
    :func:`harness.models.libraries.prepare_torchvision`). Raises KeyError
    for an unknown name."""
    if name not in KNOWN:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(KNOWN)}")
    return libraries.unavailable("transformers") if name in MODEL_WORKLOADS else None


def build(name: str, device: str, size: str | None = None) -> Workload:
    """Workload ``name`` on ``device``. ``size`` (one of :data:`SIZES`, None:
    :func:`default_size`) applies to the model workloads; the others size
    by device alone.

    Raises:
        KeyError: unknown ``name``.
        ValueError: unknown ``size``.
        ImportError: a model workload where transformers cannot be
            imported (the reason :func:`unavailable` gives).
    """
    if name in MODEL_WORKLOADS:
        reason = unavailable(name)
        if reason:
            raise ImportError(reason)
        return MODEL_WORKLOADS[name](device, size)
    if size is not None and size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
    return WORKLOADS[name](device)
