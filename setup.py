"""The one native helper: the UDP MAC over whole runs of datagrams (transport/_udpmac.c,
docs/wire.md "UDP MAC"). Optional: without a C compiler the install goes on and
dgt.transport.udpmac computes the same MAC in Python, slowly. Everything else is in
setup.cfg."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("dgt.transport._udpmac", ["transport/_udpmac.c"],
                             extra_compile_args=["-O3"], optional=True)])
