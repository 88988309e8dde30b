"""Modules imported on first use, so that a command's ``--help`` pays nothing for them."""
from __future__ import annotations

import importlib


class OnFirstUse:
    """Stands for module ``name`` (relative to ``package``) and imports it on the first
    attribute access. ``dgt --help``, ``dgt tc --help`` and ``dgt testbed --help`` must
    not pay for pyroute2 (about a second cold), which ``applier`` and ``testbed`` load.
    Raises ImportError at that first access, as an import would."""

    def __init__(self, name: str, package: str | None = __package__):
        self._name, self._package = name, package

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name, self._package), attr)
