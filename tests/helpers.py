"""What the tests share: paths, the split-vs-unsplit checks, problems and models built by hand.

The training-code patterns a capture must keep or refuse and the test models of
``torch.distributed.pipelining`` (``test/distributed/pipelining/model_registry.py``) are written
here from their published definitions at small sizes; each pattern model is small (width ``D``)
and takes ``x`` of shape (batch, ``D``).

Test modules import from here and never from one another; scripts a test runs in another
process (``torchrun``, ``python -c``) put ``ROOT`` on ``sys.path`` and import ``tests.helpers``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.pipelining import pipe_split

import autosplit
from autosplit.examples import GPT
from autosplit.microbatch import split_batch
from autosplit.options import SolverLimits
from autosplit.solver.evaluation import evaluate
from autosplit.solver.problem import Problem
from autosplit.solver.validate import violations
from benchmarks.workloads.models import GNMT, MLP, ConvBN, InceptionA, InceptionE, ResNet
from benchmarks.workloads.vision import make as make_vision

ROOT = Path(__file__).resolve().parents[1]
"""The repository: autosplit/, benchmarks/, examples/, tests/."""
GOLDEN = ROOT / "tests" / "golden"
"""Stored plans, cost tables and report renders."""

ADVICE_SHAPE = r"(?s).+\. Likely cause: .+\. Try: .+\."
"""Every error message: what went wrong, then why, then what to try."""


def says(excinfo, *names: str) -> None:
    """The error has the what → why → try shape and names each of ``names``."""
    text = str(excinfo.value)
    assert excinfo.match(ADVICE_SHAPE), f"message without what → why → try: {text!r}"
    for name in names:
        assert name in text, f"{name!r} not named in: {text}"


# -- split vs unsplit: outputs, gradients, optimizer steps ------------------------------------------


def where(prefix: str) -> Callable[[str], str]:
    """A ``msg=`` for ``torch.testing.assert_close``: ``prefix``, then torch's own message."""
    return lambda message: f"{prefix}: {message}"


def leaves(out):
    """Tensors of an output in a fixed order (dicts and transformers' ModelOutput by key)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "keys"):
        return [t for k in sorted(out.keys()) for t in leaves(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in leaves(o)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in leaves(getattr(out, f.name))]
    return []


def output_loss(out) -> torch.Tensor:
    """A loss that reads every floating-point tensor of an output."""
    return sum(t.float().pow(2).mean() for t in leaves(out) if t.is_floating_point())


def assert_same_step(out, expected, named_params, ref_params) -> None:
    """Outputs equal; after backward of the same loss on each, every gradient equal."""
    for a, b in zip(leaves(out), leaves(expected), strict=True):
        torch.testing.assert_close(a, b)
    output_loss(out).backward()
    output_loss(expected).backward()
    for (name, p), q in zip(named_params, ref_params):
        torch.testing.assert_close(p.grad, q.grad, msg=where(f"gradient of {name}"))


NO_SEARCH: dict[str, Any] = {"limits": SolverLimits(cpsat_vars=1)}
"""Plan options for tests of what a split computes, not of which split the planner finds: the plan is
the split DP's (exact over one topological order, found in milliseconds, the same on every run),
without CP-SAT's search from it, which on these small models runs to its time limit (1–2 s a plan)."""


def assert_trains_like(model, devices, inputs, kwargs=None, *, steps: int = 3, **options):
    """Split ``model`` (the split DP's plan, :data:`NO_SEARCH`, unless ``options`` say otherwise) and check
    outputs, gradients, parameters and buffers after ``steps`` Adam steps.

    Runs in float64, so the split and the original agree to rounding (they sum gradients
    in a different order) and default tolerances apply.
    """
    kwargs = kwargs or {}
    model = model.double()
    as64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    inputs = tuple(as64(t) for t in inputs)
    kwargs = {k: as64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    split = autosplit.autosplit(model, devices, example_inputs=inputs, example_kwargs=kwargs, **{**NO_SEARCH, **options})
    assert isinstance(split, autosplit.SplitModule)
    assert len(set(split.plan.assignment.values())) == len(devices), "every device gets a stage"

    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in split.named_parameters()] == names
    assert list(split.state_dict()) == list(reference.state_dict())
    opt_split = torch.optim.Adam(split.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(steps):
        assert_same_step(split(*inputs, **kwargs), reference(*inputs, **kwargs), split.named_parameters(), reference.parameters())
        opt_split.step(), opt_ref.step()
        opt_split.zero_grad(), opt_ref.zero_grad()
    for (name, a), b in zip(split.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=where(f"{name} after {steps} steps"))
    return split


# -- solver problems written by hand --------------------------------------------------------------


def make_problem(
    compute, edges, *, stages, transfer=None, state=None, act=None, recv=None, send=None, capacity=None,
    colocate=(), order_edges=(), micro_batches=1, latency=0,
) -> Problem:
    N, S = len(compute), stages
    per_stage = lambda v: tuple(tuple(x) if isinstance(x, (list, tuple)) else (x,) * S for x in v)  # noqa: E731
    return Problem(
        nodes=tuple(f"n{i}" for i in range(N)),
        labels=tuple(f"mod{i}" for i in range(N)),
        devices=tuple(f"dev{s}" for s in range(S)),
        compute=per_stage(compute),
        edges=tuple(edges),
        order_edges=tuple(order_edges),
        transfer=tuple((t,) * (S - 1) for t in (transfer or [0] * N)),
        boundary_latency=(latency,) * (S - 1),
        state_mem=tuple(state or [0] * N),
        act_mem=per_stage(act or [0] * N),
        recv_mem=per_stage(recv or [0] * N),
        send_mem=per_stage(send) if send else (),
        capacity=tuple(capacity or [10**9] * S),
        colocate=tuple(colocate),
        micro_batches=micro_batches,
    )


def valid(problem: Problem, stage_of: tuple[int, ...]) -> bool:
    """Whether ``stage_of`` breaks no rule: the rules that need no evaluation first (most assignments a brute force
    tries break one), then the memory caps (:func:`~autosplit.solver.validate.violations`)."""
    return not violations(problem, stage_of, memory=False) and not violations(problem, stage_of)


def brute_force(problem: Problem) -> int | None:
    """The best objective over every assignment that validates (None: infeasible)."""
    best = None
    for stage_of in itertools.product(range(problem.num_stages), repeat=len(problem.nodes)):
        if valid(problem, stage_of):
            obj = evaluate(problem, stage_of).objective
            best = obj if best is None else min(best, obj)
    return best


def chain(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n - 1)]


@st.composite
def random_problems(draw):
    n = draw(st.integers(3, 7))
    S = draw(st.integers(2, 3))
    edges = {(i, i + 1) for i in range(n - 1) if draw(st.booleans())}
    edges |= {(u, v) for u in range(n) for v in range(u + 2, n) if draw(st.integers(0, 4)) == 0}
    costs = st.integers(0, 20)
    compute = [[draw(costs) for _ in range(S)] for _ in range(n)]
    return make_problem(
        compute, sorted(edges), stages=S,
        transfer=[draw(st.integers(0, 6)) for _ in range(n)],
        state=[draw(st.integers(0, 5)) for _ in range(n)],
        act=[draw(st.integers(0, 3)) for _ in range(n)],
        recv=[draw(st.integers(0, 3)) for _ in range(n)],
        send=[draw(st.integers(0, 3)) for _ in range(n)],
        capacity=[draw(st.integers(4, 25)) for _ in range(S)],
        micro_batches=draw(st.integers(1, 6)),
        latency=draw(st.integers(0, 3)),
    )


# -- small models ------------------------------------------------------------------------------------


class LinearStack(nn.Module):
    """Four Linear layers of width 8 in a row."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x):
        return self.layers(x)


FAST_PROFILE = dict(warmup=1, repeats=2)
"""Profile options that measure each node quickly: one warm-up, two repeats."""


class ProfiledNet(nn.Module):
    """A big and a small layer, BatchNorm (state profiling must not disturb) and dropout (RNG)."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(256, 256)
        self.bn = nn.BatchNorm1d(256)
        self.small = nn.Linear(256, 4)

    def forward(self, x):
        return self.small(nn.functional.dropout(torch.relu(self.bn(self.big(x))), 0.1))


class TwoTowers(nn.Module):
    """Two independent towers of four Linear layers, joined at the end."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.left = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        self.right = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    def forward(self, x):
        return self.left(x) + self.right(x)


def small_gpt(batch: int = 2):
    """A three-layer GPT with tied embeddings and a batch of ``batch`` rows of 8 tokens."""
    return GPT(vocab=30, d_model=16, n_layers=3, n_heads=2, max_len=8), (torch.randint(0, 30, (batch, 8)),)


def seeded_gpt(layers=4):
    """A GPT of ``layers`` blocks and a batch of 4 rows, the same on every call (seed 0)."""
    torch.manual_seed(0)
    return GPT(vocab=64, d_model=16, n_layers=layers, n_heads=2, max_len=8), (torch.randint(0, 64, (4, 8)),)


# -- models that must train split exactly as unsplit ------------------------------------------------


class InceptionNet(nn.Module):
    """Stem conv, two Inception blocks with parallel towers joined by concat, classifier."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBN(3, 8, 3, padding=1)
        self.a = InceptionA(8, 8, 0.125)
        self.e = InceptionE(self.a.out, 0.0625)
        self.fc = nn.Linear(self.e.out, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.e(self.a(self.stem(x))), 1), 1))


class LSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 12)
        self.lstm = nn.LSTM(12, 16, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 7)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.out(self.norm(h))


class MultiHead(nn.Module):
    """Returns a dict holding a tensor and a tuple; in-place ops and a module used twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)  # called twice: its calls must share a device
        self.act = nn.ReLU(inplace=True)
        self.cls = nn.Linear(16, 3)
        self.reg = nn.Linear(16, 1)

    def forward(self, x, scale: float = 1.0):
        h = self.act(self.inp(x))
        h = self.shared(h)
        h.add_(1.0)  # a real in-place write (fx traces `h += 1` as an out-of-place add)
        g = self.shared(torch.tanh(h)) * scale
        return {"logits": self.cls(g), "aux": (self.reg(h), g.sum(-1))}


def padding_mask(batch: int, seq: int) -> torch.Tensor:
    """An attention mask of ones with the last row right-padded by 3 tokens."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 3 :] = 0  # right padding in the last row
    return mask


def _vision(name: str) -> Callable[[], tuple]:
    return lambda: (*make_vision(name, "tiny"), {})


ZOO: dict[str, Callable[[], tuple]] = {
    "mlp": lambda: (MLP((10, 24, 24, 24, 24, 3)), (torch.randn(6, 10),), {}),
    "cnn_batchnorm": lambda: (ResNet(blocks=(1, 1), width=4, num_classes=5), (torch.randn(3, 3, 16, 16),), {}),
    "inception": lambda: (InceptionNet(), (torch.randn(2, 3, 12, 12),), {}),
    "gpt_tied_mask": lambda: (
        GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8),
        (torch.randint(0, 40, (2, 8)),),
        {"attention_mask": padding_mask(2, 8)},
    ),
    "lstm": lambda: (LSTMTagger(), (torch.randint(0, 50, (3, 5)),), {}),
    "gnmt": lambda: (GNMT(vocab=30, hidden=8, layers=3), (torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 4))), {}),
    "dict_tuple_output": lambda: (MultiHead(), (torch.randn(4, 8),), {"scale": 0.5}),
    # torchvision-style CNNs (benchmarks/workloads/vision.py): in-place ReLU/ReLU6/SiLU, `out += identity`,
    # depthwise convolutions, squeeze-and-excitation, dense concatenation.
    **{name: _vision(name) for name in ("resnet50", "mobilenet_v2", "densenet121", "efficientnet_b0", "vgg11")},
}
"""Name → factory of (model, args, kwargs): the models every split must train exactly as unsplit."""


def gpt2_lm():
    """A two-layer GPT-2 LM head model of ``transformers``, eager attention, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=60, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


# -- the unsplit reference of a distributed run ---------------------------------------------------


def gpt_case():
    """A GPT with a padding mask: model, args, kwargs, target and loss of a global batch of 8."""
    model = GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8)
    tokens = torch.randint(0, 40, (8, 8))
    mask = torch.ones_like(tokens)
    mask[-1, -3:] = 0
    return model, (tokens,), {"attention_mask": mask}, torch.randint(0, 40, (8, 8)), lambda out, t: F.cross_entropy(
        out.flatten(0, 1), t.flatten()
    )


def as_float64(x):
    """A floating-point tensor in float64; anything else as it is."""
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def reference_step(model, args, kwargs, target, loss_fn, chunks: int):
    """Loss of the unsplit model on the batch, run in ``chunks`` micro-batches of the pipeline's
    size when that matters (BatchNorm), else whole; gradients accumulate as the full batch's mean."""
    losses = []
    for (a, k), t in zip(split_batch(args, kwargs, chunks), target.chunk(chunks)):
        loss = loss_fn(model(*a, **k), t) / chunks
        loss.backward()
        losses.append(loss.detach() * chunks)
    return torch.stack(losses).mean()


def full_tensor(t):
    """The whole tensor of a DTensor (FSDP); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- the width of the training-code patterns and of torch.distributed.pipelining's test models ---------


D = 8
"""The width of the pattern models and of their input ``x``, (batch, ``D``)."""


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


# -- gloo processes running cases ------------------------------------------------------------------


GRACE = 3.0
"""Seconds the other ranks have, once one rank's case failed, to report theirs before the group is stopped."""


PRELOADED = [
    "torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
    "torch.export", "autosplit", "tests.helpers", "tests.layouts", "tests.tp_cases", "transformers.models.llama.modeling_llama",
]
"""What the gloo groups' fork server imports before it forks a rank (one missing, transformers, is skipped)."""


class Gloo:
    """``world`` processes in one gloo process group (one thread each), kept for every case on that many
    processes: the ``gloo`` fixture of ``tests/conftest.py`` makes one per world size for the session.
    ``run(run_case, cases)`` runs ``run_case(*case, rank=, world=)`` on every rank, case after case, a
    barrier after each, and returns each case's values by rank.

    The processes are forked from a server that imported torch, autosplit, these helpers and what the
    cases import (:data:`PRELOADED`) once (``forkserver``), so a group starts in a fraction of a second
    and a case does not import transformers again on every rank (3 s each). A case that fails on any rank (or a
    rank that dies) fails the test, naming the case and showing each rank's traceback; the group is
    then stopped, and the next ``run`` starts a fresh one. After each case the ranks destroy every
    process group (the case's own and the default one) and start a default group again for the next.
    """

    def __init__(self, world: int, *, timeout: float = 60) -> None:
        import multiprocessing
        import tempfile

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOADED)
        self.world, self.timeout = world, timeout
        self._dir = tempfile.mkdtemp(prefix=f"gloo-{world}-")
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(world)]
        self._count = 0
        self._procs = [
            ctx.Process(target=_gloo_worker, args=(rank, world, f"{self._dir}/init", timeout, self._tasks[rank], self._results),
                        name=f"gloo rank {rank} of {world}", daemon=True)
            for rank in range(world)
        ]
        for proc in self._procs:
            proc.start()
        self.closed = False

    def run(self, run_case: Callable[..., object], cases: list[tuple]) -> list[list[object]]:
        """``run_case(*case, rank=, world=)`` for every case on every rank; ``[case][rank]``: what it returned."""
        assert not self.closed, "this group was stopped"
        try:
            return [self._run_one(run_case, tuple(case)) for case in cases]
        except BaseException:
            self.close(stop=True)  # a failed case, or the test interrupted (timeout): no rank is left waiting
            raise

    def _run_one(self, run_case: Callable[..., object], case: tuple) -> list[object]:
        import io
        import queue
        import time

        import pytest

        self._count += 1
        for tasks in self._tasks:
            tasks.put((self._count, run_case, case))
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        stop_at = None
        while len(values) + len(errors) < self.world:
            try:
                index, rank, error, value = self._results.get(timeout=0.5)
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if proc.exitcode is not None and rank not in values and rank not in errors:
                        errors[rank] = f"the process exited with code {proc.exitcode}"
                        stop_at = stop_at or time.monotonic() + GRACE
                if stop_at is not None and time.monotonic() > stop_at:
                    break
                continue
            if index != self._count:
                continue
            if error is None:
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = error
                stop_at = stop_at or time.monotonic() + GRACE
        if errors:
            name = f"{getattr(run_case, '__qualname__', run_case)}{case!r}"
            ranks = [f"-- rank {r}: {errors[r]}" if r in errors else f"-- rank {r}: " + (
                "passed" if r in values else f"no result within {GRACE:.0f} s of the failure (stopped)") for r in range(self.world)]
            pytest.fail(f"case {name} failed on {self.world} gloo processes:\n" + "\n".join(ranks), pytrace=False)
        return [values[r] for r in range(self.world)]

    def close(self, *, stop: bool = False) -> None:
        """Let every rank leave its process group and exit; ``stop``: end the processes at once."""
        import shutil

        if self.closed:
            return
        self.closed = True
        if not stop:
            for tasks in self._tasks:
                tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        self._results.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _gloo_worker(rank: int, world: int, init: str, timeout: float, tasks, results) -> None:
    import gc
    import io
    import os
    import sys
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    started = 0

    def start() -> None:
        nonlocal started
        started += 1
        dist.init_process_group("gloo", init_method=f"file://{init}.{started}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        # Every rank's connections made before any case runs: a case that ends the group at once would otherwise
        # close a socket its peer is still connecting through ("Gloo connectFullMesh failed ... closed by peer")
        dist.barrier()

    start()
    gc.freeze()  # torch's modules and the rest of the start: see below
    while (task := tasks.get()) is not None:
        index, run_case, case = task
        try:
            if not dist.is_initialized():  # the last case ended it
                start()
            torch.manual_seed(0)
            value = run_case(*case, rank=rank, world=world)
            if dist.is_initialized():
                dist.barrier()
                # Every group the case made (a mesh's dimensions, a pipeline's) and the default one: the next case
                # starts its own. A group left alive keeps its gloo threads polling; over a session's cases an idle
                # rank held 1,350 of them, and the machine spent 70% of its time in the kernel.
                dist.destroy_process_group()
            buffer = io.BytesIO()
            torch.save(value, buffer)
            results.put((index, rank, None, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 -- reported to the test, which fails naming the case
            results.put((index, rank, traceback.format_exc(), None))
        gc.collect()  # the case's pipelines, and their process groups, go now
        # What is left is the process's for good (modules, caches): no later collection need walk it again,
        # and every pipeline's close() collects (a full collection of a process that imported transformers
        # took a tenth of a multi-process test's time)
        gc.freeze()
    if dist.is_initialized():
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave at once: a native thread still running at interpreter exit can abort a rank that passed
    # ("terminate called without an active exception", SIGABRT; pytorch/pytorch#65513).
    os._exit(0)


def engine_round_trip(planner: Any, plan: Any, folder: Path) -> tuple[str, str]:
    """``plan`` exported to Megatron's flags and torchtitan's TOML (written under ``folder``), each read back by
    ``planner`` as the same plan: its mesh, its degrees, its assignment and its predicted step. Returns (flags, toml)."""
    flags, toml = plan.export("megatron"), plan.export("torchtitan")
    (folder / "job.toml").write_text(toml)
    for back in (planner.manual("megatron:" + flags), planner.manual(f"torchtitan:{folder / 'job.toml'}")):
        assert (back.mesh, back.expert_parallel, back.context_parallel, back.assignment) == (
            plan.mesh, plan.expert_parallel, plan.context_parallel, plan.assignment)
        assert back.step_time == pytest.approx(plan.step_time)
    return flags, toml
