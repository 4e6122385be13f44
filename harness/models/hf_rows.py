"""Rows on Hugging Face transformers: GPT-2, BERT masked LM, LLaMA, T5 with
labels, ViT, and Mixtral (a mixture of experts) with each experts kernel;
LLaMA again under the library's gradient checkpointing (reentrant and not)
and under autocast (bfloat16 mixed precision), and GPT-2 with a
``torch.compile`` d forward.

Every model is built from its config class with random weights (no
download: :func:`harness.models.libraries.prepare_offline`), 2 layers,
hidden size 32, dropout on (the configs' own dropout probabilities, 0.1),
trained with AdamW (lr 1e-3) on batches of 2 sequences of 8 tokens from a
64-token vocabulary (16x16 images for ViT), drawn from the global RNG at
each step. The loss is the one the model computes from ``labels``.
"""

from __future__ import annotations

import torch

from harness.models.registry import row
from harness.models.row import Setup

BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS = 2, 8, 64, 32, 2, 4
LR = 1e-3
F64 = torch.float64

#: The Mixtral experts kernels compared: transformers' default
#: ``"grouped_mm"`` (``torch.nn.functional.grouped_mm`` over the tokens of
#: every expert at once; ``GroupedMmBackward0`` in the backward) and
#: ``"eager"`` (a Python loop over the experts that received tokens: its
#: graph and sizes depend on the routing, step by step). Chosen with
#: ``model.set_experts_implementation(...)`` (transformers/integrations/moe.py).
EXPERTS_KERNELS = ("grouped_mm", "eager")


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _tokens(device: torch.device, length: int = SEQ) -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, length), device=device)


def _causal_lm(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, forward=None) -> Setup:
    model = model.to(device=device, dtype=dtype).train()
    call = model if forward is None else forward

    def loss() -> torch.Tensor:
        ids = _tokens(device)
        return call(input_ids=ids, labels=ids).loss

    return Setup(model, _adamw(model), loss)


#: The rows' GPT-2 and LLaMA configs (``GPT2Config`` / ``LlamaConfig``
#: keyword arguments); ``harness.bench``'s model workloads build their tiny
#: size from them too.
GPT2_CONFIG = dict(vocab_size=VOCAB, n_positions=SEQ * 4, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS)
LLAMA_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS // 2,
    max_position_embeddings=SEQ * 4,
    attention_dropout=0.1,
)


def gpt2_model(config: dict) -> torch.nn.Module:
    """``GPT2LMHeadModel(GPT2Config(**config))``: random weights, torch's default
    dtype, on the CPU. Raises ImportError without transformers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**config))


def llama_model(config: dict) -> torch.nn.Module:
    """``LlamaForCausalLM(LlamaConfig(**config))``: random weights, torch's
    default dtype, on the CPU. Raises ImportError without transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**config))


@row("gpt2", "transformers", "GPT2LMHeadModel, 2 layers, float64, dropout 0.1, AdamW; 3 steps")
def gpt2(device: torch.device) -> Setup:
    return _causal_lm(gpt2_model(GPT2_CONFIG), device, F64)


@row(
    "gpt2_grad_accum",
    "transformers",
    "GPT-2 as in gpt2, 2 micro-batches per step (gradient accumulation), zero_grad(set_to_none=False): "
    "every backward adds into the .grad tensors it found; 2 steps",
    steps=2,
    micro_batches=2,
    set_to_none=False,
)
def gpt2_grad_accum(device: torch.device) -> Setup:
    return _causal_lm(gpt2_model(GPT2_CONFIG), device, F64)


@row(
    "gpt2_compiled_forward",
    "transformers",
    "GPT-2 as in gpt2, its forward torch.compile(backend='aot_eager'): the backward holds "
    "AOTAutograd's CompiledFunctionBackward; 3 steps",
)
def gpt2_compiled_forward(device: torch.device) -> Setup:
    model = gpt2_model(GPT2_CONFIG)
    compiled = torch.compile(model, backend="aot_eager")
    return _causal_lm(model, device, F64, forward=compiled)


@row(
    "bert_mlm",
    "transformers",
    "BertForMaskedLM, 2 layers, float64, dropout 0.1; 30% of tokens masked at random each step "
    "(labels -100 elsewhere); 3 steps",
)
def bert_mlm(device: torch.device) -> Setup:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ * 4,
    )
    model = BertForMaskedLM(cfg).to(device=device, dtype=F64).train()
    mask_id = VOCAB - 1

    def loss() -> torch.Tensor:
        ids = _tokens(device)
        masked = torch.rand(BATCH, SEQ, device=device) < 0.3
        masked[:, 0] = True  # at least one label per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return model(input_ids=torch.where(masked, torch.full_like(ids, mask_id), ids), labels=labels).loss

    return Setup(model, _adamw(model), loss)


#: transformers' LlamaRMSNorm computes in float32 whatever the model's
#: dtype (it upcasts the hidden states, then casts back): inductor's fused
#: kernels round it otherwise than eager's. On an H200 (torch 2.11, CUDA)
#: cagrad[inductor] and torch's compiled autograd with inductor both leave
#: a parameter 8.7e-8 from eager's after AdamW's first step, beyond the
#: float64 tolerance; the CPU kernels stay within it
LLAMA_COMPUTE = torch.float32


@row(
    "llama",
    "transformers",
    "LlamaForCausalLM, 2 layers, GQA (4 heads, 2 KV), float64 (RMSNorm in float32), attention dropout 0.1; 3 steps",
    compute_dtype=LLAMA_COMPUTE,
)
def llama(device: torch.device) -> Setup:
    return _causal_lm(llama_model(LLAMA_CONFIG), device, F64)


def _checkpointed_llama(device: torch.device, reentrant: bool) -> Setup:
    model = llama_model(LLAMA_CONFIG)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return _causal_lm(model, device, F64)


@row(
    "llama_ckpt_reentrant",
    "transformers",
    "LLaMA as in llama, model.gradient_checkpointing_enable(use_reentrant=True): each layer "
    "recomputed in a nested backward (CheckpointFunction); 3 steps",
    compute_dtype=LLAMA_COMPUTE,
)
def llama_ckpt_reentrant(device: torch.device) -> Setup:
    return _checkpointed_llama(device, True)


@row(
    "llama_ckpt_nonreentrant",
    "transformers",
    "LLaMA as in llama, model.gradient_checkpointing_enable(use_reentrant=False): saved-tensor "
    "hooks recompute each layer during the backward; 3 steps",
    compute_dtype=LLAMA_COMPUTE,
)
def llama_ckpt_nonreentrant(device: torch.device) -> Setup:
    return _checkpointed_llama(device, False)


@row(
    "llama_autocast",
    "transformers",
    "LLaMA as in llama with float32 parameters, its forward under torch.autocast(dtype=bfloat16) (mixed "
    "precision, the backward outside it: casts and bfloat16 matmuls); 3 steps",
    dtype=torch.float32,
    compute_dtype=torch.bfloat16,
)
def llama_autocast(device: torch.device) -> Setup:
    setup = _causal_lm(llama_model(LLAMA_CONFIG), device, torch.float32)
    forward = setup.loss

    def loss() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return forward()

    return Setup(setup.model, setup.optimizer, loss)


@row(
    "t5_labels",
    "transformers",
    "T5ForConditionalGeneration, 2+2 layers, float64, dropout 0.1; labels of 6 tokens "
    "(decoder inputs shifted from them); 3 steps",
)
def t5_labels(device: torch.device) -> Setup:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_heads=HEADS,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(cfg).to(device=device, dtype=F64).train()

    def loss() -> torch.Tensor:
        ids = _tokens(device)
        labels = torch.randint(1, VOCAB, (BATCH, 6), device=device)
        return model(input_ids=ids, labels=labels).loss

    return Setup(model, _adamw(model), loss)


@row(
    "hf_vit",
    "transformers",
    "ViTForImageClassification, 16x16 images in 4x4 patches, 2 layers, float64, dropout 0.1, 5 classes; 3 steps",
)
def hf_vit(device: torch.device) -> Setup:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=5,
    )
    model = ViTForImageClassification(cfg).to(device=device, dtype=F64).train()

    def loss() -> torch.Tensor:
        pixels = torch.randn(BATCH, 3, 16, 16, device=device, dtype=F64)
        labels = torch.randint(5, (BATCH,), device=device)
        return model(pixel_values=pixels, labels=labels).loss

    return Setup(model, _adamw(model), loss)


def _mixtral(device: torch.device, experts: str) -> Setup:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ * 4,
        attention_dropout=0.1,
        output_router_logits=True,  # the load-balancing loss joins the LM loss
    )
    model = MixtralForCausalLM(cfg)
    model.set_experts_implementation(experts)
    if model.config._experts_implementation != experts:
        raise RuntimeError(
            f"transformers kept experts_implementation={model.config._experts_implementation!r}, not {experts!r}"
        )
    # float32: torch.nn.functional.grouped_mm takes float32/bfloat16/float16 only
    return _causal_lm(model, device, torch.float32)


@row(
    "mixtral_grouped_mm",
    "transformers",
    "MixtralForCausalLM, 4 experts top-2, router aux loss, float32 (grouped_mm has no float64), "
    "experts_implementation='grouped_mm' (the default kernel); 3 steps",
    dtype=torch.float32,
)
def mixtral_grouped_mm(device: torch.device) -> Setup:
    return _mixtral(device, "grouped_mm")


@row(
    "mixtral_expert_loop",
    "transformers",
    "Mixtral as in mixtral_grouped_mm, experts_implementation='eager': a loop over the experts "
    "that got tokens (data-dependent graph and sizes); 3 steps",
    dtype=torch.float32,
)
def mixtral_expert_loop(device: torch.device) -> Setup:
    return _mixtral(device, "eager")
