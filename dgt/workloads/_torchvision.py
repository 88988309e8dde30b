"""Import torchvision on a machine whose torchvision C extension cannot load.

Why: ``torchvision==0.28.0`` is the release that matches ``torch==2.13.0``. Where pip
takes a torchvision wheel built for CUDA beside a CPU-only torch (as on this project's
build machines), its C extension fails to load (``libc10_cuda.so`` missing). torchvision
itself copes with that (``torchvision.extension._has_ops()`` is then False), except in
``torchvision/_meta_registrations.py``, which registers fake kernels for exactly two
operators, ``torchvision::nms`` and ``torchvision::qnms``, without checking, so
``import torchvision`` dies with ``RuntimeError: operator torchvision::nms does not
exist``.

What we do: import torchvision; only on that exact error, define the two operators'
schemas (as torchvision's C++ extension would, ``torchvision/csrc/ops/nms.cpp``), drop the
half-imported modules and import again. The detection operators then have no kernel
(calling ``torchvision.ops.nms`` raises); dgt uses only torchvision's models, datasets and
transforms, which are pure Python. With a working extension nothing is defined.

Use :func:`torchvision` instead of ``import torchvision`` everywhere in dgt.
"""
from __future__ import annotations

import sys

_LIB = None   # the torch.library.Library that holds the two schemas; must stay alive
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_MISSING = "operator torchvision::nms does not exist"


def torchvision():
    """The ``torchvision`` module, imported as described above.

    Raises ImportError (torchvision not installed: ``pip install torchvision==0.28.0``)
    and any other error of torchvision's own import unchanged.
    """
    global _LIB
    try:
        import torchvision as tv
        return tv
    except RuntimeError as e:
        if _MISSING not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    import torch
    _LIB = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _LIB.define(schema)
    import torchvision as tv
    return tv


def extension_loaded() -> bool:
    """True when torchvision's own C extension loaded (its detection ops work)."""
    return _LIB is None and bool(torchvision().extension._has_ops())
