"""The seed papers' models and the other workloads, small but faithful (DESIGN §6).

No downloads, no torchvision. Every model has size knobs, so tests use tiny instances
and benchmarks real ones (``bench``: a training step in about a second on one CPU core,
for benchmarks that run the model). ``make(name, size)`` builds a model with example inputs.

- Inception-V3 (Szegedy et al. 2016): stem, InceptionA×3, B, C×4, D, E×2, parallel towers.
- GNMT (Wu et al. 2016): 8 + 8 LSTM layers, bottom encoder layer bidirectional, residual
  connections from the third layer up, attention from the first decoder layer fed to all.
- BigLSTM (Jozefowicz et al. 2016): large embedding, 2 LSTM layers with projection, softmax
  (full, or sampled as the paper trained it: ``SampledBigLSTM``).
- GNMT and BigLSTM can run their LSTMs on time pieces (:func:`recur`) and a full softmax in
  vocabulary slices (:class:`Sharded`): the same function, as their papers' model parallelism
  ran it, in a graph a planner can spread as a wavefront.
- GPT-style transformer with tied embeddings (``autosplit.examples.GPT``), a ResNet, an MLP,
  and a two-tower retrieval model (independent towers, for the makespan objective).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autosplit.examples import GPT

__all__ = ["InceptionV3", "GNMT", "BigLSTM", "SampledBigLSTM", "GPT", "ResNet", "MLP", "TwoTower", "make", "WORKLOADS"]


# -- Inception-V3 -------------------------------------------------------------------------
class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _c(ch: int, w: float) -> int:
    return max(4, int(ch * w))


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool: int, w: float):
        super().__init__()
        self.b1 = ConvBN(cin, _c(64, w), 1)
        self.b5 = nn.Sequential(ConvBN(cin, _c(48, w), 1), ConvBN(_c(48, w), _c(64, w), 5, padding=2))
        self.b3 = nn.Sequential(
            ConvBN(cin, _c(64, w), 1), ConvBN(_c(64, w), _c(96, w), 3, padding=1), ConvBN(_c(96, w), _c(96, w), 3, padding=1)
        )
        self.bp = ConvBN(cin, _c(pool, w), 1)
        self.out = _c(64, w) * 2 + _c(96, w) + _c(pool, w)

    def forward(self, x):
        pooled = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), pooled], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int, w: float):
        super().__init__()
        self.b3 = ConvBN(cin, _c(384, w), 3, stride=2)
        self.bd = nn.Sequential(
            ConvBN(cin, _c(64, w), 1), ConvBN(_c(64, w), _c(96, w), 3, padding=1), ConvBN(_c(96, w), _c(96, w), 3, stride=2)
        )
        self.out = _c(384, w) + _c(96, w) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.bd(x), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int, w: float):
        super().__init__()
        c7, o = _c(c7, w), _c(192, w)
        self.b1 = ConvBN(cin, o, 1)
        self.b7 = nn.Sequential(ConvBN(cin, c7, 1), ConvBN(c7, c7, (1, 7), padding=(0, 3)), ConvBN(c7, o, (7, 1), padding=(3, 0)))
        self.bd = nn.Sequential(
            ConvBN(cin, c7, 1), ConvBN(c7, c7, (7, 1), padding=(3, 0)), ConvBN(c7, c7, (1, 7), padding=(0, 3)),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)), ConvBN(c7, o, (1, 7), padding=(0, 3)),
        )
        self.bp = ConvBN(cin, o, 1)
        self.out = 4 * o

    def forward(self, x):
        pooled = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b7(x), self.bd(x), pooled], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int, w: float):
        super().__init__()
        self.b3 = nn.Sequential(ConvBN(cin, _c(192, w), 1), ConvBN(_c(192, w), _c(320, w), 3, stride=2))
        self.b7 = nn.Sequential(
            ConvBN(cin, _c(192, w), 1), ConvBN(_c(192, w), _c(192, w), (1, 7), padding=(0, 3)),
            ConvBN(_c(192, w), _c(192, w), (7, 1), padding=(3, 0)), ConvBN(_c(192, w), _c(192, w), 3, stride=2),
        )
        self.out = _c(320, w) + _c(192, w) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int, w: float):
        super().__init__()
        c3, c4 = _c(384, w), _c(448, w)
        self.b1 = ConvBN(cin, _c(320, w), 1)
        self.b3 = ConvBN(cin, c3, 1)
        self.b3a, self.b3b = ConvBN(c3, c3, (1, 3), padding=(0, 1)), ConvBN(c3, c3, (3, 1), padding=(1, 0))
        self.bd = nn.Sequential(ConvBN(cin, c4, 1), ConvBN(c4, c3, 3, padding=1))
        self.bda, self.bdb = ConvBN(c3, c3, (1, 3), padding=(0, 1)), ConvBN(c3, c3, (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, _c(192, w), 1)
        self.out = _c(320, w) + 4 * c3 + _c(192, w)

    def forward(self, x):
        a = self.b3(x)
        d = self.bd(x)
        pooled = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b3a(a), self.b3b(a), self.bda(d), self.bdb(d), pooled], 1)


class InceptionV3(nn.Module):
    """Inception-V3 with a channel-width multiplier ``width`` (1.0 = the paper's widths)."""

    def __init__(self, num_classes: int = 1000, width: float = 1.0):
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            ConvBN(3, _c(32, w), 3, stride=2), ConvBN(_c(32, w), _c(32, w), 3), ConvBN(_c(32, w), _c(64, w), 3, padding=1),
            nn.MaxPool2d(3, stride=2), ConvBN(_c(64, w), _c(80, w), 1), ConvBN(_c(80, w), _c(192, w), 3),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: list[InceptionA | InceptionB | InceptionC | InceptionD | InceptionE] = []
        cin = _c(192, w)
        for pool in (32, 64, 64):
            blocks.append(InceptionA(cin, pool, w))
            cin = blocks[-1].out
        blocks.append(InceptionB(cin, w))
        cin = blocks[-1].out
        for c7 in (128, 160, 160, 192):
            blocks.append(InceptionC(cin, c7, w))
            cin = blocks[-1].out
        blocks.append(InceptionD(cin, w))
        cin = blocks[-1].out
        for _ in range(2):
            blocks.append(InceptionE(cin, w))
            cin = blocks[-1].out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# -- recurrences in time pieces ---------------------------------------------------------------
def pieces(x: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """``x`` (batch, time, …) as ``chunks`` consecutive pieces along time (one piece: ``[x]``)."""
    if chunks == 1:
        return [x]
    parts = x.tensor_split(chunks, 1)
    return [parts[i] for i in range(chunks)]  # indexed, not iterated: torch.fx traces getitem


def joined(xs: list[torch.Tensor]) -> torch.Tensor:
    """The pieces of :func:`pieces` back as one sequence."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, 1)


def recur(lstm: nn.LSTM, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A unidirectional ``lstm`` over a sequence given as time pieces, its state carried from piece
    to piece: the outputs of one call on the whole sequence, computed as one call (one graph node)
    per piece. Split so, a stack of LSTMs placed layer by layer on different devices runs as a
    wavefront — layer i + 1 works on piece t while layer i works on piece t + 1 — which is how
    GNMT's layer-per-GPU model parallelism gains (Wu et al. 2016, §3.3); one node per layer would
    leave each device idle until the layer below has read the whole sequence."""
    out, state = [], None
    for x in xs:
        y, state = lstm(x) if state is None else lstm(x, state)
        out.append(y)
    return out


class Sharded(nn.Module):
    """A linear layer to ``features`` outputs as ``shards`` layers over consecutive slices of them
    (sizes as ``tensor_split``'s), outputs concatenated: one node per slice, which a planner may
    place on different devices. ``Sharded(i, o, s)(x) == nn.Linear(i, o)(x)`` for weights
    ``torch.cat([p.weight for p in self.parts])``."""

    def __init__(self, in_features: int, features: int, shards: int):
        super().__init__()
        sizes = [len(part) for part in torch.arange(features).tensor_split(shards)]
        self.parts = nn.ModuleList(nn.Linear(in_features, n) for n in sizes)

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts], -1)


# -- GNMT ---------------------------------------------------------------------------------
class Attention(nn.Module):
    """Normalized Bahdanau attention (GNMT §3)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, q, keys):
        scores = self.v(torch.tanh(self.query(q).unsqueeze(2) + self.key(keys).unsqueeze(1))).squeeze(-1)
        return torch.bmm(scores.softmax(-1), keys)


class GNMT(nn.Module):
    """GNMT: ``layers`` encoder + ``layers`` decoder LSTM layers, attention, residuals from layer 3.

    ``chunks``: every unidirectional layer (all but the bidirectional bottom encoder layer), the
    attention and the output layer run on that many time pieces (:func:`recur`). ``shards``: the
    output layer as that many layers over consecutive slices of the vocabulary, its logits
    concatenated (GNMT §3.3 partitions its softmax so, one part per GPU). Neither changes the
    function, only the graph a planner sees."""

    def __init__(self, vocab: int = 32000, hidden: int = 1024, layers: int = 8, chunks: int = 1, shards: int = 1):
        super().__init__()
        self.chunks = chunks
        self.src_emb = nn.Embedding(vocab, hidden)
        self.tgt_emb = nn.Embedding(vocab, hidden)
        self.enc0 = nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)
        self.enc = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers - 1))
        self.dec0 = nn.LSTM(hidden, hidden, batch_first=True)
        self.attn = Attention(hidden)
        self.dec = nn.ModuleList(nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(layers - 1))
        self.out = nn.Linear(hidden, vocab) if shards == 1 else Sharded(hidden, vocab, shards)

    def forward(self, src, tgt):
        x, _ = self.enc0(self.src_emb(src))  # bidirectional: it reads the whole source before any output
        xs = pieces(x, self.chunks)
        for i, lstm in enumerate(self.enc):
            ys = recur(lstm, xs)
            xs = [x + y for x, y in zip(xs, ys)] if i >= 1 else ys  # residuals start at the third encoder layer
        keys = joined(xs)
        ys = recur(self.dec0, pieces(self.tgt_emb(tgt), self.chunks))
        contexts = [self.attn(y, keys) for y in ys]
        for i, lstm in enumerate(self.dec):
            zs = recur(lstm, [torch.cat([y, c], -1) for y, c in zip(ys, contexts)])
            ys = [y + z for y, z in zip(ys, zs)] if i >= 1 else zs
        return joined([self.out(y) for y in ys])


# -- BigLSTM ------------------------------------------------------------------------------
class _LSTMBody(nn.Module):
    """BigLSTM's embedding and 2 projected LSTM layers (2048-512 in the paper), without a softmax;
    ``chunks`` as :class:`GNMT`'s; ``sparse``: the tables looked up with ``sparse=True``, their
    gradients the rows looked up, as the paper's AdaGrad updated them."""

    def __init__(self, vocab: int, embed: int, hidden: int, proj: int, chunks: int, sparse: bool = False):
        super().__init__()
        self.chunks = chunks
        self.emb = nn.Embedding(vocab, embed, sparse=sparse)
        self.lstm1 = nn.LSTM(embed, hidden, proj_size=proj, batch_first=True)
        self.lstm2 = nn.LSTM(proj, hidden, proj_size=proj, batch_first=True)

    def states(self, tokens) -> list[torch.Tensor]:
        """The top layer's outputs, in time pieces."""
        return recur(self.lstm2, recur(self.lstm1, pieces(self.emb(tokens), self.chunks)))


class BigLSTM(_LSTMBody):
    """BigLSTM: the LSTM body and a full softmax layer, in ``shards`` vocabulary slices as
    :class:`GNMT`'s (the released lm_1b graph keeps its softmax in 8)."""

    def __init__(self, vocab: int = 793471, embed: int = 512, hidden: int = 8192, proj: int = 1024, chunks: int = 1,
                 shards: int = 1, sparse: bool = False):
        super().__init__(vocab, embed, hidden, proj, chunks, sparse)
        self.softmax = nn.Linear(proj, vocab) if shards == 1 else Sharded(proj, vocab, shards)

    def forward(self, tokens):
        return joined([self.softmax(h) for h in self.states(tokens)])


class SampledBigLSTM(_LSTMBody):
    """BigLSTM as Jozefowicz et al. 2016 trained it: a softmax over each position's true word and
    ``candidates`` (8,192 words sampled per step and shared by the batch) only. The softmax table
    is an ``nn.Embedding`` (vocab × proj, and a bias column) looked up at those rows, so its
    gradient, like the input embedding's, is non-zero in those rows alone. ``candidates`` is shaped
    (1, samples), so that micro-batching never cuts it with the batch. Returns the logits
    (positions, 1 + candidates), the true word's first: the loss is ``cross_entropy(logits, 0)``.
    The sampler's log-probability correction and the removal of accidental hits are left out
    (elementwise on these logits: they change neither the shapes nor the cost to speak of)."""

    def __init__(self, vocab: int = 793471, embed: int = 512, hidden: int = 8192, proj: int = 1024, chunks: int = 1,
                 sparse: bool = False):
        super().__init__(vocab, embed, hidden, proj, chunks, sparse)
        self.softmax_w = nn.Embedding(vocab, proj, sparse=sparse)
        self.softmax_b = nn.Embedding(vocab, 1, sparse=sparse)

    def forward(self, tokens, targets, candidates):
        ids = torch.cat([targets.flatten(), candidates.flatten()])  # one lookup of every row the step touches
        w, b = self.softmax_w(ids), self.softmax_b(ids)
        batch, steps = targets.size(0), targets.size(1)
        n = batch * steps
        true_w = pieces(w[:n].reshape(batch, steps, -1), self.chunks)
        true_b = pieces(b[:n].reshape(batch, steps, 1), self.chunks)
        sampled_w, sampled_b = w[n:].t(), b[n:].t()  # (proj, samples), (1, samples): one view each, shared by the pieces
        logits = [torch.cat([(h * tw).sum(-1, keepdim=True) + tb, h @ sampled_w + sampled_b], -1)
                  for h, tw, tb in zip(self.states(tokens), true_w, true_b)]
        return joined(logits).flatten(0, 1)


# -- ResNet, MLP --------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


class ResNet(nn.Module):
    """ResNet with basic blocks; ``blocks=(2, 2, 2, 2)`` is ResNet-18."""

    def __init__(self, blocks=(2, 2, 2, 2), width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class MLP(nn.Module):
    def __init__(self, dims=(256, 512, 512, 512, 10)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class TwoTower(nn.Module):
    """A two-tower retrieval model (DSSM, Huang et al. 2013; Yi et al. 2019): a query tower and
    an item tower, MLPs over their own features, joined only at the end by the in-batch score
    matrix ``query @ item.T`` (train with cross-entropy against ``arange(batch)``: every other
    item in the batch is a negative). The towers are independent branches of one step."""

    def __init__(self, query_dim: int = 512, item_dim: int = 512, hidden: int = 2048, out: int = 256, layers: int = 3):
        super().__init__()

        def tower(dim: int) -> nn.Sequential:
            dims = [dim] + [hidden] * (layers - 1) + [out]
            mods: list[nn.Module] = []
            for a, b in itertools.pairwise(dims):
                mods += [nn.Linear(a, b), nn.ReLU()]
            return nn.Sequential(*mods[:-1])

        self.query = tower(query_dim)
        self.item = tower(item_dim)

    def forward(self, query: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return self.query(query) @ self.item(item).T


# -- registry -----------------------------------------------------------------------------
def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


WORKLOADS: dict[str, dict[str, Callable[[], tuple[nn.Module, tuple]]]] = {
    "inception_v3": {
        "tiny": lambda: (InceptionV3(num_classes=10, width=0.125), (torch.randn(2, 3, 75, 75),)),
        "real": lambda: (InceptionV3(), (torch.randn(32, 3, 299, 299),)),
        "bench": lambda: (InceptionV3(num_classes=100, width=0.25), (torch.randn(16, 3, 107, 107),)),
    },
    "gnmt": {
        "tiny": lambda: (GNMT(vocab=64, hidden=16, layers=4), (_tokens(64, 2, 6), _tokens(64, 2, 5))),
        "real": lambda: (GNMT(), (_tokens(32000, 64, 50), _tokens(32000, 64, 50))),
        "bench": lambda: (GNMT(vocab=4000, hidden=128, layers=4), (_tokens(4000, 16, 16), _tokens(4000, 16, 16))),
    },
    "biglstm": {
        "tiny": lambda: (BigLSTM(vocab=128, embed=16, hidden=32, proj=16), (_tokens(128, 2, 6),)),
        "real": lambda: (BigLSTM(), (_tokens(793471, 32, 20),)),
        "bench": lambda: (BigLSTM(vocab=20000, embed=128, hidden=512, proj=128), (_tokens(20000, 16, 16),)),
    },
    "gpt": {
        "tiny": lambda: (GPT(vocab=128, d_model=32, n_layers=2, n_heads=4, max_len=16), (_tokens(128, 2, 16),)),
        "real": lambda: (GPT(vocab=50257, d_model=768, n_layers=24, n_heads=12, max_len=1024), (_tokens(50257, 8, 1024),)),
        "bench": lambda: (GPT(vocab=4096, d_model=256, n_layers=4, n_heads=8, max_len=128), (_tokens(4096, 16, 128),)),
    },
    "resnet": {
        "tiny": lambda: (ResNet(blocks=(1, 1, 1, 1), width=8, num_classes=10), (torch.randn(2, 3, 32, 32),)),
        "real": lambda: (ResNet(), (torch.randn(64, 3, 224, 224),)),
        "bench": lambda: (ResNet(width=16, num_classes=100), (torch.randn(32, 3, 64, 64),)),
    },
    "two_tower": {
        "tiny": lambda: (TwoTower(16, 12, 32, 8, 3), (torch.randn(8, 16), torch.randn(8, 12))),
        "real": lambda: (TwoTower(1024, 1024, 4096, 512, 4), (torch.randn(1024, 1024), torch.randn(1024, 1024))),
        "bench": lambda: (TwoTower(), (torch.randn(256, 512), torch.randn(256, 512))),
    },
    "mlp": {
        "tiny": lambda: (MLP((16, 32, 32, 32, 4)), (torch.randn(4, 16),)),
        "real": lambda: (MLP((1024, 4096, 4096, 4096, 4096, 1000)), (torch.randn(256, 1024),)),
        "bench": lambda: (MLP((512, 2048, 2048, 2048, 2048, 100)), (torch.randn(128, 512),)),
    },
}


def make(name: str, size: str = "tiny") -> tuple[nn.Module, tuple]:
    """A benchmark model and its example inputs: ``make("gnmt", "tiny")``."""
    return WORKLOADS[name][size]()
