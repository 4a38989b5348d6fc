"""The one C extension, ``ext_proc/_jsonscan.c`` (intake's scan and the estimate's per-element loops);
everything else is in pyproject.toml. (setup.py rather than pyproject's ``ext-modules``, which setuptools
still calls experimental.) Optional: without a C compiler the install goes on, and intake and the
estimate use their pure-Python passes (the same answers but for the caps only the C pass counts; slower
on large bodies: ``kvgate bench intake``). ``KVGATE_REQUIRE_C=1`` makes a failed build an error (the
image's build stage sets it)."""

import os

from setuptools import Extension, setup

setup(ext_modules=[Extension("ext_proc._jsonscan", ["ext_proc/_jsonscan.c"],
                             optional=os.environ.get("KVGATE_REQUIRE_C") != "1")])
