"""The ``dgt`` command line: train, sidecar, and the tc/testbed/capture/replay tools."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import __version__

if TYPE_CHECKING:   # annotations only: argparse is imported inside main's handling
    import argparse

# every other import is made inside main()'s handling of Ctrl-C (see main): an import
# here runs before it, where a Ctrl-C is a traceback (breaker round 14's re-check: one
# at 'import argparse', 2 of 25 Ctrl-C's 0.01 to 0.15 s after the start)


def _train(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .config import CheckpointConfig, JobConfig, MetricsConfig, TransmissionConfig, \
        from_args
    from .metrics import check_metrics_ports
    try:
        job = from_args(JobConfig, ns)
        tx = from_args(TransmissionConfig, ns)
        metrics = from_args(MetricsConfig, ns)
        ckpt = from_args(CheckpointConfig, ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.k_min is not None and not tx.adaptive_k and not tx.time_budget_ms:
        parser.error("--k-min only applies with --adaptive-k or --time-budget-ms; add "
                     "one of them or drop --k-min")
    if ns.local_steps is not None and job.algo != "fedavg":
        parser.error("--local-steps only applies with --algo fedavg; add --algo fedavg or "
                     "drop --local-steps")
    for line in job.warnings() + tx.warnings() + metrics.warnings() + ckpt.warnings():
        parser.warning(line)
    from .fdlimit import ensure
    try:   # before torch opens its files; the children inherit it
        ensure(job.workers)
    except ValueError as e:
        parser.error(str(e))
    from .interrupt import import_torch
    import_torch()   # a Ctrl-C meanwhile comes after it, not inside torch's C++
    from .job import check_workload
    from .launch import (check_checkpoint_dir, check_memory, check_paths, check_ports,
                         resume_from, run_job)
    try:
        check_ports(job, metrics)   # the endpoints against the job's own ports
        if metrics.metrics_port and not job.testbed:   # on loopback: rank r, port + r
            check_metrics_ports(metrics, job.workers)
        check_paths(job, ckpt)
        for line in check_workload(job):
            parser.warning(line)
        check_memory(job)
        # the step folder itself: run_job checks it again, without a second warning
        ckpt.resume = resume_from(ckpt, job, tx)
        if ckpt.checkpoint_every and ckpt.checkpoint_dir:
            check_checkpoint_dir(ckpt.checkpoint_dir)
    except ValueError as e:
        parser.error(str(e))
    code, _ = run_job(job, tx, metrics=metrics, ckpt=ckpt)
    return code


def _sidecar(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os

    from .config import NodeConfig, default_run_dir, from_args
    from .rendezvous import QUIET_TORCH_ENV, check_resolves
    from .run_files import check_run_dir
    for k, v in QUIET_TORCH_ENV.items():   # before torch is imported
        os.environ.setdefault(k, v)
    try:   # a name that does not resolve fails now, before the slow imports
        node = from_args(NodeConfig, ns)
        check_resolves(node.master_addr)
        # a --run-dir given (not dgt's own default folder): new, empty or an earlier job's
        if os.path.abspath(node.run_dir) != os.path.abspath(default_run_dir()):
            check_run_dir(node.run_dir, keep=(node.socket,))
    except ValueError as e:
        parser.error(str(e))
    from .interrupt import import_torch
    import_torch()   # a Ctrl-C meanwhile comes after it, not inside torch's C++
    from .sidecar import run_from_args
    code = run_from_args(ns, parser)
    from .process import exit_now
    exit_now(int(code or 0))   # a TCPStore thread left must not abort the exit (there)


#: entry-point group through which the tc/testbed and tools layers add their
#: subcommands: ``dgt`` itself never imports ``dgt.tools`` (the layer rule), the tools
#: register themselves (setup.cfg, ``[options.entry_points]``)
COMMAND_GROUP = "dgt.commands"


def _command_plugins():
    """The ``dgt.commands`` entry points, each a ``register(subparsers)`` callable."""
    from importlib.metadata import entry_points
    return sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)


def build_parser() -> argparse.ArgumentParser:
    from .config import (CheckpointConfig, JobConfig, MetricsConfig, OneLineParser,
                         TransmissionConfig, add_arguments, add_sidecar_arguments)
    p = OneLineParser(prog="dgt", description="Contribution-aware differential "
                                "gradient transmission for data-parallel training.")
    p.add_argument("--version", action="version", version=f"dgt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("train", help="run the training job (sidecars + trainers)",
                       description="Train a model (default: an MLP on the scikit-learn digits) "
                       "with N workers, one sidecar each, over loopback (or the testbed "
                       "with --testbed); BSP or FedAvg, IID or non-IID shards. See "
                       "docs/workloads.md.")
    add_arguments(t, JobConfig)
    add_arguments(t, TransmissionConfig)
    add_arguments(t, MetricsConfig)
    add_arguments(t, CheckpointConfig)
    t.set_defaults(func=lambda ns: _train(ns, t), parser=t, owns_cleanup=True)

    s = sub.add_parser("sidecar", help="run one node's sidecar",
                       description="Run one node's sidecar (worker agent + server shard).")
    add_sidecar_arguments(s)
    s.set_defaults(func=lambda ns: _sidecar(ns, s), parser=s)

    for ep in _command_plugins():
        ep.load()(sub)
    for sp in sub.choices.values():   # a plugin's wrong flag names its own command
        if sp.get_default("parser") is None:
            sp.set_defaults(parser=sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """``dgt``: parse ``argv`` and run the subcommand. Ctrl-C (or a signal a command
    turns into it, dgt.interrupt) at any point, even while the parser is built and the
    subcommands import numpy and torch, is one line and the shell's status (130)."""
    from .interrupt import defer_stop_signals, keep_lost_interrupts, release_stop_signals
    defer_stop_signals()     # a stop signal before the command takes them: kept for it
    keep_lost_interrupts()   # a Ctrl-C inside an import's callback: not swallowed
    try:
        return _main(argv)
    except KeyboardInterrupt:
        from .interrupt import interrupted
        return interrupted("dgt")
    finally:   # a return before the command took them (bad cwd or environment):
        release_stop_signals(deliver=False)   # the status says what happened


def _main(argv: list[str] | None) -> int:
    import os
    try:   # torch's libraries fail to load from a removed folder (oneMKL: "FATAL ERROR")
        os.getcwd()
    except FileNotFoundError:
        print("dgt: error: the current folder no longer exists (it was removed after "
              "this shell entered it); cd to one that does", file=sys.stderr)
        return 2
    from .hugepages import env_problem
    problem = env_problem()   # before numpy loads (the subcommands import it)
    if problem:
        print(f"dgt: error: {problem}", file=sys.stderr)
        return 2
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose flags were wrong, not the top level
        getattr(ns, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    from .console import survive_closed_stdout
    survive_closed_stdout()   # 'dgt train | head' must not stop the job
    from .interrupt import interrupted, release_stop_signals, stop_on_signals
    try:
        if getattr(ns, "owns_cleanup", False):   # a command that builds state: SIGTERM,
            stop_on_signals()   # SIGHUP (and SIGINT, even if ignored) stop it as Ctrl-C
        else:                   # does, also one that came during start-up; the others
            release_stop_signals()   # get what the process inherited
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt as e:   # a command that left it to us: one line, 128 + sig
        undone = e.args[0] if e.args and isinstance(e.args[0], str) else ""
        return interrupted(getattr(ns, "parser", parser).prog, undone)


if __name__ == "__main__":
    sys.exit(main())
