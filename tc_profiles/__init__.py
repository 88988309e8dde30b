"""dgt.tc_profiles: YAML tc profiles, the pyroute2 applier, and the netns testbed.

Stands alone: imports nothing else from ``dgt`` (docs/architecture.md, "Layers";
checked by tests/test_layering.py).

- :mod:`.schema`: load and validate profiles (``list_profiles``, ``load_profile``).
- :mod:`.applier`: ``apply``, ``show``, ``clear``, ``dry_run``, ``render_table``.
- :mod:`.names`: the testbed's prefix rule and derived names (no pyroute2).
- :mod:`.testbed`: ``up``, ``down``, ``status``, ``host_netns``, ``host_addr``, ``exec_in``.
- :mod:`.priority_check`: measure DSCP priority under bulk load.
- :mod:`.cli`: ``register(subparsers)`` adds ``dgt tc`` and ``dgt testbed``.
"""
import importlib

_EXPORTS = {
    "MissingQdiscError": "applier", "TcError": "applier", "apply": "applier",
    "check_kernel": "applier", "clear": "applier", "dry_run": "applier",
    "render_table": "applier", "show": "applier", "strip_counters": "applier",
    "Profile": "schema", "ProfileError": "schema", "list_profiles": "schema",
    "load_profile": "schema",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    """Load the submodule that defines ``name`` on first use (PEP 562), so importing
    a light submodule such as :mod:`.names` does not pull in pyroute2."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
