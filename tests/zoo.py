"""Models for the tests: training-code patterns a capture must keep or refuse, and the test models
of ``torch.distributed.pipelining`` (``test/distributed/pipelining/model_registry.py``), written
here from their published definitions at small sizes.

Each pattern model is small (width 8) and takes ``x`` of shape (batch, 8).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.pipelining import pipe_split

D = 8


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


# -- training-code patterns --------------------------------------------------------------------------


class FrozenBackbone(nn.Module):
    """Fine-tuning: the feature extractor runs under ``no_grad`` inside forward."""

    def __init__(self):
        super().__init__()
        self.backbone = _mlp(D, D, D)
        self.head = _mlp(D, D, 4)

    def forward(self, x):
        with torch.no_grad():
            features = self.backbone(x)
        return self.head(features)


class AutocastRegion(nn.Module):
    """Part of forward in bf16 under autocast; the output is bf16."""

    def __init__(self):
        super().__init__()
        self.a = _mlp(D, D, D)
        self.b = nn.Linear(D, 4)

    def forward(self, x):
        h = self.a(x).relu()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(h)


class GradReverse(torch.autograd.Function):
    """Gradient reversal (Ganin & Lempitsky 2015): identity forward, negated gradient."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class DomainAdversarial(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = _mlp(D, D, D)
        self.domain = _mlp(D, D, 2)

    def forward(self, x):
        return self.domain(GradReverse.apply(self.features(x), 0.5))


class RootHooks(nn.Module):
    """A forward pre-hook and a forward hook on the root module."""

    def __init__(self):
        super().__init__()
        self.a = _mlp(D, D, D)
        self.b = nn.Linear(D, 4)
        self.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
        self.register_forward_hook(lambda module, args, out: out + 1)

    def forward(self, x):
        return self.b(self.a(x))


class EMATeacher(nn.Module):
    """Mean teacher: the teacher's weights follow the student's inside forward."""

    def __init__(self, momentum: float = 0.9):
        super().__init__()
        self.student = _mlp(D, D, 4)
        self.teacher = _mlp(D, D, 4)
        self.momentum = momentum
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(self.momentum).add_(s, alpha=1 - self.momentum)
        return self.student(x) + self.teacher(x)


class MomentumEncoder(nn.Module):
    """MoCo's key encoder, updated through ``.data`` (no grad-mode region to see)."""

    def __init__(self):
        super().__init__()
        self.query = _mlp(D, D, D)
        self.key = _mlp(D, D, D)
        self.key.requires_grad_(False)

    def forward(self, x):
        for k, q in zip(self.key.parameters(), self.query.parameters()):
            k.data = k.data * 0.99 + q.data * 0.01
        return (self.query(x) * self.key(x).detach()).sum(-1)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _mlp(D, D, D)
        self.b = nn.Linear(D, 4)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)


class TensorDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _mlp(D, D, D)
        self.b = nn.Linear(D, 3)

    def forward(self, x, shift=torch.full((3,), 0.5)):  # noqa: B008 -- the pattern under test
        return self.b(self.a(x)) + shift


class Output(OrderedDict):
    """A dict-subclass output, as ``transformers``' ``ModelOutput`` is."""


@dataclasses.dataclass
class DataclassOutput:
    logits: torch.Tensor
    hidden: torch.Tensor


class TupleOutput(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


class StructuredOutput(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = _mlp(D, D, D)
        self.b = nn.Linear(D, 4)

    def forward(self, x):
        hidden = self.a(x)
        logits = self.b(hidden.relu())
        if self.kind == "dict":
            return Output(logits=logits, hidden=hidden)
        if self.kind == "dataclass":
            return DataclassOutput(logits=logits, hidden=hidden)
        return TupleOutput(logits, hidden)


PATTERNS = {
    "frozen backbone": FrozenBackbone,
    "gradient reversal": DomainAdversarial,
    "root hooks": RootHooks,
    "EMA teacher": EMATeacher,
    "tensor default": TensorDefault,
    "dict subclass output": lambda: StructuredOutput("dict"),
    "dataclass output": lambda: StructuredOutput("dataclass"),
    "named tuple output": lambda: StructuredOutput("namedtuple"),
}
"""Pattern models that take ``x`` alone and train in float64."""


# -- torch.distributed.pipelining's test models ------------------------------------------------------


class ExampleCode(nn.Module):
    """Parameters, a buffer crossing a split, and linear layers forward never reads."""

    def __init__(self, d_hid: int = D):
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.mm_param1 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.cval = nn.Buffer(torch.randn(d_hid))
        self.lin0 = nn.Linear(d_hid, d_hid)
        self.lin1 = nn.Linear(d_hid, d_hid)  # unused, as in torch's model with splits=2

    def forward(self, x):
        x = torch.relu(torch.mm(x, self.mm_param0))
        a_constant = self.cval.clone()
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + a_constant
        return torch.mm(x, self.mm_param1)


class ModelWithKwargs(nn.Module):
    """A tensor default argument (torch's default is a (256, 512) zero tensor)."""

    BATCH = 4

    def __init__(self, d_hid: int = D):
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.mm_param1 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.lin0 = nn.Linear(d_hid, d_hid)
        self.lin1 = nn.Linear(d_hid, d_hid)

    def forward(self, x, y=torch.zeros(BATCH, D)):  # noqa: B008 -- as torch defines it
        x = torch.relu(self.lin0(torch.mm(x, self.mm_param0) + y))
        pipe_split()
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


class ModelWithParamAlias(nn.Module):
    """One parameter and one module under two names each."""

    def __init__(self, d_hid: int = D):
        super().__init__()
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.lin1 = self.lin0 = nn.Linear(d_hid, d_hid)

    def forward(self, x, y):
        x = torch.relu(self.lin0(torch.mm(x, self.mm_param0) + y))
        pipe_split()
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


class MLPModule(nn.Module):
    def __init__(self, d_hid: int):
        super().__init__()
        self.net1 = nn.Linear(d_hid, d_hid)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(d_hid, d_hid)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MultiMLP(nn.Module):
    def __init__(self, d_hid: int = D, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(d_hid) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MLPKwargModule(MLPModule):
    def forward(self, x, unused_kwarg: torch.Tensor = torch.zeros(1)):  # noqa: B008 -- as torch defines it
        return super().forward(x)


class MultiMLPKwargs(nn.Module):
    """A tensor default argument that forward never reads."""

    def __init__(self, d_hid: int = D, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([MLPKwargModule(d_hid) for _ in range(n_layers)])

    def forward(self, x, unused_kwarg: torch.Tensor = torch.zeros(1)):  # noqa: B008 -- as torch defines it
        for layer in self.layers:
            x = layer(x)
        return x


class CustomLinearDxDw(torch.autograd.Function):
    """A linear layer with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x.mm(weight.t()) + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad.mm(weight), grad.t().mm(x), grad.sum(0)


class MLPModuleWithDw(nn.Module):
    """Custom autograd Functions; forward stores an activation on the module (``self.hidden``)."""

    def __init__(self, d_hid: int):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.randn(d_hid, d_hid) * 0.3)
        self.fc1_bias = nn.Parameter(torch.randn(d_hid) * 0.1)
        self.fc2_weight = nn.Parameter(torch.randn(d_hid, d_hid) * 0.3)
        self.fc2_bias = nn.Parameter(torch.randn(d_hid) * 0.1)

    def forward(self, x):
        self.hidden = torch.relu(CustomLinearDxDw.apply(x, self.fc1_weight, self.fc1_bias))
        return CustomLinearDxDw.apply(self.hidden, self.fc2_weight, self.fc2_bias)


class MultiMLPWithDw(nn.Module):
    def __init__(self, d_hid: int = D, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([MLPModuleWithDw(d_hid) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


PIPELINING = {
    "ExampleCode": (ExampleCode, 0),
    "ModelWithKwargs": (ModelWithKwargs, 0),
    "ModelWithParamAlias": (ModelWithParamAlias, 1),
    "MultiMLP": (MultiMLP, 0),
    "MultiMLPKwargs": (MultiMLPKwargs, 0),
    "MultiMLPWithDw": (MultiMLPWithDw, 0),
}
"""torch.distributed.pipelining's test models: name → (factory, extra (batch, D) tensor inputs)."""


def pipelining_inputs(name: str, batch: int = ModelWithKwargs.BATCH, seed: int = 0) -> tuple[torch.Tensor, ...]:
    _, extra = PIPELINING[name]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, D, generator=g) for _ in range(1 + extra))
