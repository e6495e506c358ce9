"""Vision workloads: CNNs written from their published definitions, torchvision-style.

No downloads, no torchvision. Each model follows torchvision's layout (module names,
in-place activations, ``out += identity``), so the graphs autosplit sees are the ones users
feed it. Every model has size knobs: tests use tiny instances, benchmarks real ones (the
defaults are the published sizes).

- ResNet-50 (He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016):
  bottleneck blocks (1×1, 3×3, 1×1, expansion 4), stage depths (3, 4, 6, 3).
- MobileNetV2 (Sandler, Howard, Zhu, Zhmoginov & Chen, "MobileNetV2: Inverted Residuals and
  Linear Bottlenecks", CVPR 2018): inverted residuals, depthwise 3×3, ReLU6, the (t, c, n, s) table.
- DenseNet-121 (Huang, Liu, van der Maaten & Weinberger, "Densely Connected Convolutional
  Networks", CVPR 2017): dense blocks (6, 12, 24, 16), growth rate 32, bottleneck size 4,
  compression 0.5 in the transitions.
- EfficientNet-B0 (Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
  Networks", ICML 2019): MBConv with SiLU and squeeze-and-excitation. Stochastic depth is
  omitted (it draws random numbers per step, so a split and an unsplit model could not agree).
- VGG-11 (Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
  Recognition", ICLR 2015): configuration "A".

Usage::

    model = ResNet50(layers=(1, 1), width=8, num_classes=10)   # tiny
    model = ResNet50()                                         # the published one
    model, inputs = make("mobilenet_v2", "tiny")
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ResNet50", "MobileNetV2", "DenseNet121", "EfficientNetB0", "VGG11", "make", "WORKLOADS",
    "Bottleneck", "InvertedResidual", "DenseLayer", "MBConv", "MOBILENET_V2_SETTING", "EFFICIENTNET_B0_SETTING", "VGG11_CONFIG",
]


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of ``divisor``, never down by more than 10%."""
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _init(model: nn.Module) -> None:
    """He initialisation for convolutions, unit BN, small linear layers (as torchvision does)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


# -- ResNet-50 ----------------------------------------------------------------------------
def conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, groups=groups, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (stride here, as in torchvision's "ResNet v1.5"), 1×1 expand ×4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet50(nn.Module):
    """ResNet with bottleneck blocks; ``layers`` are the stage depths (one stage per entry),
    ``width`` the first stage's planes (64; stage i has ``width * 2**i``)."""

    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000, zero_init_residual: bool = False):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        for i, blocks in enumerate(layers):
            self.add_module(f"layer{i + 1}", self._make_layer(width * 2**i, blocks, stride=1 if i == 0 else 2))
        self.num_stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)
        _init(self)
        if zero_init_residual:  # each block starts as the identity (Goyal et al. 2017); off by default
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            out = planes * Bottleneck.expansion
            downsample = nn.Sequential(conv1x1(self.inplanes, out, stride), nn.BatchNorm2d(out))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# -- MobileNetV2 --------------------------------------------------------------------------
class ConvBNReLU6(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """1×1 expand (×t) with ReLU6, depthwise 3×3 with ReLU6, 1×1 linear projection."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = round(inp * expand_ratio)
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(inp, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),  # depthwise
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),  # linear bottleneck: no activation
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


MOBILENET_V2_SETTING = (
    # t, c, n, s: expansion, output channels, repeats, stride of the first repeat
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """``setting`` is the (t, c, n, s) table (``MOBILENET_V2_SETTING[:k]`` shortens it);
    channels are ``c * width_mult`` rounded to multiples of ``round_nearest``."""

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        setting: Sequence[tuple[int, int, int, int]] = MOBILENET_V2_SETTING,
        round_nearest: int = 8,
        last_channel: int = 1280,
        dropout: float = 0.2,
    ):
        super().__init__()
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [ConvBNReLU6(3, input_channel, stride=2)]
        for t, c, n, s in setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(ConvBNReLU6(input_channel, self.last_channel, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
        _init(self)

    def forward(self, x):
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


# -- DenseNet-121 -------------------------------------------------------------------------
class DenseLayer(nn.Module):
    """BN-ReLU-Conv1×1 (bn_size·growth) then BN-ReLU-Conv3×3 (growth), on the concatenation
    of every earlier feature map of the block."""

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int, drop_rate: float = 0.0):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, stride=1, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        concated = torch.cat(features, 1)
        bottleneck = self.conv1(self.relu1(self.norm1(concated)))
        new_features = self.conv2(self.relu2(self.norm2(bottleneck)))
        if self.drop_rate > 0:
            new_features = F.dropout(new_features, p=self.drop_rate, training=self.training)
        return new_features


class DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int, drop_rate: float = 0.0):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size, drop_rate))

    def forward(self, init_features):
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, 1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)


class DenseNet121(nn.Module):
    """``block_config``: layers per dense block (one block per entry)."""

    def __init__(
        self,
        growth_rate: int = 32,
        block_config: Sequence[int] = (6, 12, 24, 16),
        num_init_features: int = 64,
        bn_size: int = 4,
        drop_rate: float = 0.0,
        num_classes: int = 1000,
    ):
        super().__init__()
        self.features = nn.Sequential(
            OrderedDict(
                conv0=nn.Conv2d(3, num_init_features, 7, stride=2, padding=3, bias=False),
                norm0=nn.BatchNorm2d(num_init_features),
                relu0=nn.ReLU(inplace=True),
                pool0=nn.MaxPool2d(3, stride=2, padding=1),
            )
        )
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(num_layers, num_features, bn_size, growth_rate, drop_rate))
            num_features += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(num_features, num_features // 2))
                num_features //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x):
        features = self.features(x)
        out = F.relu(features, inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        out = torch.flatten(out, 1)
        return self.classifier(out)


# -- EfficientNet-B0 ----------------------------------------------------------------------
class ConvBNAct(nn.Sequential):
    """Conv (no bias), BN, then SiLU(inplace=True) unless ``act=False`` (torchvision's Conv2dNormActivation)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1, act: bool = True):
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            layers.append(nn.SiLU(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """Global average pool, 1×1 reduce, SiLU, 1×1 expand, sigmoid; scales the input's channels."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU(inplace=True)
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class MBConv(nn.Module):
    """Mobile inverted bottleneck: 1×1 expand, depthwise k×k, squeeze-and-excitation, 1×1 project.

    The residual is added in place when stride is 1 and channels match; stochastic depth on
    the residual branch is omitted (see the module docstring).
    """

    def __init__(self, cin: int, cout: int, expand_ratio: int, kernel: int, stride: int, divisor: int = 8):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = _make_divisible(cin * expand_ratio, divisor)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(ConvBNAct(cin, expanded, 1))
        layers.append(ConvBNAct(expanded, expanded, kernel, stride, groups=expanded))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4)))
        layers.append(ConvBNAct(expanded, cout, 1, act=False))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


EFFICIENTNET_B0_SETTING = (
    # expand ratio, kernel, stride, input channels, output channels, layers
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


class EfficientNetB0(nn.Module):
    """``width_mult``/``depth_mult`` scale channels and layer counts (B0: 1.0, 1.0);
    ``setting`` is the stage table (``EFFICIENTNET_B0_SETTING[:k]`` shortens it)."""

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        setting: Sequence[tuple[int, int, int, int, int, int]] = EFFICIENTNET_B0_SETTING,
        divisor: int = 8,
        dropout: float = 0.2,
    ):
        super().__init__()
        ch = lambda c: _make_divisible(c * width_mult, divisor)  # noqa: E731
        features: list[nn.Module] = [ConvBNAct(3, ch(setting[0][3]), 3, stride=2)]
        for t, k, s, cin, cout, n in setting:
            stage = []
            for i in range(math.ceil(n * depth_mult)):
                stage.append(MBConv(ch(cin) if i == 0 else ch(cout), ch(cout), t, k, s if i == 0 else 1, divisor))
            features.append(nn.Sequential(*stage))
        last_in = ch(setting[-1][4])
        features.append(ConvBNAct(last_in, 4 * last_in, 1))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(4 * last_in, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# -- VGG-11 -------------------------------------------------------------------------------
VGG11_CONFIG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")  # configuration "A"


class VGG11(nn.Module):
    """Channels are ``config * width`` (at least 1); the classifier has ``hidden`` units
    (4096) after adaptive pooling to ``pool``×``pool`` (7)."""

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        hidden: int = 4096,
        pool: int = 7,
        dropout: float = 0.5,
        batch_norm: bool = False,
        config: Sequence[int | str] = VGG11_CONFIG,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, stride=2))
                continue
            cout = max(1, int(cast(int, v) * width))
            layers.append(nn.Conv2d(cin, cout, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            nn.Linear(cin * pool * pool, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        _init(self)

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# -- registry -----------------------------------------------------------------------------
def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


WORKLOADS: dict[str, dict[str, Callable[[], tuple[nn.Module, tuple]]]] = {
    "resnet50": {
        "tiny": lambda: (ResNet50(layers=(1, 1), width=4, num_classes=5), (_images(2, 16),)),
        "real": lambda: (ResNet50(), (_images(32, 224),)),
        "bench": lambda: (ResNet50(width=16, num_classes=100), (_images(16, 64),)),
    },
    "mobilenet_v2": {
        "tiny": lambda: (
            MobileNetV2(num_classes=5, width_mult=0.25, setting=MOBILENET_V2_SETTING[:3], round_nearest=4, last_channel=32, dropout=0.0),
            (_images(2, 16),),
        ),
        "real": lambda: (MobileNetV2(), (_images(64, 224),)),
        "bench": lambda: (MobileNetV2(num_classes=100, width_mult=0.5), (_images(16, 64),)),
    },
    "densenet121": {
        "tiny": lambda: (DenseNet121(growth_rate=4, block_config=(3, 2), num_init_features=8, bn_size=2, num_classes=5), (_images(2, 16),)),
        "real": lambda: (DenseNet121(), (_images(32, 224),)),
        "bench": lambda: (DenseNet121(growth_rate=12, num_init_features=24, num_classes=100), (_images(16, 64),)),
    },
    "efficientnet_b0": {
        "tiny": lambda: (
            EfficientNetB0(num_classes=5, width_mult=0.25, depth_mult=0.5, setting=EFFICIENTNET_B0_SETTING[:3], divisor=4, dropout=0.0),
            (_images(2, 16),),
        ),
        "real": lambda: (EfficientNetB0(), (_images(32, 224),)),
        "bench": lambda: (EfficientNetB0(num_classes=100, width_mult=0.5, depth_mult=0.5), (_images(16, 64),)),
    },
    "vgg11": {
        "tiny": lambda: (VGG11(num_classes=5, width=1 / 16, hidden=16, pool=1, dropout=0.0), (_images(2, 32),)),
        "real": lambda: (VGG11(), (_images(32, 224),)),
        "bench": lambda: (VGG11(num_classes=100, width=0.25, hidden=512, pool=2), (_images(16, 64),)),
    },
}


def make(name: str, size: str = "tiny") -> tuple[nn.Module, tuple]:
    """A vision model and its example inputs: ``make("resnet50", "tiny")``."""
    return WORKLOADS[name][size]()
