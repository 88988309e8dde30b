"""The native helpers, both optional: without a C compiler the install goes on and the
Python paths compute the same bits, slower.

- the UDP MAC over whole runs of datagrams (transport/_udpmac.c, docs/wire.md "UDP
  MAC"); without it dgt.transport.udpmac computes it in Python;
- the int8 block codec in one pass per block (dgt/_int8codec.c, docs/wire.md "Block
  codings"); without it dgt.codec uses torch's kernels. No fused multiply-add
  (-ffp-contract=off), no fast-math: each step rounds as torch's does.

Everything else is in setup.cfg."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("dgt.transport._udpmac", ["transport/_udpmac.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("dgt._int8codec", ["dgt/_int8codec.c"],
                             extra_compile_args=["-O3", "-ffp-contract=off",
                                                 "-fno-fast-math"], optional=True)])
