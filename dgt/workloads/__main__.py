"""``python -m dgt.workloads --table``: each model's parameters and gradient bytes per
width and dataset, as the Markdown table in docs/workloads.md."""
from __future__ import annotations

import sys

from ..config import JobConfig, OneLineParser
from . import MODELS
from .datasets import CLASSES, SHAPES

WIDTHS = (0.125, 0.25, 0.5, 1.0)


def table(widths=WIDTHS, datasets=("fashion-mnist", "cifar10")) -> list[str]:
    """Markdown rows: model, width, then params and gradient MB (fp32, 4 bytes per
    parameter = one push) per dataset. The MLP's row is its --hidden 1024 default."""
    from .models import count_params, gradient_bytes
    head = "| model | width |" + "".join(f" {d} params | {d} gradient bytes |"
                                       for d in datasets)
    out = [head, "|" + "---|" * (2 + 2 * len(datasets))]
    for m in MODELS:
        for w in ((1.0,) if m == "mlp" else widths):
            cells = []
            for d in datasets:
                n = count_params(m, SHAPES[d], CLASSES, w, JobConfig.hidden)
                cells += [f"{n:,}", f"{gradient_bytes(n):,}"]
            label = f"hidden {JobConfig.hidden}" if m == "mlp" else f"{w:g}"
            out.append(f"| {m} | {label} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m dgt.workloads",
                      description="Facts about dgt's workloads (models, datasets).")
    p.add_argument("--table", action="store_true",
                   help="print each model's parameters and gradient bytes per width")
    ns = p.parse_args(argv)
    if not ns.table:
        p.error("nothing to do; give --table")
    print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
