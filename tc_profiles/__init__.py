"""dgt.tc_profiles: YAML tc profiles, the pyroute2 applier, and the netns testbed.

Stands alone: imports nothing else from ``dgt`` (docs/architecture.md, "Layers").

- :mod:`.schema`: load and validate profiles (``list_profiles``, ``load_profile``).
- :mod:`.applier`: ``apply``, ``show``, ``clear``, ``dry_run``, ``render_table``.
- :mod:`.testbed`: ``up``, ``down``, ``status``, ``host_netns``, ``host_addr``, ``exec_in``.
- :mod:`.priority_check`: measure DSCP priority under bulk load.
- :mod:`.cli`: ``register(subparsers)`` adds ``dgt tc`` and ``dgt testbed``.
"""
from .applier import (MissingQdiscError, TcError, apply, check_kernel, clear, dry_run,
                      render_table, show, strip_counters)
from .schema import Profile, ProfileError, list_profiles, load_profile

__all__ = ["MissingQdiscError", "Profile", "ProfileError", "TcError", "apply",
           "check_kernel", "clear", "dry_run", "list_profiles", "load_profile",
           "render_table", "show", "strip_counters"]
