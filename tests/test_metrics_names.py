"""The exported metric names: Prometheus conventions, documented, and the only names the
Grafana dashboard uses; and 'dgt --help' loads none of the drawing/metrics libraries."""
import json
import re
import subprocess
import sys
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dgt.config import TransmissionConfig
from dgt.metrics import make_registry
from dgt.sidecar import NodeConfig, Sidecar

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROMQL_WORDS = {"rate", "irate", "increase", "sum", "by", "without", "avg", "max", "min",
                "histogram_quantile", "le", "instance", "job", "channel", "reason",
                "rank", "count", "topk", "on", "ignoring"}


def exported(tmp_path) -> dict[str, str]:
    """({family name: type}, sample names) of a sidecar's registry."""
    sc = Sidecar(TransmissionConfig(), NodeConfig(rank=0, world=1, run_dir=str(tmp_path)))
    sc.counters.rejected["stray"] += 1   # a labelled sample, as after a stray message
    text = generate_latest(make_registry(sc)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name for f in fams.values() for s in f.samples}
    return {n: f.type for n, f in fams.items()}, samples | {"dgt_residual_norm"}


def test_names_follow_prometheus_conventions(tmp_path):
    fams, samples = exported(tmp_path)
    for name, typ in fams.items():
        assert re.fullmatch(r"[a-z_]+", name)
        assert name.startswith(("dgt_", "process_"))
        if typ == "counter":   # the parser strips _total from a counter family's name
            assert name + "_total" in samples, name
        if "seconds" in name or typ == "histogram":
            assert "_seconds" in name or "per_second" in name, name
    assert "dgt_comm_seconds_bucket" in samples
    assert "process_cpu_seconds_total" in samples


def test_every_metric_is_documented(tmp_path):
    fams, _ = exported(tmp_path)
    doc = (DOCS / "metrics.md").read_text()
    for name, typ in fams.items():
        shown = name + "_total" if typ == "counter" else name
        assert f"`{shown}`" in doc or shown in doc, shown
    assert "`dgt_residual_norm`" in doc


def test_dashboard_uses_only_exported_metrics(tmp_path):
    _, samples = exported(tmp_path)
    dash = json.loads((DOCS / "grafana-dgt.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = set()
    for e in exprs:
        e = re.sub(r"\{[^}]*\}", "", e)        # label matchers
        e = re.sub(r"\[[^\]]*\]", "", e)       # range selectors
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
            if word not in PROMQL_WORDS:
                used.add(word)
    unknown = used - samples
    assert not unknown, unknown
    assert {"dgt_channel_bytes_sent_total", "dgt_comm_seconds_bucket"} <= used


def test_help_loads_no_metrics_or_drawing_library():
    code = ("import sys, contextlib, io\nimport dgt.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: dgt.cli.main(['--help'])\n"
            "    except SystemExit: pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'prometheus_client', 'rich', 'matplotlib'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr



def test_no_label_is_one_prometheus_sets_on_every_sample(tmp_path):
    """Breaker round 17: dgt_sidecar_info had a label 'job', the label Prometheus gives
    every sample it scrapes (the scrape job's name, which the dashboard filters on), so
    a default scrape kept ours as 'exported_job'."""
    sc = Sidecar(TransmissionConfig(), NodeConfig(rank=0, world=1, run_dir=str(tmp_path)))
    sc.counters.rejected["stray"] += 1
    text = generate_latest(make_registry(sc)).decode()
    labels = {k for f in text_string_to_metric_families(text) for s in f.samples
              for k in s.labels}
    assert labels & {"job", "instance"} == set()
    assert "session_digest" in labels
