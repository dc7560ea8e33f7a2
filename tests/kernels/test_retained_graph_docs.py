"""docs/kernels.md on a second backward through a retained graph, checked against torch (issue 49): PyTorch's own
compiled ``cross_entropy`` allows it (the docs said it refuses it, as our op does); our compiled loss refuses it by
default because its backward keeps the donated gradient buffers (our trade-off), and the remedy the docs name
(``donated_buffer = False``) is tested in test_ops_dynamic.py."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

from cppo_kernels import fused_cppo_loss

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kernels.md"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _paragraph() -> str:
    text = " ".join(DOCS.read_text(encoding="utf-8").split())
    start = text.index("A second backward through a retained graph")
    return text[start : text.index("- Shapes that change every step", start)]


def test_pytorch_s_compiled_cross_entropy_allows_a_retained_graph_as_the_docs_say():
    said = _paragraph()
    assert "compiled `cross_entropy` donates nothing and allows it" in said and "our trade-off" in said, said
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(12, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 12, (6,), generator=g)
    loss = torch.compile(lambda h, w, t: F.cross_entropy(h @ w.t(), t), fullgraph=True, backend="aot_eager")(h, w, t)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * first)


def test_our_compiled_loss_refuses_a_retained_graph_by_default_as_the_docs_say():
    assert "non-empty donated buffers" in _paragraph() and "donated_buffer = False" in _paragraph()
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(16, 8, generator=g, requires_grad=True)
    targets, adv = torch.randint(0, 16, (9,), generator=g), torch.randn(3, generator=g)
    cu, old = torch.tensor([0, 4, 4, 9]), -3.0 + torch.randn(9, generator=g)

    def loss(h, w):
        return fused_cppo_loss(h, w, targets, adv, cu_seqlens=cu, old_logprobs=old)[0]

    out = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=True)(h, w)
    with pytest.raises(RuntimeError, match="compiled with non-empty donated buffers"):
        out.backward(retain_graph=True)  # refused at once: its backward reuses the gradients it saved
