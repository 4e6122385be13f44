"""harness.bench's model workloads (GPT-2, LLaMA from transformers configs):
at the tiny size, each column's backward gives eager's gradients; without
transformers they are skipped with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import cagrad
from harness.bench import model_workloads
from harness.bench.cli import main
from harness.bench.model_workloads import MODEL_WORKLOADS, build, unavailable
from harness.bench.subjects import SUBJECTS, backward_in
from harness.tolerance import tolerance_for

needs_transformers = pytest.mark.skipif(
    bool(unavailable("gpt2")), reason=f"model workloads: {unavailable('gpt2')}"
)

# torch_ca and inductor take 30 s to minutes per tiny model on a loaded
# 2-core machine (Dynamo traces the whole backward): cagrad[inductor] is a
# slow test (CI's slow pass runs it); the peers' columns are marked
# ``bench_peers``, out of both CI passes: ``pytest -m bench_peers`` runs them
FAST_COLUMNS = ("cagrad[eager]",)
SLOW_COLUMNS = ("cagrad[inductor]",)
PEER_COLUMNS = ("torch_ca[eager]", "torch.compile", "torch_ca[inductor]")


def _grads(workload) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in workload.params]


def _eager_grads(name: str) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    workload = build(name, "cpu", "tiny")
    loss = workload.step(workload.model)
    loss.backward()
    return loss.detach(), _grads(workload)


def _check_column(name: str, subject_name: str) -> None:
    """Two steps under the subject (the first captures, the second runs what
    the first compiled), each step's loss and every ``.grad`` (values and
    strides) against eager's on a model built from the same seed."""
    eager_loss, eager_grads = _eager_grads(name)
    assert all(g is not None for g in eager_grads)
    subject = SUBJECTS[subject_name]
    backend = "inductor" if subject_name == "torch.compile" or "inductor" in subject_name else "eager"
    torch._dynamo.reset()
    cagrad.reset()
    torch.manual_seed(0)
    workload = build(name, "cpu", "tiny")
    model = subject.wrap(workload.model)
    try:
        for step in range(2):
            loss = workload.step(model)
            tol = tolerance_for(torch.float32, backend)
            torch.testing.assert_close(loss.detach(), eager_loss, rtol=tol.rtol, atol=tol.atol_for(eager_loss))
            backward_in(subject, loss)
            for p_name, (param, expected) in zip(
                (n for n, _ in workload.model.named_parameters()), zip(workload.params, eager_grads)
            ):
                where = f"{name} / {subject_name}, step {step}, {p_name}.grad"
                assert param.grad is not None, where
                torch.testing.assert_close(
                    param.grad, expected, rtol=tol.rtol, atol=tol.atol_for(expected), msg=lambda m: f"{where}: {m}"
                )
                assert param.grad.stride() == expected.stride(), where
        if subject.is_cagrad:
            snap = cagrad.counters.snapshot()
            assert (snap["captures"], snap["cache_hits"], snap["fallbacks"]) == (1, 1, 0), snap
    finally:
        torch._dynamo.reset()
        cagrad.reset()


COLUMNS = [
    *FAST_COLUMNS,
    *(pytest.param(c, marks=pytest.mark.slow) for c in SLOW_COLUMNS),
    *(pytest.param(c, marks=pytest.mark.bench_peers) for c in PEER_COLUMNS),
]


@needs_transformers
@pytest.mark.parametrize("subject_name", COLUMNS)
@pytest.mark.parametrize("name", sorted(MODEL_WORKLOADS))
def test_each_column_gives_eagers_gradients(name, subject_name):
    _check_column(name, subject_name)


@needs_transformers
def test_tiny_sizes_are_the_models_suites_configs():
    from harness.models import hf_rows

    torch.manual_seed(0)
    gpt2 = build("gpt2", "cpu", "tiny").model
    assert (gpt2.config.n_layer, gpt2.config.n_embd, gpt2.config.vocab_size) == (
        hf_rows.LAYERS, hf_rows.HIDDEN, hf_rows.VOCAB,
    )  # fmt: skip
    assert gpt2.config.resid_pdrop == gpt2.config.attn_pdrop == gpt2.config.embd_pdrop == 0.0
    llama = build("llama", "cpu", "tiny").model
    assert (llama.config.num_hidden_layers, llama.config.num_key_value_heads) == (hf_rows.LAYERS, hf_rows.HEADS // 2)
    assert llama.config.attention_dropout == 0.0 and llama.training


def test_full_gpt2_is_gpt2_configs_defaults():
    cfg, batch, seq = model_workloads.GPT2_SIZES["full"]
    assert set(cfg) == {"resid_pdrop", "embd_pdrop", "attn_pdrop", "use_cache"}
    assert model_workloads.default_size("cuda") == "full" and model_workloads.default_size("cpu") == "small"


def test_a_model_workload_without_transformers_is_skipped_with_the_reason(monkeypatch, tmp_path):
    reason = "transformers is not installed (pip install -e '.[models]'; docs/models.md)"
    monkeypatch.setattr(model_workloads.libraries, "unavailable", lambda library: reason)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main, ["--workloads", "gpt2,chain50", "--subjects", "eager", "--iters", "1", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["skipped"] == {"gpt2": reason}
    assert set(data["cells"]) == {"chain50"} and data["cells"]["chain50"]["eager"]["ms"] > 0
    with pytest.raises(ImportError, match="transformers is not installed"):
        build("llama", "cpu", "tiny")


def test_bad_names_and_sizes_are_refused():
    with pytest.raises(KeyError, match="unknown workload 'gpt3'"):
        unavailable("gpt3")
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        build("mlp", "cpu", "huge")
    result = CliRunner().invoke(main, ["--workloads", "gpt2", "--size", "huge"])
    assert result.exit_code == 2 and "huge" in result.output
