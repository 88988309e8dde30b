"""The models of ``dgt train --model``: mlp, cnn, alexnet, vgg11, googlenet, resnet18.

The DGT paper trains GoogLeNet, AlexNet and VGG-11 on Fashion-MNIST and CIFAR-10
(Zhou et al., FGCS 2021, section 5). Those images are 28x28 and 32x32, far below the
224x224 that torchvision's ImageNet definitions are built for, so for inputs smaller than
:data:`TORCHVISION_MIN_SIDE` pixels dgt builds the standard small-input ("CIFAR-style")
variants, from torchvision's own building blocks where it has them:

- ``mlp``: flatten, then ``in -> H -> H -> classes`` with ReLU (H = ``hidden``; the
  original ``dgt train`` model, bit for bit);
- ``cnn``: two 3x3 conv (32w, 64w channels) + ReLU + 2x2 max-pool, then a 128w hidden
  layer: small, trains in seconds per hundred iterations on one CPU core;
- ``alexnet``: the CIFAR AlexNet: five 3x3 convs (64w, 192w, 384w, 256w, 256w) with three
  max-pools, then two 1024w hidden layers with dropout (Krizhevsky et al. 2012,
  scaled to 32x32);
- ``vgg11``: torchvision's VGG configuration "A" (``torchvision.models.vgg.cfgs['A']``:
  8 convs, 64w..512w) with a normalisation after each conv and one linear classifier
  (the usual CIFAR VGG); a max-pool is skipped once the feature map is 1 pixel;
- ``googlenet``: the CIFAR GoogLeNet (a 3x3 stem of 192w channels, no stride), then
  torchvision's ``Inception`` blocks 3a..5b with their channel counts times w
  (Szegedy et al. 2015), global average pool, linear;
- ``resnet18``: torchvision's ``BasicBlock`` in [2, 2, 2, 2] stages (64w..512w) with the
  CIFAR stem (3x3 conv, stride 1, no max-pool) (He et al. 2016).

Normalisation: ``GroupNorm`` in place of BatchNorm (Wu & He 2018). It keeps no running
statistics, so a model is its parameters alone: every replica evaluates the same, and
non-IID shards do not skew a per-worker batch statistic (Hsieh et al. 2020).

At ``TORCHVISION_MIN_SIDE`` pixels or more, with 3 channels and width 1, the models
are torchvision's own definitions (``alexnet``, ``vgg11``, ``googlenet(aux_logits=False)``,
``resnet18``; random init, ``num_classes`` outputs).

``width`` multiplies every channel and hidden-unit count (at least 1 each); 1.0 is the
published size.
"""
from __future__ import annotations


from . import MODELS  # noqa: F401  (one list of names)
TORCHVISION_MIN_SIDE = 64


def _c(n: int, width: float) -> int:
    return max(1, int(round(n * width)))


def norm(channels: int):
    """GroupNorm with groups of at least 4 channels (one group below 8 channels)."""
    from torch import nn
    groups = next(g for g in (8, 4, 2, 1) if channels % g == 0 and channels // g >= 4) \
        if channels >= 8 else 1
    return nn.GroupNorm(groups, channels)


def build(name: str, shape: tuple, classes: int = 10, width: float = 1.0,
          hidden: int = 1024, seed: int | None = None):
    """A fresh model for inputs of ``shape`` (C, H, W) and ``classes`` outputs.

    ``seed``: when given, ``torch.manual_seed(seed)`` first, so every rank builds the same
    initial parameters. Input: float32 (n, C, H, W); output: float32 logits
    (n, classes). Raises ValueError for an unknown name or width <= 0.
    """
    import torch
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")
    if not width > 0:
        raise ValueError(f"--width must be > 0, got {width}")
    if seed is not None:
        torch.manual_seed(seed)
    c, h, w = shape
    if name == "mlp":
        return _mlp(c * h * w, hidden, classes)
    if uses_torchvision_definition(name, shape, width):
        return _torchvision_model(name, classes)
    return {"cnn": _cnn, "alexnet": _alexnet, "vgg11": _vgg11, "googlenet": _googlenet,
            "resnet18": _resnet18}[name](c, h, classes, width)


def count_params(name: str, shape: tuple, classes: int = 10, width: float = 1.0,
                 hidden: int = 1024) -> int:
    """Trainable parameters of ``build(name, ...)``, counted on PyTorch's meta device
    (no memory allocated, no init run)."""
    import torch
    with torch.device("meta"):
        m = build(name, shape, classes, width, hidden)
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def _mlp(inputs: int, hidden: int, classes: int):
    from torch import nn
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _cnn(c: int, side: int, classes: int, width: float):
    from torch import nn
    c1, c2, hid = _c(32, width), _c(64, width), _c(128, width)
    s = side // 2 // 2
    return nn.Sequential(
        nn.Conv2d(c, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * s * s, hid), nn.ReLU(), nn.Linear(hid, classes))


def _alexnet(c: int, side: int, classes: int, width: float):
    from torch import nn
    ch = [_c(n, width) for n in (64, 192, 384, 256, 256)]
    hid = _c(1024, width)
    layers, prev, s = [], c, side
    for i, out in enumerate(ch):
        layers += [nn.Conv2d(prev, out, 3, padding=1), nn.ReLU(inplace=True)]
        if i in (0, 1, 4) and s >= 2:
            layers.append(nn.MaxPool2d(2))
            s //= 2
        prev = out
    return nn.Sequential(*layers, nn.Flatten(), nn.Dropout(0.5),
                         nn.Linear(prev * s * s, hid), nn.ReLU(inplace=True), nn.Dropout(0.5),
                         nn.Linear(hid, hid), nn.ReLU(inplace=True), nn.Linear(hid, classes))


def _vgg11(c: int, side: int, classes: int, width: float):
    from torch import nn
    layers, prev, s = [], c, side
    for v in _tv("vgg").cfgs["A"]:
        if v == "M":
            if s >= 2:
                layers.append(nn.MaxPool2d(2))
                s //= 2
            continue
        out = _c(v, width)
        layers += [nn.Conv2d(prev, out, 3, padding=1), norm(out), nn.ReLU(inplace=True)]
        prev = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(prev, classes))


def _googlenet(c: int, side: int, classes: int, width: float):
    import torch
    from torch import nn
    Inception = _tv("googlenet").Inception

    class Conv(nn.Module):   # torchvision's BasicConv2d, GroupNorm for BatchNorm
        def __init__(self, cin, cout, **kw):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
            self.bn = norm(cout)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))

    # torchvision.models.GoogLeNet's inception configurations (in, 1x1, 3x3red, 3x3,
    # 5x5red, 5x5, pool proj); "M": the stride-2 max-pools between stages
    cfg = [(192, 64, 96, 128, 16, 32, 32), (256, 128, 128, 192, 32, 96, 64), "M",
           (480, 192, 96, 208, 16, 48, 64), (512, 160, 112, 224, 24, 64, 64),
           (512, 128, 128, 256, 24, 64, 64), (512, 112, 144, 288, 32, 64, 64),
           (528, 256, 160, 320, 32, 128, 128), "M",
           (832, 256, 160, 320, 32, 128, 128), (832, 384, 192, 384, 48, 128, 128)]
    stem = _c(192, width)
    layers = [Conv(c, stem, kernel_size=3, padding=1)]
    prev = stem
    for blk in cfg:
        if blk == "M":
            layers.append(nn.MaxPool2d(3, stride=2, padding=1))
            continue
        _, *chs = blk
        chs = [_c(n, width) for n in chs]
        layers.append(Inception(prev, *chs, conv_block=Conv))
        prev = chs[0] + chs[2] + chs[4] + chs[5]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(prev, classes))


def _resnet18(c: int, side: int, classes: int, width: float):
    from torch import nn
    BasicBlock = _tv("resnet").BasicBlock
    stem = _c(64, width)
    layers = [nn.Conv2d(c, stem, 3, padding=1, bias=False), norm(stem), nn.ReLU(inplace=True)]
    prev = stem
    for i, planes in enumerate(_c(n, width) for n in (64, 128, 256, 512)):
        stride = 1 if i == 0 else 2
        for b in range(2):
            s = stride if b == 0 else 1
            down = None
            if s != 1 or prev != planes:
                down = nn.Sequential(nn.Conv2d(prev, planes, 1, stride=s, bias=False),
                                     norm(planes))
            layers.append(BasicBlock(prev, planes, s, down, norm_layer=norm))
            prev = planes
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(prev, classes))


def uses_torchvision_definition(name: str, shape: tuple, width: float) -> bool:
    """True when ``build`` returns torchvision's ImageNet definition (see the module
    docstring), False for the small-input variant."""
    return name not in ("mlp", "cnn") and shape[0] == 3 and width == 1.0 \
        and min(shape[1:]) >= TORCHVISION_MIN_SIDE


def _torchvision_model(name: str, classes: int):
    tv = _tv()
    if name == "googlenet":
        return tv.models.googlenet(weights=None, aux_logits=False, init_weights=True,
                                   num_classes=classes)
    return getattr(tv.models, name)(weights=None, num_classes=classes)


def _tv(module: str | None = None):
    """torchvision (see :mod:`dgt.workloads._torchvision`), or its ``models.<module>``."""
    import importlib
    from ._torchvision import torchvision
    tv = torchvision()
    return importlib.import_module(f"torchvision.models.{module}") if module else tv


def gradient_bytes(n_params: int) -> int:
    """Bytes of one fp32 gradient (or FedAvg delta) push: 4 per parameter."""
    return 4 * n_params


def describe(name: str, shape: tuple, classes: int, width: float, hidden: int) -> dict:
    n = count_params(name, shape, classes, width, hidden)
    return {"model": name, "width": width, "hidden": hidden if name == "mlp" else None,
            "params": n, "gradient_bytes": gradient_bytes(n),
            "torchvision_definition": uses_torchvision_definition(name, shape, width)}


